// One register tile of y = x @ W^T: R rows of x by C rows (output columns) of W, in the reduction
// order that linear.cpp documents. Included once per instruction set by linear.cpp, inside a
// namespace that defines `Lanes` (16 logical fp32 lanes: zero, load, load_tail, fma, sum; and the
// steps of `sums` on a register S of GROUP outputs) and
// under that instruction set's `#pragma GCC target`, so the same source yields both variants.
// Every accumulator acc[r][c] is one output's 16 lanes; the tile shape only groups independent
// outputs, so it never changes any output's order. W's elements are `WT`: float, or BF16, which
// Lanes::load widens to fp32 exactly (a bf16 is the top half of an fp32), so a bf16 W gives the
// bits of the same W widened to fp32 beforehand.

// How far ahead (elements of W) a one-row tile asks for W: a lone row streams W once, and the
// hardware prefetcher alone left the lm_head at ~21 GB/s of ~29 (Intel Xeon, 2 threads).
static constexpr int64_t PREFETCH_AHEAD = 512;

// The sums of GROUP outputs' lanes at once, one float of each in a register S, in order: Lanes::sum's
// tree, lower lanes first, each level adding the halves of two registers' outputs, a few instructions
// an output against sum()'s 8. The instruction set gives the steps: `first` (l[j] + l[j+8]), 128-bit
// blocks of two registers (`blocks_even`, `blocks_odd`), `shuffle` within blocks, and `in_order`,
// which puts the outputs back in order at the end. `acc`: the outputs' lanes one after the other in
// memory (float*), or their registers (Lanes::V*).
template <typename Acc>
static inline typename Lanes::S lane_trees(Acc acc) {
  using S = typename Lanes::S;
  S s8[8], s4[4], s2[2];
  for (int p = 0; p < 8; ++p) s8[p] = Lanes::first(acc, p);
  for (int p = 0; p < 4; ++p)
    s4[p] = Lanes::add(Lanes::blocks_even(s8[2 * p], s8[2 * p + 1]), Lanes::blocks_odd(s8[2 * p], s8[2 * p + 1]));
  for (int p = 0; p < 2; ++p)
    s2[p] = Lanes::add(Lanes::template shuffle<0x44>(s4[2 * p], s4[2 * p + 1]),
                       Lanes::template shuffle<0xEE>(s4[2 * p], s4[2 * p + 1]));
  return Lanes::in_order(Lanes::add(Lanes::template shuffle<0x88>(s2[0], s2[1]),
                                    Lanes::template shuffle<0xDD>(s2[0], s2[1])));
}

// y[i] = sum(lanes of output i) (+ bias[i]) for `count` outputs whose 16 lanes lie one after the other
// from acc (readable up to a multiple of Lanes::GROUP outputs), by `lane_trees`.
static inline void sums(const float* acc, int64_t count, const float* bias, float* y) {
  for (int64_t i = 0; i < count; i += Lanes::GROUP, acc += 16 * Lanes::GROUP)
    Lanes::store_sums(y + i, lane_trees(acc), count - i, bias != nullptr ? bias + i : nullptr);
}

// What a tile writes: each output's sum (Lanes::sum, one output at a time), its 16 lanes at y + (r * C +
// c) * 16 (for `sums` over many tiles), or its outputs' sums GROUP at a time in registers (`lane_trees`).
// The three give every output the same tree.
enum class Out { sum, lanes, trees };

template <int R, int C, typename WT, Out OUT = Out::sum, bool AHEAD = false>
static void tile(const float* x, int64_t ldx, const WT* w, int64_t ldw, int64_t K,
                 const float* bias, float* y, int64_t ldy, const float* carried = nullptr) {
  typename Lanes::V acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = carried != nullptr ? Lanes::load(carried + (r * C + c) * 16) : Lanes::zero();
  const int64_t k_full = K & ~int64_t(15);
  for (int64_t k = 0; k < k_full; k += 16) {
    typename Lanes::V wv[C];
    for (int c = 0; c < C; ++c) wv[c] = Lanes::load(w + c * ldw + k);
    if constexpr (R == 1 || AHEAD)  // a hint only: it changes no value
      for (int c = 0; c < C; ++c) __builtin_prefetch(w + c * ldw + k + PREFETCH_AHEAD);
    for (int r = 0; r < R; ++r) {
      typename Lanes::V xv = Lanes::load(x + r * ldx + k);
      if constexpr (C > 1) Lanes::in_register(xv);  // one load for C FMAs
      for (int c = 0; c < C; ++c) acc[r][c] = Lanes::fma(xv, wv[c], acc[r][c]);
    }
  }
  if (k_full < K) {  // the tail, zero-padded to 16 lanes: one more FMA step on every lane
    const int tail = int(K - k_full);
    typename Lanes::V wv[C];
    for (int c = 0; c < C; ++c) wv[c] = Lanes::load_tail(w + c * ldw + k_full, tail);
    for (int r = 0; r < R; ++r) {
      const typename Lanes::V xv = Lanes::load_tail(x + r * ldx + k_full, tail);
      for (int c = 0; c < C; ++c) acc[r][c] = Lanes::fma(xv, wv[c], acc[r][c]);
    }
  }
  if constexpr (OUT == Out::trees) {
    constexpr int N = R * C, G = Lanes::GROUP;
    typename Lanes::V flat[(N + G - 1) / G * G];
    for (int o = 0; o < (N + G - 1) / G * G; ++o) flat[o] = o < N ? acc[o / C][o % C] : Lanes::zero();
    for (int g = 0; g < N; g += G) {
      float out[G];
      // (parenthesised: no argument-dependent lookup of another instruction set's copy of this file)
      Lanes::store_sums(out, (lane_trees)(flat + g), G, nullptr);
      for (int i = 0; i < G && g + i < N; ++i) {
        const int r = (g + i) / C, c = (g + i) % C;
        y[r * ldy + c] = bias != nullptr ? out[i] + bias[c] : out[i];
      }
    }
    return;
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      if constexpr (OUT == Out::lanes) {
        Lanes::store(y + (r * C + c) * 16, acc[r][c]);
      } else {
        float s = Lanes::sum(acc[r][c]);
        if (bias != nullptr) s = s + bias[c];
        y[r * ldy + c] = s;
      }
    }
}

// The tile of `rows` x `cols` (at most Lanes::ROWS x Lanes::cols(rows)), found by a search over the
// instantiations: a few comparisons per tile, against a K loop of K / 16 steps.
template <int R, int C, typename WT, Out OUT = Out::sum, bool AHEAD = false>
static void any_tile(int rows, int cols, const float* x, int64_t ldx, const WT* w, int64_t ldw, int64_t K,
                     const float* bias, float* y, int64_t ldy, const float* carried = nullptr) {
  if (rows == R && cols == C) {
    tile<R, C, WT, OUT, AHEAD>(x, ldx, w, ldw, K, bias, y, ldy, carried);
  } else if constexpr (C > 1) {
    any_tile<R, C - 1, WT, OUT, AHEAD>(rows, cols, x, ldx, w, ldw, K, bias, y, ldy, carried);
  } else if constexpr (R > 1) {
    any_tile<R - 1, Lanes::cols(R - 1), WT, OUT, AHEAD>(rows, cols, x, ldx, w, ldw, K, bias, y, ldy, carried);
  }
}

// K elements a chunk of `interleaved_columns` carries its lanes over: 2 KiB of a row of W, 16 KiB of 8 rows of x
// (256 and 1024 measured slower).
static constexpr int64_t CHUNK = 512;

// One row group's tiles over a chunk of K (`length` elements from x and w) for `cols` columns, cols(rows)
// at a time: each output's lanes start from `lanes` (or at +0, `first`) and go back there, or, in the `last`
// chunk, its sum (and bias) goes to y. Every group's tiles ask for W ahead: whichever runs keeps the stream
// going (faster than the first group alone).
template <typename WT>
static void chunk_tiles(int rows, int cols, const float* x, int64_t ldx, const WT* w, int64_t ldw,
                        int64_t length, bool first, bool last, const float* bias, float* y, int64_t ldy, float* lanes) {
  const int step = Lanes::cols(rows);
  for (int c = 0; c < cols; c += step) {
    const int tile_cols = cols - c < step ? cols - c : step;
    float* carry = lanes + c * rows * 16;
    const float* from = first ? nullptr : carry;
    if (last)
      any_tile<Lanes::ROWS, Lanes::cols(Lanes::ROWS), WT, Out::sum, true>(
          rows, tile_cols, x, ldx, w + c * ldw, ldw, length, bias ? bias + c : nullptr, y + c, ldy, from);
    else
      any_tile<Lanes::ROWS, Lanes::cols(Lanes::ROWS), WT, Out::lanes, true>(
          rows, tile_cols, x, ldx, w + c * ldw, ldw, length, nullptr, carry, 0, from);
  }
}

// Rows up to which `columns` interleaves its row groups (AVX2's 5 to 8 rows; AVX-512 tiles 8 rows as
// one group): there W's stream bounds the product. From 12 rows on the groups' FMAs do, and interleaving
// measured as fast or slower (10% at Qwen3-0.6B's widths, 15 rows).
static constexpr int64_t INTERLEAVED_ROWS = 8;

// `columns` for several row groups: W streamed once, each chunk of a column's K read by every group
// while it is in L1, where one group after the other leaves the stream idle while the later groups read
// the block from L2 (faster at 5 to 8 rows on AVX2: docs/measurements.md). Each output's lanes are
// carried between chunks in fp32, so every lane still gets one unbroken FMA sequence in increasing k:
// the same bits.
template <typename WT>
static void interleaved_columns(const float* x, int64_t M, int64_t ldx, const WT* w, int64_t ldw, int64_t K,
                                const float* bias, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  constexpr int ROWS = Lanes::ROWS, width = Lanes::cols(ROWS);
  constexpr int MOST_GROUPS = int(INTERLEAVED_ROWS + ROWS - 1) / ROWS;
  float lanes[MOST_GROUPS][ROWS * width * 16];
  const int groups = int((M + ROWS - 1) / ROWS);
  for (int64_t n = n0; n < n1; n += width) {
    const int cols = int(n1 - n < width ? n1 - n : width);
    const float* b = bias ? bias + n : nullptr;
    for (int64_t k = 0; k < K; k += CHUNK) {
      const bool first = k == 0, last = k + CHUNK >= K;
      const int64_t length = last ? K - k : CHUNK;
      for (int g = 0; g < groups; ++g) {
        const int rows = int(std::min<int64_t>(ROWS, M - g * ROWS));
        chunk_tiles(rows, cols, x + g * ROWS * ldx + k, ldx, w + n * ldw + k, ldw, length, first, last, b,
                    y + g * ROWS * ldy + n, ldy, lanes[g]);
      }
    }
  }
}

// Output columns [n0, n1) of every row: for each group of up to ROWS rows, each group of up to
// cols(rows) columns (the caller keeps [n0, n1) small enough for W's block to stay in cache while every
// row group reads it); several groups of at most INTERLEAVED_ROWS rows in all, `interleaved_columns`.
// Which columns a call gets changes who computes a column, never how.
template <typename WT>
static void columns(const float* x, int64_t M, int64_t ldx, const WT* w, int64_t ldw, int64_t K,
                    const float* bias, float* y, int64_t ldy, int64_t n0, int64_t n1) {
  if (M > Lanes::ROWS && M <= INTERLEAVED_ROWS) return interleaved_columns(x, M, ldx, w, ldw, K, bias, y, ldy, n0, n1);
  for (int64_t m = 0; m < M; m += Lanes::ROWS) {
    const int rows = int(M - m < Lanes::ROWS ? M - m : Lanes::ROWS);
    const int width = Lanes::cols(rows);
    for (int64_t n = n0; n < n1; n += width) {
      const int cols = int(n1 - n < width ? n1 - n : width);
      any_tile<Lanes::ROWS, Lanes::cols(Lanes::ROWS)>(rows, cols, x + m * ldx, ldx, w + n * ldw, ldw, K,
                                         bias ? bias + n : nullptr, y + m * ldy + n, ldy);
    }
  }
}

// Largest tile of the direct path, in outputs: the scratch of `shard_columns` is S times this many lane vectors.
static constexpr int tile_outputs() {
  int most = 0;
  for (int r = 1; r <= Lanes::ROWS; ++r) most = r * Lanes::cols(r) > most ? r * Lanes::cols(r) : most;
  return most;
}
static constexpr int TILE_OUTPUTS = tile_outputs();

// `columns` for W in S shards of K columns each (shard s: ws[s], [N, K] with rows ldw apart; x's columns from
// s K on): each output the shard tree, (0+1), (2+3), ..., of its shards' products, each in the order
// of `tile`. A tile's lanes for every shard go to `lanes` (S * TILE_OUTPUTS * 16 floats, the 16 past
// the last zeroed by the caller) and their lane trees are `sums`, GROUP outputs at a time: the same
// tree as Lanes::sum, a few instructions an output instead of one horizontal sum each. S = 1 (the
// attention's scores): each tile's outputs summed in registers (`Out::trees`); `lanes` is not read.
// `to`: each shard's sums and each level's rounded (`round_to`).
template <typename WT>
static void shard_columns(const float* x, int64_t M, int64_t ldx, const WT* const* ws, int64_t ldw, int64_t S, int64_t K,
                          float* y, int64_t ldy, int64_t n0, int64_t n1, float* lanes, Round to = Round::none) {
  float totals[64 * TILE_OUTPUTS];  // S <= 64
  for (int64_t m = 0; m < M; m += Lanes::ROWS) {
    const int rows = int(M - m < Lanes::ROWS ? M - m : Lanes::ROWS);
    const int width = Lanes::cols(rows);
    for (int64_t n = n0; n < n1; n += width) {
      const int cols = int(n1 - n < width ? n1 - n : width), outputs = rows * cols;
      if (S == 1) {  // (attention's scores) no tree: the outputs' sums in registers
        any_tile<Lanes::ROWS, Lanes::cols(Lanes::ROWS), WT, Out::trees>(rows, cols, x + m * ldx, ldx, ws[0] + n * ldw,
                                                                       ldw, K, nullptr, y + m * ldy + n, ldy);
        continue;
      }
      for (int64_t s = 0; s < S; ++s)
        any_tile<Lanes::ROWS, Lanes::cols(Lanes::ROWS), WT, Out::lanes>(rows, cols, x + m * ldx + s * K, ldx,
                                                                       ws[s] + n * ldw, ldw, K, nullptr,
                                                                       lanes + s * outputs * 16, 0);
      sums(lanes, S * outputs, nullptr, totals);
      round_to(totals, S * outputs, to);
      for (int64_t step = 1; step < S; step *= 2)
        for (int64_t s = 0; s < S; s += 2 * step) {
          for (int o = 0; o < outputs; ++o)
            totals[s * outputs + o] = totals[s * outputs + o] + totals[(s + step) * outputs + o];
          round_to(totals + s * outputs, outputs, to);
        }
      for (int r = 0; r < rows; ++r)
        for (int c = 0; c < cols; ++c) y[(m + r) * ldy + n + c] = totals[r * cols + c];
    }
  }
}

// -- Many rows: lane-major packed tiles, K in blocks, accumulators carried in a buffer ----------------
// A tile above holds one output's 16 lanes in a vector and reads a vector of x for every vector of W
// (R + C loads per R * C FMAs): for many rows that bounds it on the loads. The lanes are independent
// FMA chains, so for many rows the same chains run in another shape: lane l of 16 outputs side by
// side in one vector, each step adding the broadcast x[m, k] times 16 columns' w[n, k] for one k of
// lane l (a GEMM's outer product, one broadcast and C vectors of W per R * C FMAs). x is packed by
// groups of rows (pack_rows, panel_group), a block of PANEL_COLS columns of W by tiles of 16 * PANEL_C
// columns (pack_columns), lane by lane, each in the order the tiles read it, the tail step zero-padded
// as a tile above loads it and W's columns past the block zero. A group's outputs are carried over K
// in blocks of PANEL_STEPS steps: each block loads every lane's accumulators from a buffer (or starts
// at +0), continues its FMAs in increasing k and stores them back, so every lane gets the FMA sequence
// a tile above gives it, only interrupted by an exact fp32 store and load. The lane tree is then the
// same adds on whole vectors of outputs (`column_tree`), and the bias added after it.
static constexpr int PANEL_ROWS = Lanes::PANEL_ROWS;
static constexpr int PANEL_C = Lanes::PANEL_C;
static constexpr int64_t PANEL_TILE = 16 * PANEL_C;  // columns of one tile
static constexpr int64_t PANEL_COLS = 96;  // a multiple of every variant's PANEL_TILE
static constexpr int64_t PANEL_STEPS = 128;
static_assert(PANEL_COLS % PANEL_TILE == 0, "a block is whole tiles");

// The 16-lane steps of K, the zero-padded tail included.
static inline int64_t steps_of(int64_t K) { return (K + 15) / 16; }

// Rows [m0, m0 + rows) of x into xp, by K blocks of PANEL_STEPS steps: in the block from step s0 (at
// xp + s0 * 16 * rows), x[m0 + r, 16 (s0 + t) + l] at + (l * steps + t) * rows + r, zero past K.
static void pack_rows(const float* x, int64_t ldx, int64_t K, int64_t m0, int rows, float* xp) {
  const int64_t S = steps_of(K);
  for (int64_t s0 = 0; s0 < S; s0 += PANEL_STEPS) {
    const int64_t steps = S - s0 < PANEL_STEPS ? S - s0 : PANEL_STEPS;
    float* block = xp + s0 * 16 * rows;
    for (int r = 0; r < rows; ++r) {
      const float* row = x + (m0 + r) * ldx;
      for (int64_t t = 0; t < steps; ++t)
        for (int l = 0; l < 16; ++l) {
          const int64_t k = 16 * (s0 + t) + l;
          block[(l * steps + t) * rows + r] = k < K ? row[k] : 0.0f;
        }
    }
  }
}

// Elements [k, k + 8) of a row of K (floats, or bf16s widened exactly), zero past K.
static inline __m256 eight(const float* row, int64_t K, int64_t k) {
  if (k + 8 <= K) return _mm256_loadu_ps(row + k);
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(K - k > 0 ? K - k : 0)), index);
  return _mm256_maskload_ps(row + k, keep);
}
static inline __m256 eight(const BF16* row, int64_t K, int64_t k) {
  BF16 buffer[8] = {};
  const BF16* p = row + k;
  if (k + 8 > K) {
    for (int64_t i = k; i < K; ++i) buffer[i - k] = row[i];
    p = buffer;
  }
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// An 8 x 8 block transposed in registers (shuffles only: every bit moved, none changed).
static inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// Columns [n0, n1) of W into wp, widened to fp32, by K blocks: the block from step s0 at wp + s0 *
// padded * 16 (padded: n1 - n0 rounded up to whole tiles), in it the tile of columns [n, n + PANEL_TILE)
// at + (n - n0) * steps * 16, in it lane l's step t at + (l * steps + t) * PANEL_TILE: w[n + j, 16 (s0
// + t) + l] for j in [0, PANEL_TILE), zero past K and past n1. 8 columns by 8 lanes at a time, 8 rows
// of W read along the block's steps (measured faster here than 16 rows a step at a time).
template <typename WT>
static void pack_columns(const WT* w, int64_t ldw, int64_t K, int64_t n0, int64_t n1, float* wp) {
  const int64_t S = steps_of(K), width = n1 - n0, padded = (width + PANEL_TILE - 1) / PANEL_TILE * PANEL_TILE;
  for (int64_t s0 = 0; s0 < S; s0 += PANEL_STEPS) {
    const int64_t steps = S - s0 < PANEL_STEPS ? S - s0 : PANEL_STEPS;
    for (int64_t j0 = 0; j0 < padded; j0 += 8) {
      float* tile = wp + s0 * padded * 16 + (j0 / PANEL_TILE) * PANEL_TILE * steps * 16 + j0 % PANEL_TILE;
      for (int64_t t = 0; t < steps; ++t)
        for (int half = 0; half < 2; ++half) {
          __m256 r[8];
          for (int j = 0; j < 8; ++j)
            r[j] = j0 + j < width ? eight(w + (n0 + j0 + j) * ldw, K, 16 * (s0 + t) + 8 * half) : _mm256_setzero_ps();
          transpose8(r);
          for (int l = 0; l < 8; ++l) _mm256_storeu_ps(tile + ((8 * half + l) * steps + t) * PANEL_TILE, r[l]);
        }
    }
  }
}

// `steps` (>= 1) steps of every lane of R packed rows by C vectors of 16 packed columns: lane l's
// accumulators at acc + l * PANEL_ROWS * C * 16, row r's vector c at + (r * C + c) * 16, from +0 when
// FIRST. PAIR: two lanes at once, j and j + 8, in half as many rows (for shards, whose short K
// makes the accumulators' stores and the lane tree a large share), and on K's LAST block lane j's
// slot gets lane j + lane (j + 8), the lane tree's first level, in registers.
template <int R, int C, bool PAIR, bool FIRST, bool LAST>
static void panel_tile(const float* xp, const float* wp, int64_t steps, float* acc) {
  constexpr int H = PAIR ? 2 : 1;
  constexpr int64_t LANE = PANEL_ROWS * C * 16;
  for (int j = 0; j < 16 / H; ++j) {
    typename Lanes::V a[H][R][C];
    const float* x[H];
    const float* w[H];
    for (int h = 0; h < H; ++h) {
      x[h] = xp + (j + 8 * h) * steps * R;
      w[h] = wp + (j + 8 * h) * steps * C * 16;
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c)
          a[h][r][c] = FIRST ? Lanes::zero() : Lanes::load(acc + (j + 8 * h) * LANE + (r * C + c) * 16);
    }
    int64_t t = steps;
    do {  // (not a for loop: GCC would keep a copy of a[][] on the stack for steps == 0)
      for (int h = 0; h < H; ++h) {
        typename Lanes::V wv[C];
        for (int c = 0; c < C; ++c) wv[c] = Lanes::load(w[h] + c * 16);
        for (int r = 0; r < R; ++r) {
          typename Lanes::V xv = Lanes::broadcast(x[h] + r);
          if constexpr (C > 1) Lanes::in_register(xv);  // one broadcast for C FMAs
          for (int c = 0; c < C; ++c) a[h][r][c] = Lanes::fma(xv, wv[c], a[h][r][c]);
        }
        x[h] += R;
        w[h] += C * 16;
      }
    } while (--t > 0);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) {
        float* slot = acc + j * LANE + (r * C + c) * 16;
        if constexpr (PAIR && LAST) {
          Lanes::store(slot, Lanes::add(a[0][r][c], a[H - 1][r][c]));
        } else {
          for (int h = 0; h < H; ++h) Lanes::store(slot + 8 * h * LANE, a[h][r][c]);
        }
      }
  }
}

using PanelFn = void (*)(const float*, const float*, int64_t, float*);

// panel_tile<rows, PANEL_C, PAIR, first, last>, for 1 <= rows <= R.
template <int R, bool PAIR>
static PanelFn panel_fn(int rows, bool first, bool last) {
  if (rows == R)
    return first ? (last ? panel_tile<R, PANEL_C, PAIR, true, true> : panel_tile<R, PANEL_C, PAIR, true, false>)
                 : (last ? panel_tile<R, PANEL_C, PAIR, false, true> : panel_tile<R, PANEL_C, PAIR, false, false>);
  if constexpr (R > 1) return panel_fn<R - 1, PAIR>(rows, first, last);
  return nullptr;
}

// linear.cpp's lane tree on 16 outputs at once, lane l's vector at lanes + l * stride; PAIR: from its
// first level, s8[j] at lanes + j * stride (panel_tile's).
template <bool PAIR>
static inline typename Lanes::V column_tree(const float* lanes, int64_t stride) {
  typename Lanes::V s[8];
  for (int j = 0; j < 8; ++j)
    s[j] = PAIR ? Lanes::load(lanes + j * stride) : Lanes::add(Lanes::load(lanes + j * stride), Lanes::load(lanes + (j + 8) * stride));
  for (int half = 4; half >= 1; half /= 2)
    for (int j = 0; j < half; ++j) s[j] = Lanes::add(s[j], s[j + half]);
  return s[0];
}

// Whether the packed tiles take two lanes at once (panel_tile's PAIR): where the CPU `pairs` them
// (lanes.h's `pairs_lanes`), for shards (S > 1) and for a K of 16 steps or fewer (the attention's scores
// over a head dim), where the accumulators' stores and the lane tree are a large share of a short K's work.
static inline bool paired(int64_t S, int64_t K, bool pairs) { return pairs && (S > 1 || steps_of(K) <= 16); }

// Rows in a group of the packed tiles: PANEL_ROWS, or half as many where they are `paired`.
static inline int64_t panel_group(int64_t S, int64_t K, bool pairs) {
  return paired(S, K, pairs) ? PANEL_ROWS / 2 : PANEL_ROWS;
}

// Output columns [n0, n1) (at most PANEL_COLS) of every row, for W in S shards of K columns each (shard s:
// ws[s], [N, K] with rows ldw apart; S = 1: one matrix), from x packed by groups of panel_group(S, K, pairs)
// rows per shard (shard s's group g at xp + s * xstride + g * that group * steps_of(K) * 16). Each shard's
// outputs are carried over its K, then summed by `column_tree`; S > 1 (no bias): the shards' sums are
// added in the shard tree, (0+1), (2+3), ..., then pairs of those, kept level by level in `tree`
// (at least (log2 S + 1) * PANEL_ROWS * PANEL_COLS floats) as each shard ends, so that no shard's
// products ever leave the cache. Scratch: acc, PANEL_ROWS * PANEL_COLS * 16 floats, and wp, S *
// PANEL_COLS * steps_of(K) * 16 floats. Which columns a call gets changes who computes a column, never how.
// `to`: each shard's sums and each level's rounded (`round_to`).
template <typename WT>
static void panel_columns(const float* xp, int64_t xstride, int64_t M, int64_t K, const WT* const* ws, int64_t ldw,
                          int64_t S, const float* bias, float* y, int64_t ldy, int64_t n0, int64_t n1, float* acc,
                          float* wp, float* tree, bool pairs, Round to = Round::none) {
  const int64_t steps_k = steps_of(K), width = n1 - n0;
  const int64_t padded = (width + PANEL_TILE - 1) / PANEL_TILE * PANEL_TILE, shard_packed = steps_k * padded * 16;
  for (int64_t s = 0; s < S; ++s) pack_columns(ws[s], ldw, K, n0, n1, wp + s * shard_packed);
  const int64_t outputs = PANEL_ROWS * PANEL_COLS, group = panel_group(S, K, pairs);
  const bool pair = paired(S, K, pairs);
  for (int64_t m = 0; m < M; m += group) {
    const int rows = int(M - m < group ? M - m : group);
    for (int64_t shard = 0; shard < S; ++shard) {
      const float* xg = xp + shard * xstride + m * steps_k * 16;
      const float* wg = wp + shard * shard_packed;
      for (int64_t s0 = 0; s0 < steps_k; s0 += PANEL_STEPS) {
        const int64_t steps = steps_k - s0 < PANEL_STEPS ? steps_k - s0 : PANEL_STEPS;
        const bool first = s0 == 0, last = s0 + steps == steps_k;
        const PanelFn run = pair ? panel_fn<PANEL_ROWS / 2, true>(rows, first, last)
                                 : panel_fn<PANEL_ROWS, false>(rows, first, last);
        const float* panel = xg + s0 * rows * 16;
        for (int64_t n = 0; n < padded; n += PANEL_TILE)
          run(panel, wg + (s0 * padded + n * steps) * 16, steps, acc + n * PANEL_ROWS * 16);
      }
      // This shard's sums (S = 1: the outputs), then the tree: slot l holds the sum of the last 2^l
      // shards' left half while the right half is being computed; a shard's sums go to the slot its
      // subtree's sum will be kept in, one past those of the left halves it is added to.
      const int64_t level = __builtin_ctzll(~uint64_t(shard));
      float* sum = tree + level * outputs;
      // The block's own columns only (a tile's columns past them are W's zero padding): every tail
      // below keeps 1 to 16 lanes (a count under 1 is no mask on AVX-512: 1u << n wraps).
      for (int64_t n = 0; n < width; n += 16)
        for (int r = 0; r < rows; ++r) {
          const int64_t c = n % PANEL_TILE / 16, lanes = n / PANEL_TILE * PANEL_TILE * PANEL_ROWS * 16;
          const float* lane0 = acc + lanes + (r * PANEL_C + c) * 16;
          typename Lanes::V v = pair ? column_tree<true>(lane0, PANEL_ROWS * PANEL_C * 16)
                                     : column_tree<false>(lane0, PANEL_ROWS * PANEL_C * 16);
          const int count = int(width - n < 16 ? width - n : 16);
          if (S > 1) {
            Lanes::store(sum + r * PANEL_COLS + n, v);
          } else {
            if (bias != nullptr) v = Lanes::add(v, Lanes::load_tail(bias + n0 + n, count));
            Lanes::store_tail(y + (m + r) * ldy + n0 + n, v, count);
          }
        }
      if (S == 1) continue;
      for (int r = 0; r < rows; ++r) round_to(sum + r * PANEL_COLS, width, to);
      for (int64_t left = 0; left < level; ++left) {
        const float* half = tree + left * outputs;
        for (int r = 0; r < rows; ++r) {
          for (int64_t c = 0; c < width; ++c) sum[r * PANEL_COLS + c] = half[r * PANEL_COLS + c] + sum[r * PANEL_COLS + c];
          round_to(sum + r * PANEL_COLS, width, to);
        }
      }
      if (shard + 1 == S) {
        for (int r = 0; r < rows; ++r) std::memcpy(y + (m + r) * ldy + n0, sum + r * PANEL_COLS, sizeof(float) * width);
      }
    }
  }
}
