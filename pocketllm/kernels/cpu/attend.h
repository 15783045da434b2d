// One work item of attention.cpp (a block of query rows and one K/V head) on `Lanes`, in the order
// attention.cpp documents. Included once per instruction set by attention.cpp, after tile.h, inside a
// namespace that defines `Lanes` and under that instruction set's `#pragma GCC target`: the scores
// are tile.h's products and the weighted sum of values a register tile on `Lanes`, with the same
// operation sequence per output in both variants, so both give the same bits.

// acc[r][c] = sum over j in [0, length) of p[j * ldp + r] * v[j * ldv + c * ldc ..] for R rows of p and C
// 16-lane column vectors of v: one FMA per j, in increasing j, from +0. Stored at out + r * ldo + 16 c.
template <int R, int C>
static void weighted_tile(const float* p, int64_t ldp, const float* v, int64_t ldv, int64_t ldc, int64_t length,
                          float* out, int64_t ldo) {
  typename Lanes::V a[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) a[r][c] = Lanes::zero();
  for (int64_t j = 0; j < length; ++j, p += ldp, v += ldv) {
    typename Lanes::V vv[C];
    for (int c = 0; c < C; ++c) vv[c] = Lanes::load(v + c * ldc);
    for (int r = 0; r < R; ++r) {
      const typename Lanes::V e = Lanes::broadcast(p[r]);
      for (int c = 0; c < C; ++c) a[r][c] = Lanes::fma(e, vv[c], a[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) Lanes::store(out + r * ldo + 16 * c, a[r][c]);
}

// weighted_tile<rows, cols> for 1 <= rows <= R and 1 <= cols <= C.
template <int R, int C>
static void any_weighted_tile(int rows, int cols, const float* p, int64_t ldp, const float* v, int64_t ldv,
                              int64_t ldc, int64_t length, float* out, int64_t ldo) {
  if (rows == R && cols == C) weighted_tile<R, C>(p, ldp, v, ldv, ldc, length, out, ldo);
  else if constexpr (C > 1) any_weighted_tile<R, C - 1>(rows, cols, p, ldp, v, ldv, ldc, length, out, ldo);
  else if constexpr (R > 1)
    any_weighted_tile<R - 1, Lanes::WEIGHTED_COLS>(rows, cols, p, ldp, v, ldv, ldc, length, out, ldo);
}

// The item's n = rows x group query vectors (vector i: row i / group, query head h0 + i % group),
// over keys/values 0 .. length - 1 of one K/V head (key j at keys + j * stride, or packed; vector i
// reads the keys 0 .. last[i]). Scratch (Scratch in attention.cpp): qb [n, dim], scores [length + a
// group of keys, n] (key-major, so that every step below runs across the n vectors), sums [n, dim16],
// last, top, total [n]; values_padded [length, dim16] when dim is not a multiple of 16; acc and wp,
// panel_columns' scratch.
static void attend_item(const Item& it, Scratch& s) {
  const int64_t n = it.n, dim = it.dim, dim16 = (dim + 15) / 16 * 16, length = it.length;
  for (int64_t i = 0; i < n; ++i) {
    std::copy(it.query(i), it.query(i) + dim, s.qb.data_ptr<float>() + i * dim);
    s.last[i] = it.last(i);
  }
  // scores[j][i] = dot(k_j, q_i), tile.h's order (the keys are its rows, the queries its W): by the
  // packed tiles where the item has packed keys (`packed_scores` in attention.cpp), else by the direct
  // tiles (the same lanes and lane tree per score). The packed tiles take the pack's whole groups of
  // keys: scores past the block's last key are computed and never read.
  const float* qb = s.qb.data_ptr<float>();
  if (it.packed_keys != nullptr) {
    const int64_t group = panel_group(1, dim, it.pairs);
    const int64_t keys = std::min(it.packed_length, (length + group - 1) / group * group);
    for (int64_t n0 = 0; n0 < n; n0 += PANEL_COLS)
      panel_columns<float>(it.packed_keys, 0, keys, dim, &qb, dim, 1, nullptr, s.scores.data(), n, n0,
                           std::min(n, n0 + PANEL_COLS), s.acc.data(), s.wp.data(), nullptr, it.pairs);
  } else {
    shard_columns<float>(it.keys, length, it.stride, &qb, dim, 1, dim, s.scores.data(), n, 0, n, nullptr);
  }
  // (restrict: the compiler vectorises these loops across the n vectors only once told that they do not alias)
  float* __restrict top = s.top.data();
  float* __restrict total = s.total.data();
  const int64_t* __restrict last = s.last.data();
  const float scale = it.scale;
  for (int64_t i = 0; i < n; ++i) top[i] = -INFINITY;
  for (int64_t j = 0; j < length; ++j) {
    float* __restrict row = s.scores.data() + j * n;
    for (int64_t i = 0; i < n; ++i) {
      row[i] = j <= last[i] ? row[i] * scale : -INFINITY;
      top[i] = std::max(top[i], row[i]);
    }
  }
  for (int64_t i = 0; i < n; ++i) total[i] = 0.0f;
  for (int64_t j = 0; j < length; ++j) {  // e = exp(score - top), 0 past a vector's last key; totals in increasing j
    float* __restrict row = s.scores.data() + j * n;
    for (int64_t i = 0; i < n; ++i) {
      row[i] = exp_fixed(row[i] - top[i]);
      total[i] = total[i] + row[i];
    }
  }
  const float* values = it.values;
  int64_t ldv = it.value_row;
  if (dim != dim16 && it.value_column == 16) {  // the cache's rows: a whole 16-lane load per column vector,
    for (int64_t j = 0; j < length; ++j) {    // the values zero-padded to dim16 (a pack is already)
      std::copy(it.values + j * ldv, it.values + j * ldv + dim, s.values_padded.data() + j * dim16);
      std::fill(s.values_padded.data() + j * dim16 + dim, s.values_padded.data() + (j + 1) * dim16, 0.0f);
    }
    values = s.values_padded.data();
    ldv = dim16;
  }
  // Column vectors outside, rows inside: a pack's column of values stays in cache across the rows.
  const int64_t vectors = dim16 / 16;
  for (int64_t c = 0; c < vectors; c += Lanes::WEIGHTED_COLS) {
    const int cols = int(std::min<int64_t>(Lanes::WEIGHTED_COLS, vectors - c));
    for (int64_t i = 0; i < n; i += Lanes::WEIGHTED_ROWS) {
      const int rows = int(std::min<int64_t>(Lanes::WEIGHTED_ROWS, n - i));
      int64_t keys = 0;  // past the tile's longest last key every e is 0: an FMA that adds +0
      for (int r = 0; r < rows; ++r) keys = std::max(keys, s.last[i + r] + 1);
      any_weighted_tile<Lanes::WEIGHTED_ROWS, Lanes::WEIGHTED_COLS>(
          rows, cols, s.scores.data() + i, n, values + c * it.value_column, ldv, it.value_column, keys,
          s.sums.data() + i * dim16 + 16 * c, dim16);
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    float* out = it.output(i);
    const float* sum = s.sums.data() + i * dim16;
    for (int64_t d = 0; d < dim; ++d) out[d] = sum[d] / total[i];
  }
}
