// The row-wise ops of a decode step besides the products, fp32, one call each where torch would
// dispatch five to ten small ops per row: RMSNorm (gated too), SiLU-and-multiply, RoPE with the K/V
// write, and the Gated DeltaNet layers' causal conv1d of a decode step.
//
// Every element is computed from its own row by one fixed sequence of roundings, so a row's bits
// do not depend on the batch, the thread count (threads split rows, never a row) or the CPU:
//   rms_norm:     s = sum of x[i]^2 in linear.cpp's order (16 lanes over i, one fused multiply-add
//                 per element in increasing i, the tail zero-padded, the same fixed tree), then
//                 inv = 1 / sqrt(s / H + eps), out[i] = w[i] * (x[i] * inv);
//                 gated: out[i] = that * silu(z[i]);
//   silu_and_mul: out[i] = silu(g) * up[i], silu(g) = g / (1 + exp(-g)), torch's scalar SiLU (libm's expf);
//   conv1d decode: acc = v[0] * w[0], then acc = acc + v[j] * w[j] for j = 1 .. K - 1 over the window
//                 (the slot's K - 1 last inputs, then the new one), out = silu(acc): the prefill's
//                 arithmetic, so a decoded position has a prefilled one's bits;
//   rope:         out[j] = x[j] * c[j] - x[j + R/2] * s[j], out[j + R/2] = x[j + R/2] * c[j + R/2]
//                 + x[j] * s[j + R/2] for j < R/2 (R the rotary width), the rest copied: the
//                 reference's products and sums, each rounded on its own.
// Built with -ffp-contract=off: the only fused multiply-adds are the explicit ones. Loops vectorise
// across independent lanes or elements only, so the AVX-512, AVX2 and baseline clones agree bit for bit.
#include <cmath>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

namespace {

__attribute__((target_clones("avx512f", "avx2", "default")))
float sum_of_squares(const float* x, int64_t n) {
  float lanes[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) lanes[j] = std::fma(x[i + j], x[i + j], lanes[j]);
  for (int j = 0; i + j < n; ++j) lanes[j] = std::fma(x[i + j], x[i + j], lanes[j]);
  for (int half = 8; half >= 1; half /= 2)
    for (int j = 0; j < half; ++j) lanes[j] = lanes[j] + lanes[j + half];
  return lanes[0];
}

__attribute__((target_clones("avx512f", "avx2", "default")))
void scale_row(const float* x, const float* w, float inv, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * inv);
}

void check_fp32(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.dtype() == at::kFloat && t.device().is_cpu(), name, " must be an fp32 CPU tensor");
  TORCH_CHECK_VALUE(t.stride(-1) == 1, name, "'s last dimension must be contiguous");
}

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

// Enough elements per work item that a thread's share outweighs waking it; which thread computes a
// row never changes how.
constexpr int64_t GRAIN = 16384;

}  // namespace

// x [T, H] or [T, heads, H] (rows contiguous along H, any stride between them), weight [H] -> out,
// contiguous; with `gate` (x's shape, the same row layout rules), out * silu(gate).
at::Tensor rms_norm_rows(at::Tensor x, at::Tensor weight, double eps, c10::optional<at::Tensor> gate) {
  check_fp32(x, "x");
  check_fp32(weight, "weight");
  TORCH_CHECK_VALUE(x.dim() == 2 || x.dim() == 3, "x must be [T, H] or [T, heads, H]");
  const int64_t h = x.size(-1), inner = x.dim() == 3 ? x.size(1) : 1, rows = x.size(0) * inner;
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == h, "weight must be [", h, "]");
  TORCH_CHECK_VALUE(x.dim() == 2 || x.stride(1) >= h, "rows of x must not overlap");
  const float* gp = nullptr;
  int64_t gate_outer = 0, gate_inner = 0;
  if (gate.has_value()) {
    check_fp32(*gate, "gate");
    TORCH_CHECK_VALUE(gate->sizes() == x.sizes(), "gate must have x's shape");
    gp = gate->data_ptr<float>();
    gate_outer = gate->stride(0);
    gate_inner = x.dim() == 3 ? gate->stride(1) : 0;
  }
  const int64_t outer_stride = x.stride(0), inner_stride = x.dim() == 3 ? x.stride(1) : 0;
  at::Tensor out = at::empty(x.sizes(), x.options());
  const float *xp = x.data_ptr<float>(), *wp = weight.contiguous().data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = float(eps);
  at::parallel_for(0, rows, std::max<int64_t>(1, GRAIN / std::max<int64_t>(h, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + (r / inner) * outer_stride + (r % inner) * inner_stride;
      const float inv = 1.0f / std::sqrt(sum_of_squares(row, h) / float(h) + e);
      float* o = op + r * h;
      scale_row(row, wp, inv, h, o);
      if (gp != nullptr) {
        const float* g = gp + (r / inner) * gate_outer + (r % inner) * gate_inner;
        for (int64_t i = 0; i < h; ++i) o[i] = o[i] * silu(g[i]);
      }
    }
  });
  return out;
}

// out [rows, inter] (contiguous) = silu(gate) * up of gate_up's rows (`stride` apart: gate, then up).
void silu_and_mul_into(const float* gate_up, int64_t rows, int64_t inter, int64_t stride, float* out) {
  at::parallel_for(0, rows * inter, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t e = begin; e < end; ++e) {
      const int64_t r = e / inter, i = e % inter;
      out[e] = silu(gate_up[r * stride + i]) * gate_up[r * stride + inter + i];
    }
  });
}

// gate_up [T, 2I] (gate, then up; rows contiguous) -> [T, I].
at::Tensor silu_and_mul_rows(at::Tensor gate_up) {
  check_fp32(gate_up, "gate_up");
  TORCH_CHECK_VALUE(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [T, 2I]");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, gate_up.options());
  silu_and_mul_into(gate_up.data_ptr<float>(), rows, inter, gate_up.stride(0), out.data_ptr<float>());
  return out;
}

namespace {

// One token's [heads, D] rotated by its cos/sin row (width R <= D) into out [heads, D].
void rotate(const float* x, int64_t head_stride, int64_t heads, int64_t d, const float* c, const float* s,
            int64_t rotary, float* out, int64_t out_head_stride) {
  const int64_t half = rotary / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const float* xh = x + h * head_stride;
    float* oh = out + h * out_head_stride;
    for (int64_t j = 0; j < half; ++j) {
      oh[j] = xh[j] * c[j] - xh[j + half] * s[j];
      oh[j + half] = xh[j + half] * c[j + half] + xh[j] * s[j + half];
    }
    for (int64_t j = rotary; j < d; ++j) oh[j] = xh[j];
  }
}

}  // namespace

// q [T, Hq, D], k and v [T, Hkv, D] (heads contiguous within a token, any stride between tokens);
// positions, token_slots [T] int64; cos/sin [L, R] fp32; k_cache/v_cache [slots, L, Hkv, D] contiguous.
// Writes rotated k and v at (slot, position); returns rotated q, contiguous.
at::Tensor rope_write_kv_rows(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor positions, at::Tensor cos,
                              at::Tensor sin, at::Tensor k_cache, at::Tensor v_cache, at::Tensor token_slots) {
  for (const auto& [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}, {&cos, "cos"}, {&sin, "sin"},
                                {&k_cache, "k_cache"}, {&v_cache, "v_cache"}}) {
    check_fp32(*t, name);
    if (t->dim() == 3) TORCH_CHECK_VALUE(t->stride(1) == t->size(2), name, "'s heads must be contiguous");
  }
  TORCH_CHECK_VALUE(k_cache.is_contiguous() && v_cache.is_contiguous() && cos.is_contiguous() && sin.is_contiguous(),
                    "k_cache, v_cache, cos and sin must be contiguous");
  TORCH_CHECK_VALUE(positions.dtype() == at::kLong && token_slots.dtype() == at::kLong,
                    "positions and token_slots must be int64");
  const int64_t tokens = q.size(0), hq = q.size(1), hkv = k.size(1), d = q.size(2), rotary = cos.size(1);
  const int64_t slots = k_cache.size(0), seq = k_cache.size(1);
  TORCH_CHECK_VALUE(rotary <= d && rotary % 2 == 0 && cos.sizes() == sin.sizes(), "cos and sin must be [L, R], R even, R <= D");
  TORCH_CHECK_VALUE(k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == hkv && k_cache.size(3) == d,
                    "k_cache and v_cache must be [slots, L, Hkv, D]");
  TORCH_CHECK_VALUE(positions.numel() == tokens && token_slots.numel() == tokens, "one position and slot per token");
  at::Tensor out = at::empty({tokens, hq, d}, q.options());
  const int64_t *pos = positions.contiguous().data_ptr<int64_t>(), *slot = token_slots.contiguous().data_ptr<int64_t>();
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float *op = out.data_ptr<float>(), *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK_INDEX(pos[t] >= 0 && pos[t] < std::min(seq, cos.size(0)) && slot[t] >= 0 && slot[t] < slots,
                      "token ", t, ": position ", pos[t], " or slot ", slot[t], " outside the cache");
  at::parallel_for(0, tokens, std::max<int64_t>(1, GRAIN / ((hq + 2 * hkv) * d)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float *c = cp + pos[t] * rotary, *s = sp + pos[t] * rotary;
      rotate(qp + t * q.stride(0), d, hq, d, c, s, rotary, op + t * hq * d, d);
      const int64_t at = (slot[t] * seq + pos[t]) * hkv * d;
      rotate(kp + t * k.stride(0), d, hkv, d, c, s, rotary, kc + at, d);
      const float* vt = vp + t * v.stride(0);
      std::copy(vt, vt + hkv * d, vc + at);
    }
  });
  return out;
}

// x [B, C] (channels contiguous, any stride between rows), weight [C, K], conv_states [slots, C, K - 1]
// (shifted by one in place), slot_ids [B] int64 -> [B, C], contiguous.
at::Tensor conv1d_decode_rows(at::Tensor x, at::Tensor weight, at::Tensor conv_states, at::Tensor slot_ids) {
  check_fp32(x, "x");
  check_fp32(weight, "weight");
  check_fp32(conv_states, "conv_states");
  TORCH_CHECK_VALUE(weight.is_contiguous() && conv_states.is_contiguous(), "weight and conv_states must be contiguous");
  TORCH_CHECK_VALUE(slot_ids.dtype() == at::kLong && slot_ids.numel() == x.size(0), "one int64 slot id per row");
  const int64_t rows = x.size(0), channels = x.size(1), taps = weight.size(1), slots = conv_states.size(0);
  TORCH_CHECK_VALUE(weight.size(0) == channels && conv_states.size(1) == channels && conv_states.size(2) == taps - 1
                    && taps >= 2, "x [B, C], weight [C, K] and conv_states [slots, C, K - 1] must agree");
  const int64_t* slot = slot_ids.contiguous().data_ptr<int64_t>();
  for (int64_t b = 0; b < rows; ++b)
    TORCH_CHECK_INDEX(slot[b] >= 0 && slot[b] < slots, "row ", b, ": slot ", slot[b], " outside the conv states");
  at::Tensor out = at::empty({rows, channels}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float *sp = conv_states.data_ptr<float>(), *op = out.data_ptr<float>();
  at::parallel_for(0, rows * channels, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t e = begin; e < end; ++e) {
      const int64_t b = e / channels, c = e % channels;
      float* state = sp + (slot[b] * channels + c) * (taps - 1);
      const float* w = wp + c * taps;
      const float newest = xp[b * x.stride(0) + c];
      float acc = state[0] * w[0];
      for (int64_t j = 1; j < taps - 1; ++j) acc = acc + state[j] * w[j];
      acc = acc + newest * w[taps - 1];
      op[e] = silu(acc);
      for (int64_t j = 0; j + 1 < taps - 1; ++j) state[j] = state[j + 1];
      state[taps - 2] = newest;
    }
  });
  return out;
}

void register_rows(pybind11::module& m) {
  m.def("rms_norm_rows", &rms_norm_rows, "RMSNorm over the last dimension (times silu(gate)), in the order of rows.cpp",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("eps"), pybind11::arg("gate") = pybind11::none());
  m.def("silu_and_mul_rows", &silu_and_mul_rows, "silu(gate) * up, torch's scalar SiLU");
  m.def("rope_write_kv_rows", &rope_write_kv_rows, "RoPE on q and k, k and v written into the slot cache");
  m.def("conv1d_decode_rows", &conv1d_decode_rows, "the causal conv1d (+ SiLU) of one new input per slot");
}
