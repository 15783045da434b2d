// Causal attention of query rows over their slot's keys, fp32, in an order this file owns, for
// prefill pieces and decode rows alike: a position's output is one function of its query and the
// keys 0 .. its position, whichever call computes it (exact positions on the CPU).
//
// Per query row at absolute position p and head h (K/V head h / group):
//   s_j = dot(q, k_j) * scale for j = 0 .. p, the dot in 16 lanes over the head dim (lane l takes
//       d = l, l + 16, ..., in increasing d, the tail zero-padded) summed in the tree of linear.cpp;
//   m = max_j s_j;  e_j = exp(s_j - m);  z = sum_j e_j (in increasing j);
//   out_d = (sum_j e_j * v_jd) / z, the sum in increasing j for every d.
// Every multiply and add is rounded on its own (-ffp-contract=off, no reassociation); the clones
// for AVX-512, AVX2 and the baseline vectorise across lanes and across d only, so they agree bit for
// bit. Work items are blocks of rows and a K/V head; a row's arithmetic does not depend on its block,
// so nothing depends on the batch, the piece or the threads.
#include <cmath>
#include <vector>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

namespace {

inline float dot16(const float* a, const float* b, int64_t n) {
  float lanes[16] = {0.0f};
  int64_t d = 0;
  for (; d + 16 <= n; d += 16)
    for (int l = 0; l < 16; ++l) lanes[l] = lanes[l] + a[d + l] * b[d + l];
  if (d < n)
    for (int l = 0; l < 16; ++l) lanes[l] = lanes[l] + (d + l < n ? a[d + l] * b[d + l] : 0.0f);
  for (int l = 0; l < 8; ++l) lanes[l] = lanes[l] + lanes[l + 8];
  for (int l = 0; l < 4; ++l) lanes[l] = lanes[l] + lanes[l + 4];
  for (int l = 0; l < 2; ++l) lanes[l] = lanes[l] + lanes[l + 2];
  return lanes[0] + lanes[1];
}

// Up to BLOCK consecutive query rows of one slot and the query heads of one K/V head: each key and
// value row is read once for all of them. It changes which loop runs first, not any row's arithmetic.
constexpr int64_t BLOCK = 8;

struct Block {
  const float* q;       // row t, head h at q + (t * heads + h) * dim
  const float* keys;    // key j at keys + j * stride
  const float* values;
  const int64_t* positions;  // of rows t0 .. t0 + rows - 1
  int64_t t0, rows, heads, h0, group, stride, dim;
  float scale;
  float* out;
};

__attribute__((target_clones("avx512f", "avx2", "default")))
void attend(const Block& b, std::vector<float>& scores, std::vector<float>& top, std::vector<float>& total) {
  const int64_t n = b.rows * b.group, length = b.positions[b.t0 + b.rows - 1] + 1, width = length;
  auto query = [&](int64_t i) { return b.q + ((b.t0 + i / b.group) * b.heads + b.h0 + i % b.group) * b.dim; };
  auto last = [&](int64_t i) { return b.positions[b.t0 + i / b.group]; };  // keys 0 .. last(i)
  for (int64_t i = 0; i < n; ++i) top[i] = -INFINITY;
  for (int64_t j = 0; j < length; ++j) {
    const float* k = b.keys + j * b.stride;
    for (int64_t i = 0; i < n; ++i) {
      if (j > last(i)) continue;
      const float s = dot16(query(i), k, b.dim) * b.scale;
      scores[i * width + j] = s;
      top[i] = std::max(top[i], s);
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    total[i] = 0.0f;
    for (int64_t j = 0; j <= last(i); ++j) {
      scores[i * width + j] = std::exp(scores[i * width + j] - top[i]);
      total[i] = total[i] + scores[i * width + j];
    }
    float* out = b.out + (query(i) - b.q);
    std::fill(out, out + b.dim, 0.0f);
  }
  for (int64_t j = 0; j < length; ++j) {
    const float* v = b.values + j * b.stride;
    for (int64_t i = 0; i < n; ++i) {
      if (j > last(i)) continue;
      float* out = b.out + (query(i) - b.q);
      const float e = scores[i * width + j];
      for (int64_t d = 0; d < b.dim; ++d) out[d] = out[d] + e * v[d];
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    float* out = b.out + (query(i) - b.q);
    for (int64_t d = 0; d < b.dim; ++d) out[d] = out[d] / total[i];
  }
}

}  // namespace

// q [T, H, D] fp32 contiguous; k_cache, v_cache [slots, max_len, KV, D] fp32 contiguous;
// row_slots, row_positions [T] int64 (each row's slot and absolute position) -> out [T, H, D].
at::Tensor attention_rows(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor row_slots,
                          at::Tensor row_positions, double scale) {
  for (const at::Tensor* t : {&q, &k_cache, &v_cache})
    TORCH_CHECK_VALUE(t->dtype() == at::kFloat && t->is_contiguous() && t->device().is_cpu(),
                      "attention_rows takes contiguous fp32 CPU tensors");
  TORCH_CHECK_VALUE(row_slots.dtype() == at::kLong && row_positions.dtype() == at::kLong,
                    "row_slots and row_positions must be int64");
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
  at::parallel_for(0, blocks * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(BLOCK * group * max_len), top(BLOCK * group), total(BLOCK * group);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t block = item / kv_heads, kvh = item % kv_heads, t0 = starts[block];
      const int64_t base = (slots[t0] * max_len * kv_heads + kvh) * dim;
      attend({qp, kp + base, vp + base, positions, t0, starts[block + 1] - t0, heads, kvh * group, group,
              kv_heads * dim, dim, float(scale), op}, scores, top, total);
    }
  });
  return out;
}

void register_attention(pybind11::module& m) {
  m.def("attention_rows", &attention_rows, "causal attention per query row, in the fixed order of attention.cpp");
}
