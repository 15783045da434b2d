// One register tile of y = x @ W^T: R rows of x by C rows (output columns) of W, in the reduction
// order that linear.cpp documents. Included once per instruction set by linear.cpp, inside a
// namespace that defines `Lanes` (16 logical fp32 lanes: zero, load, load_tail, fma, sum) and
// under that instruction set's `#pragma GCC target`, so the same source yields both variants.
// Every accumulator acc[r][c] is one output's 16 lanes; the tile shape only groups independent
// outputs, so it never changes any output's order.

template <int R, int C>
static void tile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K,
                 const float* bias, float* y, int64_t ldy) {
  typename Lanes::V acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = Lanes::zero();
  const int64_t k_full = K & ~int64_t(15);
  for (int64_t k = 0; k < k_full; k += 16) {
    typename Lanes::V wv[C];
    for (int c = 0; c < C; ++c) wv[c] = Lanes::load(w + c * ldw + k);
    for (int r = 0; r < R; ++r) {
      const typename Lanes::V xv = Lanes::load(x + r * ldx + k);
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
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float s = Lanes::sum(acc[r][c]);
      if (bias != nullptr) s = s + bias[c];
      y[r * ldy + c] = s;
    }
}

// The tile of `rows` x `cols` (at most Lanes::ROWS x Lanes::cols(rows)), found by a search over the
// instantiations: a few comparisons per tile, against a K loop of K / 16 steps.
template <int R, int C>
static void any_tile(int rows, int cols, const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K,
                     const float* bias, float* y, int64_t ldy) {
  if (rows == R && cols == C) {
    tile<R, C>(x, ldx, w, ldw, K, bias, y, ldy);
  } else if constexpr (C > 1) {
    any_tile<R, C - 1>(rows, cols, x, ldx, w, ldw, K, bias, y, ldy);
  } else if constexpr (R > 1) {
    any_tile<R - 1, Lanes::cols(R - 1)>(rows, cols, x, ldx, w, ldw, K, bias, y, ldy);
  }
}

// Output columns [n0, n1) of every row: for each group of up to ROWS rows, each group of up to
// cols(rows) columns (the caller keeps [n0, n1) small enough for W's block to stay in cache while every
// row group reads it). Which columns a call gets changes who computes a column, never how.
static void columns(const float* x, int64_t M, int64_t ldx, const float* w, int64_t ldw, int64_t K,
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
