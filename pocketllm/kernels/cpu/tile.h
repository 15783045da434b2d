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

template <int R, int C, typename WT, Out OUT = Out::sum>
static void tile(const float* x, int64_t ldx, const WT* w, int64_t ldw, int64_t K,
                 const float* bias, float* y, int64_t ldy) {
  typename Lanes::V acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = Lanes::zero();
  const int64_t k_full = K & ~int64_t(15);
  for (int64_t k = 0; k < k_full; k += 16) {
    typename Lanes::V wv[C];
    for (int c = 0; c < C; ++c) wv[c] = Lanes::load(w + c * ldw + k);
    if constexpr (R == 1)  // a hint only: it changes no value
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
template <int R, int C, typename WT, Out OUT = Out::sum>
static void any_tile(int rows, int cols, const float* x, int64_t ldx, const WT* w, int64_t ldw, int64_t K,
                     const float* bias, float* y, int64_t ldy) {
  if (rows == R && cols == C) {
    tile<R, C, WT, OUT>(x, ldx, w, ldw, K, bias, y, ldy);
  } else if constexpr (C > 1) {
    any_tile<R, C - 1, WT, OUT>(rows, cols, x, ldx, w, ldw, K, bias, y, ldy);
  } else if constexpr (R > 1) {
    any_tile<R - 1, Lanes::cols(R - 1), WT, OUT>(rows, cols, x, ldx, w, ldw, K, bias, y, ldy);
  }
}

// Output columns [n0, n1) of every row: for each group of up to ROWS rows, each group of up to
// cols(rows) columns (the caller keeps [n0, n1) small enough for W's block to stay in cache while every
// row group reads it). Which columns a call gets changes who computes a column, never how.
template <typename WT>
static void columns(const float* x, int64_t M, int64_t ldx, const WT* w, int64_t ldw, int64_t K,
                    const float* bias, float* y, int64_t ldy, int64_t n0, int64_t n1) {
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
template <typename WT>
static void shard_columns(const float* x, int64_t M, int64_t ldx, const WT* const* ws, int64_t ldw, int64_t S, int64_t K,
                          float* y, int64_t ldy, int64_t n0, int64_t n1, float* lanes) {
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
      for (int64_t step = 1; step < S; step *= 2)
        for (int64_t s = 0; s < S; s += 2 * step)
          for (int o = 0; o < outputs; ++o)
            totals[s * outputs + o] = totals[s * outputs + o] + totals[(s + step) * outputs + o];
      for (int r = 0; r < rows; ++r)
        for (int c = 0; c < cols; ++c) y[(m + r) * ldy + n + c] = totals[r * cols + c];
    }
  }
}

// -- Many rows: x and W packed, K in blocks, accumulators carried in a buffer ----------------------
// A tile above reads its R rows of x and C rows of W over the whole of K for R * C outputs; for many
// rows those reads, R + C streams K * 4 bytes apart (sharing L1 sets when K * 4 is a multiple of
// 4 KiB), come from L2 and bound the tile. For many rows the same outputs are computed in another
// loop order: x is packed by groups of PANEL_ROWS rows (pack_rows), a block of PANEL_COLS columns of
// W by tiles (pack_columns), each in the order the tiles read it, with the tail step zero-padded as
// a tile above loads it (so it is one more step like the others). A group's outputs for the block are
// carried over K in blocks of PANEL_STEPS 16-lane steps: each block's tiles load their accumulators
// from a buffer (or start at +0 for the first block), continue each lane's FMAs in increasing k and
// store them back, so every lane gets the FMA sequence a tile above gives it, only interrupted by an
// exact fp32 store and load. A group's packed rows of one K block stay in L1 across the block's tiles,
// the packed block of W in L2 across the groups. The lane tree and the bias are sums, on the
// buffer.
static constexpr int PANEL_ROWS = Lanes::PANEL_ROWS;
static constexpr int PANEL_C = Lanes::PANEL_C;
static constexpr int64_t PANEL_COLS = 96;  // a multiple of 16 (sums) and of PANEL_C
static constexpr int64_t PANEL_STEPS = 32;

// The 16-lane steps of K, the zero-padded tail included.
static inline int64_t steps_of(int64_t K) { return (K + 15) / 16; }

// Step s of `src` (a row of K floats or bf16s), as fp32, zero-padded past K.
template <typename T>
static inline typename Lanes::V load_step(const T* src, int64_t K, int64_t s) {
  return 16 * s + 16 <= K ? Lanes::load(src + 16 * s) : Lanes::load_tail(src + 16 * s, int(K - 16 * s));
}

// Rows [m0, m0 + rows) of x into xp: step s of row r at xp + (s * rows + r) * 16.
static void pack_rows(const float* x, int64_t ldx, int64_t K, int64_t m0, int rows, float* xp) {
  for (int64_t s = 0; s < steps_of(K); ++s)
    for (int r = 0; r < rows; ++r) Lanes::store(xp + (s * rows + r) * 16, load_step(x + (m0 + r) * ldx, K, s));
}

// Columns [n0, n1) of W into wp (steps_of(K) * (n1 - n0) * 16 floats, widened to fp32): the K block of steps [s0, s0 +
// steps) from wp + s0 * (n1 - n0) * 16, in it the tile of columns [n, n + cols) from + (n - n0) * steps
// * 16, in it step s of column c at + (s * cols + c) * 16, so that every tile reads one stream.
template <typename WT>
static void pack_columns(const WT* w, int64_t ldw, int64_t K, int64_t n0, int64_t n1, float* wp) {
  const int64_t S = steps_of(K);
  for (int64_t s0 = 0; s0 < S; s0 += PANEL_STEPS) {
    const int64_t steps = S - s0 < PANEL_STEPS ? S - s0 : PANEL_STEPS;
    for (int64_t n = n0; n < n1; n += PANEL_C) {
      const int cols = int(n1 - n < PANEL_C ? n1 - n : PANEL_C);
      for (int64_t s = 0; s < steps; ++s)
        for (int c = 0; c < cols; ++c) Lanes::store(wp + (s * cols + c) * 16, load_step(w + (n + c) * ldw, K, s0 + s));
      wp += steps * cols * 16;
    }
  }
}

// `steps` (>= 1) steps of R packed rows by C packed columns on acc[r][c] (at acc + (r * PANEL_COLS + c)
// * 16), from +0 when FIRST.
template <int R, int C, bool FIRST>
static void panel_tile(const float* xp, const float* wp, int64_t steps, float* acc) {
  typename Lanes::V a[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) a[r][c] = FIRST ? Lanes::zero() : Lanes::load(acc + (r * PANEL_COLS + c) * 16);
  do {  // (not a for loop: GCC would keep a copy of a[][] on the stack for steps == 0)
    typename Lanes::V wv[C];
    for (int c = 0; c < C; ++c) wv[c] = Lanes::load(wp + c * 16);
    for (int r = 0; r < R; ++r) {
      typename Lanes::V xv = Lanes::load(xp + r * 16);
      if constexpr (C > 1) Lanes::in_register(xv);  // one load for C FMAs
      for (int c = 0; c < C; ++c) a[r][c] = Lanes::fma(xv, wv[c], a[r][c]);
    }
    xp += R * 16;
    wp += C * 16;
  } while (--steps > 0);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) Lanes::store(acc + (r * PANEL_COLS + c) * 16, a[r][c]);
}

using PanelFn = void (*)(const float*, const float*, int64_t, float*);

// panel_tile<rows, cols, first>, for 1 <= rows <= R and 1 <= cols <= C.
template <int R, int C>
static PanelFn panel_fn(int rows, int cols, bool first) {
  if (rows == R && cols == C) return first ? panel_tile<R, C, true> : panel_tile<R, C, false>;
  if constexpr (C > 1) return panel_fn<R, C - 1>(rows, cols, first);
  if constexpr (R > 1) return panel_fn<R - 1, PANEL_C>(rows, cols, first);
  return nullptr;
}

// Output columns [n0, n1) (at most PANEL_COLS) of every row, for W in S shards of K columns each (shard s:
// ws[s], [N, K] with rows ldw apart; S = 1: one matrix), from x packed by groups of PANEL_ROWS rows per
// shard (shard s's group g at xp + s * xstride + g * PANEL_ROWS * steps_of(K) * 16). Each shard's
// outputs are carried over its K, their lanes summed by `sums`; S > 1 (no bias): the shards' sums are
// added in the shard tree, (0+1), (2+3), ..., then pairs of those, kept level by level in `tree`
// (at least (log2 S + 2) * PANEL_ROWS * PANEL_COLS floats) as each shard ends, so that no shard's
// products ever leave the cache. Scratch: acc, PANEL_ROWS * PANEL_COLS * 16 floats, zeroed (sums reads
// the lanes past a narrow block's last column too), and wp, S * PANEL_COLS * steps_of(K) * 16 floats.
// Which columns a call gets changes who computes a column, never how.
template <typename WT>
static void panel_columns(const float* xp, int64_t xstride, int64_t M, int64_t K, const WT* const* ws, int64_t ldw,
                          int64_t S, const float* bias, float* y, int64_t ldy, int64_t n0, int64_t n1, float* acc,
                          float* wp, float* tree) {
  const int64_t steps_k = steps_of(K), width = n1 - n0, shard_packed = steps_k * width * 16;
  const int narrow = int((width - 1) % PANEL_C) + 1;
  for (int64_t s = 0; s < S; ++s) pack_columns(ws[s], ldw, K, n0, n1, wp + s * shard_packed);
  const int64_t outputs = PANEL_ROWS * PANEL_COLS;
  for (int64_t m = 0; m < M; m += PANEL_ROWS) {
    const int rows = int(M - m < PANEL_ROWS ? M - m : PANEL_ROWS);
    for (int64_t shard = 0; shard < S; ++shard) {
      const float* xg = xp + shard * xstride + m * steps_k * 16;
      const float* wg = wp + shard * shard_packed;
      for (int64_t s0 = 0; s0 < steps_k; s0 += PANEL_STEPS) {
        const int64_t steps = steps_k - s0 < PANEL_STEPS ? steps_k - s0 : PANEL_STEPS;
        const PanelFn wide = panel_fn<PANEL_ROWS, PANEL_C>(rows, PANEL_C, s0 == 0);
        const PanelFn last = panel_fn<PANEL_ROWS, PANEL_C>(rows, narrow, s0 == 0);
        // The next K block's (or group's) packed rows follow this one's: fetched into L2 a slice per tile,
        // as the hardware would not across its pages, so that the next pass does not wait on L3.
        const float* panel = xg + s0 * rows * 16;
        const char* next = reinterpret_cast<const char*>(panel + steps * rows * 16);
        const char* end = reinterpret_cast<const char*>(xp + shard * xstride +
                                                        ((M + PANEL_ROWS - 1) / PANEL_ROWS) * PANEL_ROWS * steps_k * 16);
        const int64_t slice = (steps * rows * 64 / ((width + PANEL_C - 1) / PANEL_C) + 63) / 64 * 64;
        for (int64_t n = 0; n < width; n += PANEL_C, next += slice) {
          for (const char* p = next; p < next + slice && p < end; p += 64) _mm_prefetch(p, _MM_HINT_T1);
          (n + PANEL_C < width ? wide : last)(panel, wg + (s0 * width + n * steps) * 16, steps, acc + n * 16);
        }
      }
      if (S == 1) {
        for (int r = 0; r < rows; ++r)
          sums(acc + r * PANEL_COLS * 16, width, bias ? bias + n0 : nullptr, y + (m + r) * ldy + n0);
        continue;
      }
      // This shard's sums, then the tree: level l holds the sum of the last 2^l shards' left half while
      // the right half is being computed.
      float* sum = tree;
      for (int r = 0; r < rows; ++r) sums(acc + r * PANEL_COLS * 16, width, nullptr, sum + r * PANEL_COLS);
      int64_t level = 0;
      for (; (shard >> level) & 1; ++level) {
        const float* left = tree + (level + 1) * outputs;
        for (int r = 0; r < rows; ++r)
          for (int64_t c = 0; c < width; ++c) sum[r * PANEL_COLS + c] = left[r * PANEL_COLS + c] + sum[r * PANEL_COLS + c];
      }
      if (shard + 1 < S) {
        std::memcpy(tree + (level + 1) * outputs, sum, sizeof(float) * outputs);
      } else {
        for (int r = 0; r < rows; ++r) std::memcpy(y + (m + r) * ldy + n0, sum + r * PANEL_COLS, sizeof(float) * width);
      }
    }
  }
}
