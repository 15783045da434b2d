// Causal attention of query rows over their slot's keys, fp32, in an order this file owns, for
// prefill pieces and decode rows alike: a position's output is one function of its query and the
// keys 0 .. its position, whichever call computes it (exact positions on the CPU).
//
// Per query row at absolute position p and head h (K/V head h / group):
//   s_j = dot(q, k_j) * scale for j = 0 .. p, the dot in linear.cpp's order (16 lanes over the head
//       dim, one FMA per element in increasing d, the tail zero-padded as one more step, the lane tree);
//   m = max_j s_j;  e_j = exp_fixed(s_j - m) (below);  z = e_0 + e_1 + ... in increasing j, from +0;
//   out_d = acc_d / z, where acc_d = fma(e_j, v_jd, acc_d) for j = 0 .. p in increasing j, from +0.
// exp is this file's own (`exp_fixed`), not the C library's, so that it vectorises and gives the same
// bits on every machine. A row's work is computed with zero weights past its last key (e = 0: each
// such FMA adds +0 to a sum that is never -0, and z + 0 = z), so the keys a block reads beyond a row's
// position change none of its bits. The AVX-512 and AVX2 variants (lanes.h, attend.h) run the same
// operation sequence per output; work items are blocks of rows and a K/V head, and a row's
// arithmetic does not depend on its block, so nothing depends on the batch, the piece or the threads.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>

#include "lanes.h"

namespace {

// e^x for x <= 0 (a softmax's score minus its maximum), within ~1 ulp: x = n ln2 + r with n the nearest
// integer to x log2(e) (|r| <= ln2 / 2, ln2 in two parts, Cody and Waite), e^r by a degree-6 polynomial
// (Cephes' expf coefficients) in Horner's form, times 2^n built from its bits; 0 below -87, where 2^n
// would leave the normal range. Every step is one rounded fp32 operation or FMA as written, the same
// whether the compiler vectorises it or not.
inline float exp_fixed(float x) {
  const float xc = std::max(x, -87.0f);
  const float t = xc * 1.44269504088896341f;
  const float n = (t + 12582912.0f) - 12582912.0f;  // round to nearest: 1.5 * 2^23 leaves no fraction bits
  float r = std::fma(n, -0.693359375f, xc);
  r = std::fma(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p, r * r, r) + 1.0f;
  const uint32_t bits = uint32_t(int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.0f ? 0.0f : p * scale;
}

// Up to BLOCK consecutive query rows of one slot with the query heads of one K/V head: each key and
// value row is read once for all of them. It changes which loop runs first, not any row's arithmetic.
constexpr int64_t BLOCK = 16;

struct Item {
  const float* q;             // row t, head h at q + (t * heads + h) * dim
  const float* keys;          // key j at keys + j * stride
  const float* packed_keys;   // or nullptr: keys 0 .. packed_length - 1 packed for the panel tiles (Packed),
                              // given to the blocks whose scores run them (`packed_scores`)
  int64_t packed_length;
  const float* values;        // value j's 16-lane column vector c at values + j * value_row + c * value_column
  const int64_t* positions;   // of rows t0 .. t0 + rows - 1
  int64_t t0, n, heads, h0, group, stride, dim, length;  // n = rows x group vectors; keys 0 .. length - 1
  int64_t value_row, value_column;  // packed: 16 and the pack's length x 16 (dim zero-padded to 16s)
  float scale;
  float* out;                 // as q
  bool pairs;                 // lanes.h's `pairs_lanes`, as the keys were packed
  int64_t offset(int64_t i) const { return ((t0 + i / group) * heads + h0 + i % group) * dim; }
  const float* query(int64_t i) const { return q + offset(i); }
  float* output(int64_t i) const { return out + offset(i); }
  int64_t last(int64_t i) const { return positions[t0 + i / group]; }
};

// Whether a block of `vectors` query vectors (rows x the query heads of a K/V head) computes its scores
// on the packed tiles: more than 8, half of an AVX2 tile's 16 columns (AVX-512's tiles are 48 wide; not
// measured there). Fewer run the direct tiles on the cache, and their pack holds no keys for them.
inline bool packed_scores(int64_t vectors) { return vectors > 8; }

// The largest PANEL_ROWS and the PANEL_COLS of tile.h's variants (checked where they are included).
constexpr int64_t MOST_PANEL_ROWS = 8, PANEL_WIDTH = 96;

// One thread's buffers for attend_item (attend.h), sized for the call's largest item.
struct Scratch {
  at::Tensor qb;  // ATen's allocation: 64-byte aligned, so that no query load splits a cache line (25% of the scores)
  std::vector<float> scores, sums, top, total, values_padded, acc, wp;
  std::vector<int64_t> last;
  Scratch(int64_t n, int64_t length, int64_t dim) {
    const int64_t dim16 = (dim + 15) / 16 * 16;
    qb = at::empty({n * dim}, at::kFloat);
    scores.resize((length + MOST_PANEL_ROWS) * n);  // the panel tiles' whole groups of keys
    acc.resize(MOST_PANEL_ROWS * PANEL_WIDTH * 16);
    wp.resize(PANEL_WIDTH * dim16);
    sums.resize(n * dim16);
    top.resize(n);
    last.resize(n);
    total.resize(n);
    if (dim != dim16) values_padded.resize(length * dim16);
  }
};

using PackRows = void (*)(const float*, int64_t, int64_t, int64_t, int, float*);

// The keys and values of the slots that blocks of several rows (prefill pieces) read, copied per K/V
// head: the keys as the x of tile.h's packed tiles (pack_rows, in groups of `group_rows` keys from key
// 0) where a block of the slot has `packed_scores` (of its `vectors_of`, as the block's item decides),
// the values by 16-lane column vectors (vector c of every row, then c + 1, zero-padded to a multiple
// of 16), the order the weighted sums read them. In the cache a head's rows lie kv_heads * dim floats
// apart (4 KiB at 8 heads of 128), so that they share a few cache sets and evict one another while
// every block of rows reads them again. It changes where a key or value is read from, never what is
// computed.
struct Packed {
  std::vector<int64_t> of_slot;  // slot -> its pack, or -1
  std::vector<int64_t> length, offset;
  std::vector<bool> with_keys;  // whether a pack's keys are packed
  int64_t dim16;  // a row's floats in a pack: the head dim padded to 16s
  at::Tensor data;  // every pack's keys, then every pack's values

  template <typename LengthOf, typename VectorsOf>
  Packed(const float* k, const float* v, const int64_t* slots, const std::vector<int64_t>& starts, int64_t max_len,
         int64_t kv_heads, int64_t dim, const LengthOf& length_of, const VectorsOf& vectors_of, int64_t group_rows,
         PackRows pack_rows)
      : dim16((dim + 15) / 16 * 16) {
    std::vector<int64_t> slot_of;
    for (size_t b = 0; b + 1 < starts.size(); ++b) {
      if (starts[b + 1] - starts[b] < 2) continue;
      const int64_t slot = slots[starts[b]];
      if (int64_t(of_slot.size()) <= slot) of_slot.resize(slot + 1, -1);
      if (of_slot[slot] < 0) {
        of_slot[slot] = int64_t(slot_of.size());
        slot_of.push_back(slot), length.push_back(0), with_keys.push_back(false);
      }
      length[of_slot[slot]] = std::max(length[of_slot[slot]], length_of(int64_t(b)));
      if (packed_scores(vectors_of(int64_t(b)))) with_keys[of_slot[slot]] = true;
    }
    offset.assign(1, 0);
    for (int64_t l : length) offset.push_back(offset.back() + l * kv_heads * dim16);
    data = dim % 16 ? at::zeros({2 * offset.back()}, at::kFloat) : at::empty({2 * offset.back()}, at::kFloat);
    float* out = data.data_ptr<float>();
    at::parallel_for(0, int64_t(slot_of.size()) * kv_heads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t pack = i / kv_heads, kvh = i % kv_heads;
        const int64_t from = (slot_of[pack] * max_len * kv_heads + kvh) * dim, rows = length[pack];
        float* keys_to = out + offset[pack] + kvh * rows * dim16;
        float* values_to = keys_to + offset.back();
        for (int64_t j = 0; with_keys[pack] && j < rows; j += group_rows)
          pack_rows(k + from, kv_heads * dim, dim, j, int(std::min(group_rows, rows - j)), keys_to + j * dim16);
        for (int64_t j = 0; j < rows; ++j) {
          const float* value = v + from + j * kv_heads * dim;
          for (int64_t d = 0; d < dim; d += 16)
            std::copy(value + d, value + std::min(d + 16, dim), values_to + (d / 16 * rows + j) * 16);
        }
      }
    });
  }
  const float* keys(int64_t pack, int64_t kvh) const {
    return data.data_ptr<float>() + offset[pack] + kvh * length[pack] * dim16;
  }
  const float* values(int64_t pack, int64_t kvh) const { return keys(pack, kvh) + offset.back(); }
};

}  // namespace

namespace avx512 {
#pragma GCC push_options
#pragma GCC target("avx512f,fma")
#include "tile.h"
#include "attend.h"
#pragma GCC pop_options
}  // namespace avx512

namespace avx2 {
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#include "tile.h"
#include "attend.h"
#pragma GCC pop_options
}  // namespace avx2

static_assert(avx512::PANEL_ROWS <= MOST_PANEL_ROWS && avx2::PANEL_ROWS <= MOST_PANEL_ROWS &&
              avx512::PANEL_COLS == PANEL_WIDTH && avx2::PANEL_COLS == PANEL_WIDTH, "Scratch fits the panel tiles");

// q [T, H, D] fp32 contiguous; k_cache, v_cache [slots, max_len, KV, D] fp32 contiguous;
// row_slots, row_positions [T] int64 (each row's slot and absolute position) -> out [T, H, D].
at::Tensor attention_rows(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor row_slots,
                          at::Tensor row_positions, double scale, const std::string& variant) {
  for (const at::Tensor* t : {&q, &k_cache, &v_cache})
    TORCH_CHECK_VALUE(t->dtype() == at::kFloat && t->is_contiguous() && t->device().is_cpu(),
                      "attention_rows takes contiguous fp32 CPU tensors");
  TORCH_CHECK_VALUE(row_slots.dtype() == at::kLong && row_positions.dtype() == at::kLong,
                    "row_slots and row_positions must be int64");
  TORCH_CHECK_VALUE(variant == "" || variant == "avx512" || variant == "avx2",
                    "variant must be '', 'avx512' or 'avx2', got '", variant, "'");
  __builtin_cpu_init();
  const bool has_avx512 = __builtin_cpu_supports("avx512f");
  TORCH_CHECK(has_avx512 || (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")),
              "this CPU has neither AVX-512F nor AVX2 with FMA");
  TORCH_CHECK(variant != "avx512" || has_avx512, "this CPU has no AVX-512F");
  const bool wide = variant == "" ? has_avx512 : variant == "avx512";  // both give the same bits
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t max_len = k_cache.size(1), kv_heads = k_cache.size(2), group = heads / kv_heads;
  at::Tensor out = at::empty({rows, heads, dim}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = k_cache.data_ptr<float>(), *vp = v_cache.data_ptr<float>();
  const int64_t *slots = row_slots.data_ptr<int64_t>(), *positions = row_positions.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  // Blocks of up to BLOCK consecutive rows in one slot with increasing positions (a prefill piece's
  // rows; a decode row is a block of one), then every K/V head of each block is one work item.
  std::vector<int64_t> starts;
  for (int64_t t = 0; t < rows; ++t) {
    TORCH_CHECK_VALUE(positions[t] >= 0 && positions[t] < max_len, "a row's position is outside the cache");
    const bool joins = !starts.empty() && t - starts.back() < BLOCK && slots[t] == slots[t - 1] &&
                       positions[t] == positions[t - 1] + 1;
    if (!joins) starts.push_back(t);
  }
  starts.push_back(rows);
  const int64_t blocks = int64_t(starts.size()) - 1;
  if (blocks == 0) return out;
  // The longest blocks first, taken one at a time by whichever thread is free: causal blocks differ
  // in length, and a static split would leave one thread the long ones. Who computes a block, never how.
  std::vector<int64_t> order(blocks);
  std::iota(order.begin(), order.end(), 0);
  auto length_of = [&](int64_t b) { return positions[starts[b + 1] - 1] + 1; };
  auto vectors_of = [&](int64_t b) { return (starts[b + 1] - starts[b]) * group; };  // query vectors of a block
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return length_of(a) > length_of(b); });
  const int64_t longest = length_of(order[0]), items = blocks * kv_heads;
  const bool pairs = pairs_lanes();  // read once: the keys' packing and the tiles must agree
  const Packed packed(kp, vp, slots, starts, max_len, kv_heads, dim, length_of, vectors_of,
                      wide ? avx512::panel_group(1, dim, pairs) : avx2::panel_group(1, dim, pairs),
                      wide ? avx512::pack_rows : avx2::pack_rows);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(items, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    Scratch scratch(BLOCK * group, longest, dim);
    for (int64_t item = next++; item < items; item = next++) {
      const int64_t block = order[item / kv_heads], kvh = item % kv_heads, t0 = starts[block];
      const int64_t base = (slots[t0] * max_len * kv_heads + kvh) * dim;
      const bool in_pack = starts[block + 1] - t0 > 1;  // (a decode row reads the cache once: no copy)
      const int64_t pack = in_pack ? packed.of_slot[slots[t0]] : -1;
      const int64_t n = vectors_of(block);
      const float* values = in_pack ? packed.values(pack, kvh) : vp + base;
      const float* packed_keys = in_pack && packed_scores(n) ? packed.keys(pack, kvh) : nullptr;
      const Item it{qp, kp + base, packed_keys, in_pack ? packed.length[pack] : 0,
                    values, positions, t0, n, heads, kvh * group, group,
                    kv_heads * dim, dim, length_of(block), in_pack ? 16 : kv_heads * dim,
                    in_pack ? packed.length[pack] * 16 : 16, float(scale), op, pairs};
      if (wide) avx512::attend_item(it, scratch);
      else avx2::attend_item(it, scratch);
    }
  });
  return out;
}

void register_attention(pybind11::module& m) {
  m.def("attention_rows", &attention_rows, "causal attention per query row, in the fixed order of attention.cpp",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("row_slots"),
        pybind11::arg("row_positions"), pybind11::arg("scale"), pybind11::arg("variant") = "");
}
