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
// (unaligned loads throughout). W may be bf16: each element is widened to fp32 exactly as it is
// loaded (bf16 is the upper half of an fp32), so the order above runs on the same fp32 values and a
// bf16 W gives bitwise the output of W.float(), at half the bytes read. Threads split output columns only, never K. The AVX-512 variant
// holds the 16 lanes in one register, the AVX2 variant in two (lanes 0-7, 8-15), with the same
// FMA sequence and the same tree, so both give the same bits. tile.h computes the outputs in one of
// two loop orders, direct register tiles below PANEL_MIN_ROWS rows (their row groups interleaved over
// chunks of K at 5 to 8 rows on AVX2) and packed, K-blocked tiles from there on; each gives every lane
// the FMA sequence above and every output the tree above, so which one ran changes no bit (the tests
// compare every row against the same row alone).
#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>
#include <type_traits>
#include <vector>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "lanes.h"

namespace avx512 {
#pragma GCC push_options
#pragma GCC target("avx512f,fma")
#include "tile.h"
#pragma GCC pop_options
}  // namespace avx512

namespace avx2 {
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#include "tile.h"
#pragma GCC pop_options
}  // namespace avx2

namespace avx512dot {
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bf16,fma")
#include "tile.h"
#pragma GCC pop_options
}  // namespace avx512dot

namespace avx2dot {
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#include "tile.h"
#pragma GCC pop_options
}  // namespace avx2dot

// One instruction set's kernels (tile.h), for W of element type WT.
template <typename WT>
struct Kernels {
  void (*columns)(const float*, int64_t, int64_t, const WT*, int64_t, int64_t, const float*, float*, int64_t,
                  int64_t, int64_t);
  void (*panel_columns)(const float*, int64_t, int64_t, int64_t, const WT* const*, int64_t, int64_t, const float*,
                        float*, int64_t, int64_t, int64_t, float*, float*, float*, bool, Round);
  void (*shard_columns)(const float*, int64_t, int64_t, const WT* const*, int64_t, int64_t, int64_t, float*, int64_t,
                        int64_t, int64_t, float*, Round);
};
struct Variant {
  Kernels<float> fp32;
  Kernels<BF16> bf16;
  void (*pack_rows)(const float*, int64_t, int64_t, int64_t, int, float*);
  int64_t (*panel_group)(int64_t, int64_t, bool);  // rows per group of the packed tiles, for S shards of K
  bool flush_denormals;  // DAZ and FTZ while it runs: the bf16 dot products' rule (`Denormals`)

  template <typename WT>
  const Kernels<WT>& of() const {
    if constexpr (std::is_same_v<WT, BF16>) return bf16;
    else return fp32;
  }
};
static constexpr Variant AVX512{{avx512::columns<float>, avx512::panel_columns<float>, avx512::shard_columns<float>},
                                {avx512::columns<BF16>, avx512::panel_columns<BF16>, avx512::shard_columns<BF16>},
                                avx512::pack_rows, avx512::panel_group, false};
static constexpr Variant AVX2{{avx2::columns<float>, avx2::panel_columns<float>, avx2::shard_columns<float>},
                              {avx2::columns<BF16>, avx2::panel_columns<BF16>, avx2::shard_columns<BF16>},
                              avx2::pack_rows, avx2::panel_group, false};
// The bf16 dot products: x and W as pairs of bf16s in 32-bit elements (`linear_bf16_dot`); only their
// fp32 kernels run (a pair is one "fp32" element of the tiles, which load and store it bit for bit).
static constexpr Variant AVX512_DOT{
    {avx512dot::columns<float>, avx512dot::panel_columns<float>, avx512dot::shard_columns<float>},
    {avx512dot::columns<BF16>, avx512dot::panel_columns<BF16>, avx512dot::shard_columns<BF16>},
    avx512dot::pack_rows, avx512dot::panel_group, true};
static constexpr Variant AVX2_DOT{{avx2dot::columns<float>, avx2dot::panel_columns<float>, avx2dot::shard_columns<float>},
                                  {avx2dot::columns<BF16>, avx2dot::panel_columns<BF16>, avx2dot::shard_columns<BF16>},
                                  avx2dot::pack_rows, avx2dot::panel_group, true};

// DAZ and FTZ on this thread while alive, where asked (VDPBF16PS's denormal rule, for its software
// form and for the lane tree and bias of both forms); the thread's previous mode after.
struct Denormals {
  unsigned saved;
  bool on;
  explicit Denormals(bool on) : saved(_mm_getcsr()), on(on) {
    if (on) _mm_setcsr(saved | 0x8040u);
  }
  ~Denormals() {
    if (on) _mm_setcsr(saved);
  }
};
static constexpr int SHARD_TILE_OUTPUTS = std::max(avx512::TILE_OUTPUTS, avx2::TILE_OUTPUTS);
static_assert(avx512::PANEL_COLS == avx2::PANEL_COLS && avx512::PANEL_ROWS >= avx2::PANEL_ROWS,
              "one accumulator buffer fits both");

// "avx512" or "avx2": the best this CPU runs.
static std::string best_variant() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return "avx512";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "avx2";
  return "";
}

// The variant a call of `rows` rows runs: the one asked for, else the best this CPU has, except that
// one row (a lone request's decode step) runs the AVX2 tiles on an AVX-512 CPU too: their two 8-lane
// accumulators an output are two dependency chains where the AVX-512 tile has one (measured 14-29%
// faster per token on AMD Zen 4, when both tiles took one column; the AVX2 one takes 4 now, measured on
// Zen 3 only). Both give the same bits, so the choice changes no bit.
static const Variant& variant_of(const std::string& variant, int64_t rows) {
  static const std::string best = best_variant();
  TORCH_CHECK_VALUE(variant == "" || variant == "avx512" || variant == "avx2",
                    "variant must be '', 'avx512' or 'avx2', got '", variant, "'");
  const std::string chosen = !variant.empty() ? variant : rows == 1 && best == "avx512" ? "avx2" : best;
  TORCH_CHECK(!chosen.empty(), "this CPU has neither AVX-512F nor AVX2 with FMA");
  TORCH_CHECK(chosen != "avx512" || best == "avx512", "this CPU has no AVX-512F");
  return chosen == "avx512" ? AVX512 : AVX2;
}

// Columns per work item of the direct tiles: a block of W of at most ~256 KiB, which stays in L2
// while every row group reads it, a multiple of 24 (of every variant's tile widths), 24 to 96
// columns. It decides which thread computes a column and when, not how.
static int64_t block_columns(int64_t K) {
  const int64_t cols = int64_t(256) * 1024 / (4 * std::max<int64_t>(K, 1)) / 24 * 24;
  return std::min<int64_t>(96, std::max<int64_t>(24, cols));
}

// From this many rows on, the packed, K-blocked tiles (tile.h, "Many rows"); below, the direct ones,
// which read W once without a buffer (decode is bound by reading W). Both give every output the same
// bits: the switch is for speed only.
static constexpr int64_t PANEL_MIN_ROWS = 16;

// Calls work(i) for the next i in [0, items) until none is left: the threads of a parallel region
// share `next`, so a thread that the OS holds back leaves its share to the others. Only who computes
// an item, and when, depends on it.
template <typename Work>
static void take_items(std::atomic<int64_t>& next, int64_t items, const Work& work) {
  for (int64_t i = next++; i < items; i = next++) work(i);
}

// Columns per work item of the packed tiles: 96 or 48 (multiples of the tile width and of the 16
// outputs `sums` (tile.h) takes at a time), W's packed block (columns x K) 384 KiB or, from K = 2048, 48 columns. It decides which thread
// computes a column and when, not how.
static int64_t panel_block_columns(int64_t K) {
  return std::max<int64_t>(48, std::min<int64_t>(avx512::PANEL_COLS, 96 * 1024 / std::max<int64_t>(K, 1) / 48 * 48));
}

// The products of x_s @ W_s^T (+ b) for S shards, in one parallel region: x_s is x's K columns from
// s K on (rows ldx apart), W_s = ws[s] an [N, K] of elements WT with rows ldw apart (the shards of a
// row-parallel matrix are its column slices: one matrix streamed as a whole). S = 1 is one product into
// y [M, N]. S > 1 (`linear_shards`, no bias): y is their shard tree, summed as each block of columns
// ends (shard_columns, panel_columns), each shard's product and each level's sum rounded `to` a narrower
// dtype where asked. Threads take blocks of columns: who computes an output, and when, never how.
template <typename WT>
static void run(const Variant& variant, const float* xp, int64_t ldx, int64_t M, int64_t K, const WT* const* ws,
                int64_t ldw, int64_t S, int64_t N, const float* bp, float* yp, Round to = Round::none) {
  const Kernels<WT>& v = variant.of<WT>();
  const int64_t threads = at::get_num_threads();
  if (M < PANEL_MIN_ROWS) {
    const int64_t block = block_columns(S * K), blocks = (N + block - 1) / block;
    std::atomic<int64_t> next{0};
    at::parallel_for(0, std::min(blocks, threads), 1, [&](int64_t, int64_t) {
      const Denormals mode(variant.flush_denormals);
      std::vector<float> lanes(S == 1 ? 0 : (S * SHARD_TILE_OUTPUTS + 16) * 16, 0.0f);
      take_items(next, blocks, [&](int64_t i) {
        const int64_t n0 = i * block, n1 = std::min(N, (i + 1) * block);
        if (S == 1) v.columns(xp, M, ldx, ws[0], ldw, K, bp, yp, N, n0, n1);
        else v.shard_columns(xp, M, ldx, ws, ldw, S, K, yp, N, n0, n1, lanes.data(), to);
      });
    });
    return;
  }
  const bool pairs = pairs_lanes();  // read once: the packing below and the tiles must agree
  const int64_t group = variant.panel_group(S, K, pairs), groups = (M + group - 1) / group, steps = (K + 15) / 16;
  const int64_t block = panel_block_columns(S * K), blocks = (N + block - 1) / block;
  const int64_t acc = avx512::PANEL_ROWS * avx512::PANEL_COLS * 16, shard_packed = groups * group * steps * 16;
  // panel_columns' tree: one slot per level of the shard tree, the last one the whole sum (S a power of two)
  const int64_t tree = S == 1 ? 0 : (__builtin_ctzll(uint64_t(S)) + 1) * avx512::PANEL_ROWS * avx512::PANEL_COLS;
  at::Tensor packed = at::empty({S * shard_packed}, at::kFloat);
  float* pp = packed.data_ptr<float>();
  std::atomic<int64_t> next_group{0}, packed_groups{0}, next_block{0};
  // One parallel region (every region waits for all its threads to start): the threads pack x's
  // groups, wait until all are packed, then compute blocks of columns, every shard of a block.
  at::parallel_for(0, std::min(blocks, threads), 1, [&](int64_t, int64_t) {
    const Denormals mode(variant.flush_denormals);
    take_items(next_group, S * groups, [&](int64_t item) {
      const int64_t s = item / groups, g = item % groups;
      variant.pack_rows(xp + s * K, ldx, K, g * group, int(std::min(group, M - g * group)),
                        pp + s * shard_packed + g * group * steps * 16);
      ++packed_groups;
    });
    while (packed_groups.load() < S * groups) std::this_thread::yield();
    const at::Tensor scratch = at::empty({acc + S * block * steps * 16 + tree}, at::kFloat);
    float* sp = scratch.data_ptr<float>();
    std::fill(sp, sp + acc, 0.0f);  // sums (tile.h) reads the lanes past a narrow block's last column too
    take_items(next_block, blocks, [&](int64_t i) {
      v.panel_columns(pp, shard_packed, M, K, ws, ldw, S, bp, yp, N, i * block, std::min(N, (i + 1) * block), sp,
                      sp + acc, sp + acc + S * block * steps * 16, pairs, to);
    });
  });
}

// The checks every entry takes: fp32 x [M, K], fp32 or bf16 W [N, K], on the CPU.
static void check_operands(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK_VALUE(x.dtype() == at::kFloat && (weight.dtype() == at::kFloat || weight.dtype() == at::kBFloat16),
                    "fixed_order linear takes fp32 x and an fp32 or bf16 weight, got ", x.dtype(), " and ",
                    weight.dtype());
  TORCH_CHECK_VALUE(x.device().is_cpu() && weight.device().is_cpu(), "fixed_order linear runs on the CPU");
  TORCH_CHECK_VALUE(x.dim() == 2 && weight.dim() == 2, "x must be [M, K] and weight [N, K]");
  TORCH_CHECK_VALUE(x.size(1) == weight.size(1), "x has K=", x.size(1), " but weight has K=", weight.size(1));
}

// `run` over weights of fp32 or bf16 elements, one per shard, whose rows are equally far apart.
static void run_any(const Variant& v, const float* xp, int64_t ldx, int64_t M, int64_t K,
                    const std::vector<at::Tensor>& weights, const float* bp, float* yp, Round to = Round::none) {
  const int64_t S = int64_t(weights.size()), N = weights[0].size(0), ldw = weights[0].stride(0);
  if (weights[0].dtype() == at::kBFloat16) {
    std::vector<const BF16*> ws;
    for (const auto& w : weights) ws.push_back(reinterpret_cast<const BF16*>(w.data_ptr<at::BFloat16>()));
    run(v, xp, ldx, M, K, ws.data(), ldw, S, N, bp, yp, to);
  } else {
    std::vector<const float*> ws;
    for (const auto& w : weights) ws.push_back(w.data_ptr<float>());
    run(v, xp, ldx, M, K, ws.data(), ldw, S, N, bp, yp, to);
  }
}

at::Tensor linear(at::Tensor x, at::Tensor weight, c10::optional<at::Tensor> bias,
                  const std::string& variant) {
  check_operands(x, weight);
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const Variant& v = variant_of(variant, M);
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
  run_any(v, x.data_ptr<float>(), K, M, K, {weight}, bias.has_value() ? b.data_ptr<float>() : nullptr,
          y.data_ptr<float>());
  return y;
}

// x [M, K] fp32 as bf16 pairs: each element rounded to nearest even as torch's x.to(torch.bfloat16) does
// (`bf16_nearest_bits`), elements 2i and 2i + 1 of a row in 32-bit element i's low and high halves; an odd
// K gets one zero element more.
static at::Tensor bf16_pairs(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), pairs = (K + 1) / 2;
  at::Tensor out = at::empty({M, pairs}, x.options().dtype(at::kInt));
  const uint32_t* in = reinterpret_cast<const uint32_t*>(x.data_ptr<float>());
  uint16_t* halves = reinterpret_cast<uint16_t*>(out.data_ptr<int32_t>());
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint32_t* row = in + r * K;
      uint16_t* half = halves + r * 2 * pairs;
      for (int64_t k = 0; k < K; ++k) half[k] = uint16_t(bf16_nearest_bits(row[k]) >> 16);
      if (K % 2) half[K] = 0;
    }
  });
  return out;
}

// The bf16 dot-product variant asked for: '' (the instruction where the CPU has AVX512-BF16, else its
// software form), 'avx512' or 'avx2' (the software form); both give the same bits.
static const Variant& dot_variant_of(const std::string& variant) {
  TORCH_CHECK_VALUE(variant == "" || variant == "avx512" || variant == "avx2",
                    "variant must be '', 'avx512' or 'avx2', got '", variant, "'");
  __builtin_cpu_init();
  const bool has_dot = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
  TORCH_CHECK(variant != "avx512" || has_dot, "this CPU has no AVX512-BF16");
  TORCH_CHECK(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"), "this CPU has no AVX2 with FMA");
  return variant == "avx2" || !has_dot ? AVX2_DOT : AVX512_DOT;
}

// y = x @ W^T (+ b) for fp32 x [M, K] and bf16 W [N, K] on bf16 dot products: x rounded to
// bf16 (`bf16_pairs`), then the order of the top of this file with pairs for elements: lane j takes
// the pairs p with p % 16 == j in increasing p (the tail of K % 32 elements zero-padded to one more
// step), each pair one VDPBF16PS step (`lanes.h`: + the high elements' product, then + the low
// ones'), the same lane tree, then the bias; denormals flushed throughout (DAZ, FTZ). "avx512" runs the
// instruction (AVX512-BF16), "avx2" its software form with the same bits; every row count runs the same
// sequence per output, so decode == prefill and batched == alone by construction.
at::Tensor linear_bf16_dot(at::Tensor x, at::Tensor weight, c10::optional<at::Tensor> bias, const std::string& variant) {
  check_operands(x, weight);
  TORCH_CHECK_VALUE(weight.dtype() == at::kBFloat16, "linear_bf16_dot takes a bf16 weight, got ", weight.dtype());
  const Variant& v = dot_variant_of(variant);
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  // An odd K: W with one zero column more, as x gets one zero element (a pair's high half: + 0 * 0).
  weight = K % 2 ? at::constant_pad_nd(weight, {0, 1}) : weight.contiguous();
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK_VALUE(b.dtype() == at::kFloat && b.dim() == 1 && b.size(0) == N, "bias must be fp32 [N] with N=", N);
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const at::Tensor pairs = bf16_pairs(x.contiguous());
  const float* w = reinterpret_cast<const float*>(weight.data_ptr<at::BFloat16>());
  run(v, reinterpret_cast<const float*>(pairs.data_ptr<int32_t>()), (K + 1) / 2, M, (K + 1) / 2, &w, (K + 1) / 2, 1, N,
      bias.has_value() ? b.data_ptr<float>() : nullptr, y.data_ptr<float>());
  return y;
}

// x @ W^T for W given as S shards of equal width (W's K slices, in order: shard s holds features
// [s K/S, (s+1) K/S)): each shard's product in the one order of `linear` on its slice of x, the S
// products summed in a binary tree, (0+1), (2+3), ..., then pairs of those. The order in which a
// tensor-parallel rank sums its shards and the ranks sum theirs (parallel/tree.py), in one call: no
// copies of x's slices, no call of Python per shard. Shards whose rows lie equally far apart (the
// column slices of one matrix, as a row-parallel layer holds them) are read in place, so the product
// streams W as the unsharded one does; others are made contiguous first.
// `dot`: bf16 shards on bf16 dot products (`linear_bf16_dot`'s order per shard), the tree with
// denormals flushed as that order's are. `to`: each shard's product and each level's sum rounded to
// bf16 or fp16 (fp32 rows of such values: the per-shard calls under rows of that dtype, in one call).
static at::Tensor shard_tree(at::Tensor x, std::vector<at::Tensor> shards, const std::string& variant, bool dot,
                             Round to = Round::none) {
  const int64_t S = int64_t(shards.size());
  TORCH_CHECK_VALUE(S >= 1 && (S & (S - 1)) == 0, "the number of shards must be a power of two, got ", S);
  const at::Tensor& first = shards[0];
  TORCH_CHECK_VALUE(first.dim() == 2, "each shard must be [N, K / S], got ", first.dim(), " dimensions");
  const int64_t M = x.size(0), width = first.size(1), N = first.size(0);
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) == S * width, "x must be [M, K] with K = ", S, " shards x ", width);
  check_operands(x.narrow(1, 0, width), first);  // once: a narrowed x is a tensor made per call
  bool in_place = !(dot && width % 2);
  for (const auto& shard : shards) {
    TORCH_CHECK_VALUE(shard.dim() == 2 && shard.size(0) == N && shard.size(1) == width &&
                          shard.dtype() == first.dtype() && shard.device() == first.device(),
                      "the shards differ in shape, dtype or device");
    TORCH_CHECK_VALUE(!dot || shard.dtype() == at::kBFloat16, "bf16 dot products take bf16 shards");
    in_place = in_place && shard.stride(1) == 1 && shard.stride(0) == first.stride(0) && shard.stride(0) >= width &&
               (!dot || (shard.stride(0) % 2 == 0 && shard.storage_offset() % 2 == 0));  // whole pairs
  }
  // bf16 dot products on an odd width: each shard one zero column more, as each slice of x (below)
  if (!in_place)
    for (auto& shard : shards) shard = dot && width % 2 ? at::constant_pad_nd(shard, {0, 1}) : shard.contiguous();
  TORCH_CHECK_VALUE(S <= 64, "at most 64 shards, got ", S);
  const Variant& v = dot ? dot_variant_of(variant) : variant_of(variant, M);
  x = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  float* yp = y.data_ptr<float>();
  if (dot) {
    const int64_t padded = width + width % 2;
    const at::Tensor pairs = bf16_pairs(width % 2 ? at::constant_pad_nd(x.view({M, S, width}), {0, 1}).view({M, S * padded}) : x);
    std::vector<const float*> ws;
    for (const auto& w : shards) ws.push_back(reinterpret_cast<const float*>(w.data_ptr<at::BFloat16>()));
    run(v, reinterpret_cast<const float*>(pairs.data_ptr<int32_t>()), S * padded / 2, M, padded / 2, ws.data(),
        shards[0].stride(0) / 2, S, N, nullptr, yp);
  } else {
    run_any(v, x.data_ptr<float>(), S * width, M, width, shards, nullptr, yp, to);
  }
  return y;
}

// `round`: '' (fp32 sums), 'bfloat16' or 'float16' (`Round`).
at::Tensor linear_shards(at::Tensor x, std::vector<at::Tensor> shards, const std::string& variant,
                         const std::string& round) {
  TORCH_CHECK_VALUE(round == "" || round == "bfloat16" || round == "float16",
                    "round must be '', 'bfloat16' or 'float16', got '", round, "'");
  return shard_tree(x, shards, variant, false,
                    round == "bfloat16" ? Round::bf16 : round == "float16" ? Round::fp16 : Round::none);
}

// lanes.h's `lane_pairing_forced`, by name; the bits are the same in every mode.
static void set_lane_pairing(const std::string& mode) {
  TORCH_CHECK_VALUE(mode == "auto" || mode == "on" || mode == "off", "mode must be 'auto', 'on' or 'off', got '",
                    mode, "'");
  lane_pairing_forced.store(mode == "auto" ? -1 : mode == "on" ? 1 : 0);
}

// `linear_shards` on bf16 dot products: each shard `linear_bf16_dot`'s order, the same tree.
at::Tensor linear_bf16_dot_shards(at::Tensor x, std::vector<at::Tensor> shards, const std::string& variant) {
  return shard_tree(x, shards, variant, true);
}

// y [M, N] = `linear_shards` of x [M, S * K] (rows ldx apart) and the S shards of `shards` [S, N, K]
// (fp32 or bf16, rows equally far apart, each row contiguous): moe.cpp's sharded down matrices, read in
// place, with no tensor made per shard.
void linear_shards_into(const float* x, int64_t ldx, int64_t M, const at::Tensor& shards, float* y) {
  TORCH_CHECK_VALUE((shards.dtype() == at::kFloat || shards.dtype() == at::kBFloat16) && shards.dim() == 3 &&
                        shards.stride(2) == 1 && shards.device().is_cpu(),
                    "linear_shards_into takes fp32 or bf16 CPU shards [S, N, K] whose rows are contiguous");
  const int64_t S = shards.size(0), N = shards.size(1), K = shards.size(2);
  TORCH_CHECK_VALUE(S >= 1 && S <= 64 && (S & (S - 1)) == 0, "the number of shards must be a power of two, got ", S);
  if (M == 0 || N == 0) return;
  const Variant& v = variant_of("", M);
  if (shards.dtype() == at::kBFloat16) {
    std::vector<const BF16*> ws;
    const BF16* base = reinterpret_cast<const BF16*>(shards.data_ptr<at::BFloat16>());
    for (int64_t s = 0; s < S; ++s) ws.push_back(base + s * shards.stride(0));
    run(v, x, ldx, M, K, ws.data(), shards.stride(1), S, N, nullptr, y);
  } else {
    std::vector<const float*> ws;
    for (int64_t s = 0; s < S; ++s) ws.push_back(shards.data_ptr<float>() + s * shards.stride(0));
    run(v, x, ldx, M, K, ws.data(), shards.stride(1), S, N, nullptr, y);
  }
}

// y [M, N] = x [M, K] (rows ldx apart) @ weight^T in the order above, weight [N, K] contiguous fp32 or
// bf16: one product from C++ (moe.cpp's experts), on the variant `linear` would run.
void linear_into(const float* x, int64_t ldx, int64_t M, int64_t K, const at::Tensor& weight, float* y) {
  TORCH_CHECK_VALUE((weight.dtype() == at::kFloat || weight.dtype() == at::kBFloat16) && weight.dim() == 2 &&
                        weight.size(1) == K && weight.is_contiguous() && weight.device().is_cpu(),
                    "linear_into takes a contiguous fp32 or bf16 CPU weight [N, ", K, "]");
  if (M > 0 && weight.size(0) > 0) run_any(variant_of("", M), x, ldx, M, K, {weight}, nullptr, y);
}

void register_gated_delta(pybind11::module& m);  // gated_delta.cpp
void register_attention(pybind11::module& m);  // attention.cpp
void register_rows(pybind11::module& m);  // rows.cpp
void register_moe(pybind11::module& m);  // moe.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_gated_delta(m);
  register_attention(m);
  register_rows(m);
  register_moe(m);
  m.def("linear", &linear, "y = x @ W^T (+ b) in the fixed reduction order", pybind11::arg("x"),
        pybind11::arg("weight"), pybind11::arg("bias") = pybind11::none(), pybind11::arg("variant") = "");
  m.def("linear_shards", &linear_shards, "x @ W^T for W in K shards, their products summed in the fixed tree",
        pybind11::arg("x"), pybind11::arg("shards"), pybind11::arg("variant") = "", pybind11::arg("round") = "");
  m.def("best_variant", &best_variant, "the instruction set the kernel runs by default");
  m.def("lane_pairing", &pairs_lanes, "whether the packed tiles take two lanes at once (speed only, lanes.h)");
  m.def("set_lane_pairing", &set_lane_pairing, "'auto' (the CPU decides), 'on' or 'off': for tests of both forms",
        pybind11::arg("mode"));
  m.def("linear_bf16_dot_shards", &linear_bf16_dot_shards, "linear_shards on bf16 dot products",
        pybind11::arg("x"), pybind11::arg("shards"), pybind11::arg("variant") = "");
  m.def("linear_bf16_dot", &linear_bf16_dot, "y = x @ W^T (+ b) for bf16 W on bf16 dot products, in one order",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("variant") = "");
}
