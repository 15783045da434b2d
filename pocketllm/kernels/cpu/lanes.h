// The 16 logical fp32 lanes of the fixed-order kernels, per instruction set: `avx512::Lanes` (one
// register) and `avx2::Lanes` (two), with the same operations, so that code written on `Lanes`
// (tile.h, attend.h), included once in each namespace under its `#pragma GCC target`, gives the same
// bits on both. Shared by linear.cpp and attention.cpp.
#pragma once
#include <immintrin.h>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <c10/util/Half.h>

// Whether the packed tiles (tile.h) take two lanes at once where they may (`paired`): a choice of speed
// only, since both forms give every output the same FMA sequence and lane tree. Off on CPUs whose 256-bit
// operations run as two 128-bit halves, loads included (AMD Zen 1 and Zen+, GCC's "znver1"): there the
// paired tile's loads (10 per 12 FMAs, against 8) bound it, and one lane at a time measured 10-25%
// faster (the tree's 8 shards at 512 rows 0.62-0.85x -> 0.85-0.96x the unsharded product); on Zen 3 two
// lanes measured 1.1x. `lane_pairing_forced` (-1: the CPU decides, 0: off, 1: on) lets the tests run
// both forms on any CPU. A call reads it once (`pairs_lanes`) and hands the answer down.
inline std::atomic<int> lane_pairing_forced{-1};
inline bool pairs_lanes() {
  const int forced = lane_pairing_forced.load(std::memory_order_relaxed);
  if (forced >= 0) return forced == 1;
  static const bool halves = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("znver1") != 0;
  }();
  return !halves;
}

// A bf16 weight element: the upper 16 bits of the fp32 with the same value.
struct BF16 {
  uint16_t bits;
};

// What a shard tree's sums are rounded to (linear.cpp's `linear_shards` under bf16 or fp16 rows): each
// shard's product and each level's sum to the nearest even of the rows' dtype, as torch rounds a product
// of those rows and every add of two such tensors (an fp32 add, then the rounding), so one call gives the
// bits of one call per shard summed by `tree_sum`; none: fp32 throughout.
enum class Round : int { none, bf16, fp16 };

// The fp32 bits u rounded to bf16's nearest even, as c10::BFloat16 and torch's x.to(torch.bfloat16) round
// (NaN to the quiet 0x7FC0), in the upper 16 bits: branch-free, so that a loop of it vectorizes.
static inline uint32_t bf16_nearest_bits(uint32_t u) {
  const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return nan ? 0x7FC00000u : (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
}

// v rounded to bf16's nearest even, in fp32.
static inline float bf16_nearest(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  u = bf16_nearest_bits(u);
  std::memcpy(&v, &u, sizeof u);
  return v;
}

// v[0, n) rounded `to` (fp16 by c10::Half's own conversion, element by element).
static inline void round_to(float* v, int64_t n, Round to) {
  if (to == Round::bf16)
    for (int64_t i = 0; i < n; ++i) v[i] = bf16_nearest(v[i]);
  else if (to == Round::fp16)
    for (int64_t i = 0; i < n; ++i) v[i] = float(c10::Half(v[i]));
}

// The first n (< 16) elements of p, then zeros: a tail step's bf16s, read without touching memory past p + n.
static inline void copy_tail(const BF16* p, int n, BF16* buffer) {
  std::memset(buffer, 0, 16 * sizeof(BF16));
  std::memcpy(buffer, p, size_t(n) * sizeof(BF16));
}

namespace avx512 {
#pragma GCC push_options
#pragma GCC target("avx512f,fma")
struct Lanes {
  using V = __m512;
  // Register tiles: up to 8 rows x 3 columns (24 accumulators of 32 registers); 1-2 rows (decode)
  // take 8 columns, more streams of W in flight.
  static constexpr int ROWS = 8;
  static constexpr int cols(int rows) { return rows == 1 ? 1 : rows == 2 ? 8 : 3; }
  static inline V zero() { return _mm512_setzero_ps(); }
  static inline V load(const float* p) { return _mm512_loadu_ps(p); }
  static inline V load_tail(const float* p, int n) {
    return _mm512_maskz_loadu_ps(__mmask16((1u << n) - 1u), p);
  }
  static inline V load(const BF16* p) {  // 16 bf16s widened: each 16 bits shifted to the top of a lane
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static inline V load_tail(const BF16* p, int n) {
    BF16 buffer[16];
    copy_tail(p, n, buffer);
    return load(buffer);
  }
  static inline V fma(V a, V b, V acc) { return _mm512_fmadd_ps(a, b, acc); }
  static inline V broadcast(float x) { return _mm512_set1_ps(x); }
  static inline V broadcast(const float* p) { return _mm512_set1_ps(*p); }  // (a load: bits as they are)
  // attend.h's weighted sums: 4 rows x 4 column vectors (16 accumulators, 4 of values, 1 broadcast).
  static constexpr int WEIGHTED_ROWS = 4;
  static constexpr int WEIGHTED_COLS = 4;
  static inline void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static inline void store_tail(float* p, V v, int n) { _mm512_mask_storeu_ps(p, __mmask16((1u << n) - 1u), v); }
  // Keeps v in a register: GCC would fold its load into each FMA that uses it, one load per FMA.
  static inline void in_register(V& v) { asm("" : "+v"(v)); }
  // Many rows (tile.h's lane-major tiles): 8 rows x 3 vectors of 16 columns (24 accumulators; 8
  // broadcasts and 3 loads of W per 24 FMAs).
  static constexpr int PANEL_ROWS = 8;
  static constexpr int PANEL_C = 3;
  static inline float sum(V v) {
    const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
  }
  // The primitives of `sums` (tile.h), 16 outputs at a time: a register S holds one float per output.
  using S = __m512;
  static constexpr int GROUP = 16;
  static inline __m512 halves(__m512 lo, const float* hi) {  // [lo[0..7], hi[0..7]]
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(lo), _mm256_castps_pd(_mm256_loadu_ps(hi)), 1));
  }
  // [l[j] + l[j+8] of output 2p, of output 2p+1]: the halves put together as they are loaded, which does
  // not take the shuffle port.
  static inline S first(const float* acc, int p) {
    const float* a = acc + 32 * p;
    return _mm512_add_ps(halves(_mm512_castps256_ps512(_mm256_loadu_ps(a)), a + 16),
                         halves(_mm512_castps256_ps512(_mm256_loadu_ps(a + 8)), a + 24));
  }
  static inline S first(const V* acc, int p) {  // the same from registers: [a0..7, b0..7] + [a8..15, b8..15]
    return _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * p], acc[2 * p + 1], 0x44),
                         _mm512_shuffle_f32x4(acc[2 * p], acc[2 * p + 1], 0xEE));
  }
  static inline S blocks_even(S a, S b) { return _mm512_shuffle_f32x4(a, b, 0x88); }  // 128-bit lane q: output 4p+q
  static inline S blocks_odd(S a, S b) { return _mm512_shuffle_f32x4(a, b, 0xDD); }
  template <int IMM>
  static inline S shuffle(S a, S b) { return _mm512_shuffle_ps(a, b, IMM); }
  static inline S add(S a, S b) { return _mm512_add_ps(a, b); }
  static inline S in_order(S s) {  // element 4q+t holds output 4t+q
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), s);
  }
  static inline void store_sums(float* y, S s, int64_t count, const float* bias) {  // the first count <= 16
    const __mmask16 keep = count >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1u);
    if (bias != nullptr) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(keep, bias));
    _mm512_mask_storeu_ps(y, keep, s);
  }
};
#pragma GCC pop_options
}  // namespace avx512

namespace avx2 {
#pragma GCC push_options
#pragma GCC target("avx2,fma")
struct Lanes {
  struct V { __m256 lo, hi; };  // lanes 0-7 and 8-15
  // Register tiles: 4 rows x 1 column (8 of 16 registers accumulate); one row (decode, and one row on
  // an AVX-512 CPU too) takes 4 columns, four rows of W streamed at once (one-row products 6-9% faster,
  // the tree's shards up to 17%, on AMD Zen 3).
  static constexpr int ROWS = 4;
  static constexpr int cols(int rows) { return rows == 1 ? 4 : 1; }
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
  static inline __m256 widen(const BF16* p) {  // 8 bf16s
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static inline V load(const BF16* p) { return {widen(p), widen(p + 8)}; }
  static inline V load_tail(const BF16* p, int n) {
    BF16 buffer[16];
    copy_tail(p, n, buffer);
    return load(buffer);
  }
  static inline V fma(V a, V b, V acc) {
    return {_mm256_fmadd_ps(a.lo, b.lo, acc.lo), _mm256_fmadd_ps(a.hi, b.hi, acc.hi)};
  }
  static inline V broadcast(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
  static inline V broadcast(const float* p) {
    const __m256 b = _mm256_broadcast_ss(p);
    return {b, b};
  }
  // attend.h's weighted sums: 6 rows x 1 column vector (12 of 16 registers accumulate; each value
  // vector loaded once for 6 rows, where 2 x 2 read the values three times as often: 1.2x on Zen 3).
  static constexpr int WEIGHTED_ROWS = 6;
  static constexpr int WEIGHTED_COLS = 1;
  static inline void store(float* p, V v) {
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
  }
  static inline void store_tail(float* p, V v, int n) {  // the first n <= 16 lanes
    _mm256_maskstore_ps(p, _mm256_castps_si256(mask(n)), v.lo);
    _mm256_maskstore_ps(p + 8, _mm256_castps_si256(mask(n - 8)), v.hi);
  }
  static inline void in_register(V& v) { asm("" : "+v"(v.lo), "+v"(v.hi)); }
  // Many rows (tile.h's lane-major tiles): 6 rows x 16 columns (12 accumulators, 2 registers of W,
  // one broadcast x: 8 loads per 12 FMAs, where a tile of whole outputs loads 14).
  static constexpr int PANEL_ROWS = 6;
  static constexpr int PANEL_C = 1;
  static inline float sum(V v) {
    const __m256 s8 = _mm256_add_ps(v.lo, v.hi);
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
  }
  // The primitives of `sums` (tile.h), 8 outputs at a time.
  using S = __m256;
  static constexpr int GROUP = 8;
  static inline S first(const float* acc, int p) {  // l[j] + l[j+8] of output p
    return _mm256_add_ps(_mm256_loadu_ps(acc + 16 * p), _mm256_loadu_ps(acc + 16 * p + 8));
  }
  static inline S first(const V* acc, int p) { return _mm256_add_ps(acc[p].lo, acc[p].hi); }  // from registers
  static inline S blocks_even(S a, S b) { return _mm256_permute2f128_ps(a, b, 0x20); }  // 128-bit lane q: output 2p+q
  static inline S blocks_odd(S a, S b) { return _mm256_permute2f128_ps(a, b, 0x31); }
  template <int IMM>
  static inline S shuffle(S a, S b) { return _mm256_shuffle_ps(a, b, IMM); }
  static inline S add(S a, S b) { return _mm256_add_ps(a, b); }
  static inline V add(V a, V b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
  static inline S in_order(S s) {  // element 4q+t holds output 2t+q
    return _mm256_permutevar8x32_ps(s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  }
  static inline void store_sums(float* y, S s, int64_t count, const float* bias) {  // the first count <= 8
    const __m256i keep = _mm256_castps_si256(mask(int(count < 8 ? count : 8)));
    if (bias != nullptr) s = _mm256_add_ps(s, _mm256_maskload_ps(bias, keep));
    _mm256_maskstore_ps(y, keep, s);
  }
};
#pragma GCC pop_options
}  // namespace avx2

// The bf16 dot-product lanes (linear.cpp's `linear_bf16_dot`): each 32-bit element is a pair of bf16s
// (element 2i in its low half, 2i + 1 in its high half), and `fma` is one step of the instruction
// VDPBF16PS on every lane: + x[2i+1] w[2i+1], then + x[2i] w[2i], each product exact in fp32 and each
// sum rounded to nearest even; denormal inputs read as zero, denormal sums flushed to zero.
namespace avx512dot {
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bf16,fma")
struct Lanes : avx512::Lanes {
  static inline V fma(V a, V b, V acc) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }
};
#pragma GCC pop_options
}  // namespace avx512dot

// The same step in two FMAs per half (the products are exact, so an FMA rounds as the instruction's
// sum does), on any AVX2 CPU; run with DAZ and FTZ set (linear.cpp's `Denormals`), the instruction's
// denormal rule.
namespace avx2dot {
#pragma GCC push_options
#pragma GCC target("avx2,fma")
struct Lanes : avx2::Lanes {
  static inline __m256 high(__m256 v) { return _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(int(0xFFFF0000u)))); }
  static inline __m256 low(__m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(v), 16)); }
  static inline __m256 pairs(__m256 a, __m256 b, __m256 acc) {
    return _mm256_fmadd_ps(low(a), low(b), _mm256_fmadd_ps(high(a), high(b), acc));
  }
  static inline V fma(V a, V b, V acc) { return {pairs(a.lo, b.lo, acc.lo), pairs(a.hi, b.hi, acc.hi)}; }
};
#pragma GCC pop_options
}  // namespace avx2dot
