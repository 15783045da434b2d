// y[M, N] = x[M, K] @ W[N, K]^T (+ b), fp32, in a reduction order that this file owns.
//
// Reduction order of every output y[m, n], a function of K only:
//   1. 16 lanes over K: lane j (0..15) starts at +0 and accumulates x[k] * w[k] for the k with
//      k % 16 == j and k < 16 * floor(K / 16), in increasing k, one fused multiply-add per k;
//   2. the tail k >= 16 * floor(K / 16) (K % 16 elements) is zero-padded to 16 lanes and added as
//      one more FMA step on every lane (lane j takes k = 16 * floor(K / 16) + j, or 0 * 0);
//   3. the 16 lanes are summed in one tree: s8[j] = l[j] + l[j+8], s4[j] = s8[j] + s8[j+4],
//      s2[j] = s4[j] + s4[j+2], s = s2[0] + s2[1];
//   4. then s + b[n] (when there is a bias), in fp32.
// Nothing in it depends on M, the row's position, the thread count or the pointers' alignment
// (unaligned loads throughout). Threads split output columns only, never K. The AVX-512 variant
// holds the 16 lanes in one register, the AVX2 variant in two (lanes 0-7, 8-15), with the same
// FMA sequence and the same tree, so both give the same bits.
#include <immintrin.h>
#include <atomic>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

namespace avx512 {
#pragma GCC push_options
#pragma GCC target("avx512f,fma")
struct Lanes {
  using V = __m512;
  // Register tiles: up to 8 rows x 3 columns (24 accumulators of 32 registers); 1-2 rows (decode)
  // take 8 columns, more streams of W in flight.
  static constexpr int ROWS = 8;
  static constexpr int cols(int rows) { return rows <= 2 ? 8 : 3; }
  static inline V zero() { return _mm512_setzero_ps(); }
  static inline V load(const float* p) { return _mm512_loadu_ps(p); }
  static inline V load_tail(const float* p, int n) {
    return _mm512_maskz_loadu_ps(__mmask16((1u << n) - 1u), p);
  }
  static inline V fma(V a, V b, V acc) { return _mm512_fmadd_ps(a, b, acc); }
  static inline float sum(V v) {
    const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
  }
};
#include "tile.h"
#pragma GCC pop_options
}  // namespace avx512

namespace avx2 {
#pragma GCC push_options
#pragma GCC target("avx2,fma")
struct Lanes {
  struct V { __m256 lo, hi; };  // lanes 0-7 and 8-15
  static constexpr int ROWS = 4;  // register tile: 4 rows x 1 column, 8 of 16 registers accumulate
  static constexpr int cols(int) { return 1; }
  static inline V zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static inline V load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static inline __m256 mask(int n) {  // lane i set when i < n
    const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), index));
  }
  static inline V load_tail(const float* p, int n) {
    return {_mm256_maskload_ps(p, _mm256_castps_si256(mask(n))),
            _mm256_maskload_ps(p + 8, _mm256_castps_si256(mask(n - 8)))};
  }
  static inline V fma(V a, V b, V acc) {
    return {_mm256_fmadd_ps(a.lo, b.lo, acc.lo), _mm256_fmadd_ps(a.hi, b.hi, acc.hi)};
  }
  static inline float sum(V v) {
    const __m256 s8 = _mm256_add_ps(v.lo, v.hi);
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
  }
};
#include "tile.h"
#pragma GCC pop_options
}  // namespace avx2

using ColumnsFn = void (*)(const float*, int64_t, int64_t, const float*, int64_t, int64_t, const float*,
                           float*, int64_t, int64_t, int64_t);

// "avx512" or "avx2": the best this CPU runs.
static std::string best_variant() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return "avx512";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "avx2";
  return "";
}

static ColumnsFn columns_fn(const std::string& variant) {
  const std::string best = best_variant();
  TORCH_CHECK_VALUE(variant == "" || variant == "avx512" || variant == "avx2",
                    "variant must be '', 'avx512' or 'avx2', got '", variant, "'");
  const std::string chosen = variant.empty() ? best : variant;
  TORCH_CHECK(!chosen.empty(), "this CPU has neither AVX-512F nor AVX2 with FMA");
  TORCH_CHECK(chosen != "avx512" || best == "avx512", "this CPU has no AVX-512F");
  return chosen == "avx512" ? avx512::columns : avx2::columns;
}

// Columns per work item: a block of W of at most ~256 KiB, which stays in L2 while every row group
// reads it, a multiple of 24 (of every variant's tile widths), 24 to 96 columns. It decides which
// thread computes a column and when, not how.
static int64_t block_columns(int64_t K) {
  const int64_t cols = int64_t(256) * 1024 / (4 * std::max<int64_t>(K, 1)) / 24 * 24;
  return std::min<int64_t>(96, std::max<int64_t>(24, cols));
}

at::Tensor linear(at::Tensor x, at::Tensor weight, c10::optional<at::Tensor> bias,
                  const std::string& variant) {
  TORCH_CHECK_VALUE(x.dtype() == at::kFloat && weight.dtype() == at::kFloat,
                    "fixed_order linear takes fp32 x and weight, got ", x.dtype(), " and ", weight.dtype());
  TORCH_CHECK_VALUE(x.device().is_cpu() && weight.device().is_cpu(), "fixed_order linear runs on the CPU");
  TORCH_CHECK_VALUE(x.dim() == 2 && weight.dim() == 2, "x must be [M, K] and weight [N, K]");
  TORCH_CHECK_VALUE(x.size(1) == weight.size(1), "x has K=", x.size(1), " but weight has K=", weight.size(1));
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const ColumnsFn fn = columns_fn(variant);
  x = x.contiguous();
  weight = weight.contiguous();
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK_VALUE(b.dtype() == at::kFloat && b.dim() == 1 && b.size(0) == N,
                      "bias must be fp32 [N] with N=", N);
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float* bp = bias.has_value() ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t block = block_columns(K), blocks = (N + block - 1) / block;
  // Each thread takes the next block until none is left (a thread that the OS holds back leaves its
  // share to the others); only who computes a block, and when, depends on it.
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(blocks, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < blocks; i = next++)
      fn(xp, M, K, wp, K, K, bp, yp, N, i * block, std::min(N, (i + 1) * block));
  });
  return y;
}

void register_gated_delta(pybind11::module& m);  // gated_delta.cpp
void register_attention(pybind11::module& m);  // attention.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_gated_delta(m);
  register_attention(m);
  m.def("linear", &linear, "y = x @ W^T (+ b) in the fixed reduction order", pybind11::arg("x"),
        pybind11::arg("weight"), pybind11::arg("bias") = pybind11::none(), pybind11::arg("variant") = "");
  m.def("best_variant", &best_variant, "the instruction set the kernel runs by default");
}
