// The experts of a mixture-of-experts layer in one call (`kernels/moe.py`, `moe_fixed_order`): the
// (token, rank) pairs grouped by expert, each expert's rows through linear.cpp's fixed-order product
// (gate and up), rows.cpp's SiLU-and-multiply, and the product again (down). A product's order is a
// function of K alone, so a pair's bits are those of its row alone, whichever rows share its expert;
// the grouping only decides which rows go through one call, and no Python runs per expert. A down
// matrix given as S input-feature shards ([E, S, H, I/S]) is multiplied as linear.cpp's
// `linear_shards` multiplies them, read in place (`linear_shards_into`, no tensor made per shard): the
// shards' products summed in the fixed tree (parallel/tree.py).
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

void linear_into(const float* x, int64_t ldx, int64_t M, int64_t K, const at::Tensor& weight, float* y);  // linear.cpp
void linear_shards_into(const float* x, int64_t ldx, int64_t M, const at::Tensor& shards, float* y);  // linear.cpp
at::Tensor linear_bf16_dot(at::Tensor x, at::Tensor weight, c10::optional<at::Tensor> bias,
                           const std::string& variant);  // linear.cpp
at::Tensor linear_bf16_dot_shards(at::Tensor x, std::vector<at::Tensor> shards, const std::string& variant);
void silu_and_mul_into(const float* gate_up, int64_t rows, int64_t inter, int64_t stride, float* out);  // rows.cpp

// The product of `n` rows at `rows` (a contiguous [>= n, K] tensor) and `weight` [N, K] into y [n, N]:
// linear.cpp's fixed order, or with `dot` its bf16 dot products (rows rounded to bf16, as `linear_bf16_dot`).
static void product(const at::Tensor& rows, int64_t n, const at::Tensor& weight, bool dot, float* y) {
  if (!dot) {
    linear_into(rows.data_ptr<float>(), rows.size(1), n, rows.size(1), weight, y);
    return;
  }
  const at::Tensor out = linear_bf16_dot(rows.narrow(0, 0, n), weight, c10::nullopt, "");
  std::memcpy(y, out.data_ptr<float>(), size_t(out.numel()) * sizeof(float));
}

// x [T, H] fp32; topk_ids [T, K] int64; w_gate_up [E, 2I, H] (gate rows, then up), w_down [E, H, I]
// or [E, S, H, I/S] (S shards of I, such as the view w_down.view(E, H, S, I/S).transpose(1, 2)), both
// fp32 or both bf16 -> [T * K, H]: row t * K + k is expert topk_ids[t, k]'s output for token t. `dot` (bf16 experts): every product on bf16 dot products.
at::Tensor moe_experts(at::Tensor x, at::Tensor topk_ids, at::Tensor w_gate_up, at::Tensor w_down, bool dot) {
  TORCH_CHECK_VALUE(x.dtype() == at::kFloat && x.dim() == 2 && x.device().is_cpu(), "x must be fp32 [T, H] on the CPU");
  TORCH_CHECK_VALUE(topk_ids.dtype() == at::kLong && topk_ids.dim() == 2 && topk_ids.size(0) == x.size(0),
                    "topk_ids must be int64 [T, K]");
  const bool sharded = w_down.dim() == 4;
  TORCH_CHECK_VALUE(w_gate_up.dim() == 3 && (w_down.dim() == 3 || sharded) && w_gate_up.dtype() == w_down.dtype() &&
                        (w_gate_up.dtype() == at::kFloat || w_gate_up.dtype() == at::kBFloat16),
                    "w_gate_up [E, 2I, H] and w_down [E, H, I] or [E, S, H, I/S] must be both fp32 or both bf16");
  TORCH_CHECK_VALUE(!dot || w_gate_up.dtype() == at::kBFloat16, "bf16 dot products take bf16 experts");
  const int64_t tokens = x.size(0), top_k = topk_ids.size(1), hidden = x.size(1);
  const int64_t experts = w_gate_up.size(0), inter = w_gate_up.size(1) / 2, pairs = tokens * top_k;
  const int64_t shards = sharded ? w_down.size(1) : 1;
  TORCH_CHECK_VALUE(w_gate_up.size(1) == 2 * inter && w_gate_up.size(2) == hidden && w_down.size(0) == experts &&
                        w_down.size(-2) == hidden && w_down.size(-1) * shards == inter,
                    "w_gate_up must be [E, 2I, H] and w_down [E, H, I] or [E, S, H, I/S] for x [T, H]");
  x = x.contiguous();
  topk_ids = topk_ids.contiguous();
  w_gate_up = w_gate_up.contiguous();
  // A sharded down matrix is read in place where its shards are column slices of each expert's matrix.
  if (!sharded || w_down.stride(-1) != 1) w_down = w_down.contiguous();
  const int64_t* ids = topk_ids.data_ptr<int64_t>();
  // The pairs by expert, in pair order within one (a counting sort).
  std::vector<int64_t> start(experts + 1, 0), order(pairs);
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK_VALUE(ids[p] >= 0 && ids[p] < experts, "topk_ids holds ", ids[p], ", outside [0, ", experts, ")");
    ++start[ids[p] + 1];
  }
  int64_t most = 0;
  for (int64_t e = 0; e < experts; ++e) {
    most = std::max(most, start[e + 1]);
    start[e + 1] += start[e];
  }
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  for (int64_t p = 0; p < pairs; ++p) order[next[ids[p]]++] = p;
  at::Tensor y = at::empty({pairs, hidden}, x.options());
  at::Tensor rows = at::empty({most, hidden}, x.options()), gate_up = at::empty({most, 2 * inter}, x.options());
  at::Tensor hidden_rows = at::empty({most, inter}, x.options()), down = at::empty({most, hidden}, x.options());
  const float* xp = x.data_ptr<float>();
  float *yp = y.data_ptr<float>(), *rp = rows.data_ptr<float>(), *gp = gate_up.data_ptr<float>();
  float *hp = hidden_rows.data_ptr<float>(), *dp = down.data_ptr<float>();
  const size_t row_bytes = size_t(hidden) * sizeof(float);
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t n = start[e + 1] - start[e];
    if (n == 0) continue;
    const int64_t* chosen = order.data() + start[e];
    for (int64_t r = 0; r < n; ++r) std::memcpy(rp + r * hidden, xp + chosen[r] / top_k * hidden, row_bytes);
    product(rows, n, w_gate_up[e], dot, gp);
    silu_and_mul_into(gp, n, inter, 2 * inter, hp);
    if (sharded && !dot) {
      linear_shards_into(hp, inter, n, w_down[e], dp);
    } else if (sharded) {
      const at::Tensor summed = linear_bf16_dot_shards(hidden_rows.narrow(0, 0, n), w_down[e].unbind(0), "");
      std::memcpy(dp, summed.data_ptr<float>(), size_t(n) * row_bytes);
    } else {
      product(hidden_rows, n, w_down[e], dot, dp);
    }
    for (int64_t r = 0; r < n; ++r) std::memcpy(yp + chosen[r] * hidden, dp + r * hidden, row_bytes);
  }
  return y;
}

void register_moe(pybind11::module& m) {
  m.def("moe_experts", &moe_experts, "every (token, rank) pair's expert output, each product in linear.cpp's order",
        pybind11::arg("x"), pybind11::arg("topk_ids"), pybind11::arg("w_gate_up"), pybind11::arg("w_down"),
        pybind11::arg("dot") = false);
}
