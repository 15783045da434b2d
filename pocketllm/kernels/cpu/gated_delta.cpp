// The gated delta rule token by token (the recurrent form), fp32, in an order this file owns, for
// prefill pieces and decode steps alike: a position's output is then one function of the slot's
// state and the position's inputs, whichever call computes it (exact positions on the CPU).
//
// Per sequence and value head h (key head h / group), state S [Dk, Dv] (the slot's, in place), for
// each token in order:
//   q <- q * scale / sqrt(sum_i q_i^2 + 1e-6), k <- k / sqrt(sum_i k_i^2 + 1e-6)  (sums in increasing i)
//   S_i <- S_i * decay for every key row i; mem_v = sum_i S_iv * k_i            (in increasing i)
//   d_v = (v_v - mem_v) * beta; S_iv <- S_iv + k_i * d_v; out_v = sum_i S_iv * q_i (in increasing i)
// Every multiply and add is rounded on its own (no FMA: built with -ffp-contract=off, and no
// reassociation), and columns v are independent, so vectorising across them changes no bit: the
// AVX-512, AVX2 and baseline clones of `step` (chosen at load time by the CPU) agree bit for bit.
// Work items are (sequence, head) pairs: nothing depends on the batch, the thread count or where a
// prompt was cut.
#include <cmath>
#include <vector>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

namespace {

// x / sqrt(sum x^2 + 1e-6) * scale, the sum in increasing i.
void normalise(const float* x, int64_t n, float scale, float* out) {
  float squares = 0.0f;
  for (int64_t i = 0; i < n; ++i) squares += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(squares + 1e-6f);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv * scale;
}

struct Step {
  int64_t dk, dv;
  float* state;  // [dk, dv]
  const float *q, *k, *v;
  float decay, beta;
  float* out;  // [dv]
};

__attribute__((target_clones("avx512f", "avx2", "default")))
void step(const Step& s, std::vector<float>& qn, std::vector<float>& kn, std::vector<float>& acc) {
  normalise(s.q, s.dk, 1.0f / std::sqrt(float(s.dk)), qn.data());
  normalise(s.k, s.dk, 1.0f, kn.data());
  std::fill(acc.begin(), acc.end(), 0.0f);
  for (int64_t i = 0; i < s.dk; ++i) {
    float* row = s.state + i * s.dv;
    for (int64_t c = 0; c < s.dv; ++c) {
      row[c] = row[c] * s.decay;
      acc[c] = acc[c] + row[c] * kn[i];
    }
  }
  for (int64_t c = 0; c < s.dv; ++c) acc[c] = (s.v[c] - acc[c]) * s.beta;  // the delta
  std::fill(s.out, s.out + s.dv, 0.0f);
  for (int64_t i = 0; i < s.dk; ++i) {
    float* row = s.state + i * s.dv;
    for (int64_t c = 0; c < s.dv; ++c) {
      row[c] = row[c] + kn[i] * acc[c];
      s.out[c] = s.out[c] + row[c] * qn[i];
    }
  }
}

}  // namespace

// q, k [T, Hk, Dk], v [T, Hv, Dv], decay (exp g), beta [T, Hv], all fp32 contiguous; states fp32
// [slots, Hv, Dk, Dv] (advanced in place); slot_ids [B], cu_seqlens [B + 1] int64 -> out [T, Hv, Dv].
at::Tensor gated_delta_recurrent(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor decay, at::Tensor beta,
                                 at::Tensor states, at::Tensor slot_ids, at::Tensor cu_seqlens) {
  for (const at::Tensor* t : {&q, &k, &v, &decay, &beta, &states})
    TORCH_CHECK_VALUE(t->dtype() == at::kFloat && t->is_contiguous() && t->device().is_cpu(),
                      "the recurrent gated delta rule takes contiguous fp32 CPU tensors");
  TORCH_CHECK_VALUE(slot_ids.dtype() == at::kLong && cu_seqlens.dtype() == at::kLong,
                    "slot_ids and cu_seqlens must be int64");
  const int64_t hk = q.size(1), dk = q.size(2), hv = v.size(1), dv = v.size(2), group = hv / hk;
  const int64_t batch = slot_ids.size(0);
  at::Tensor out = at::empty({v.size(0), hv, dv}, v.options());
  const int64_t* slots = slot_ids.data_ptr<int64_t>();
  const int64_t* cu = cu_seqlens.data_ptr<int64_t>();
  float* sp = states.data_ptr<float>();
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *dp = decay.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, batch * hv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qn(dk), kn(dk), acc(dv);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / hv, h = item % hv, kh = h / group;
      float* state = sp + (slots[seq] * hv + h) * dk * dv;
      for (int64_t t = cu[seq]; t < cu[seq + 1]; ++t)
        step({dk, dv, state, qp + (t * hk + kh) * dk, kp + (t * hk + kh) * dk, vp + (t * hv + h) * dv,
              dp[t * hv + h], bp[t * hv + h], op + (t * hv + h) * dv}, qn, kn, acc);
    }
  });
  return out;
}

void register_gated_delta(pybind11::module& m) {
  m.def("gated_delta_recurrent", &gated_delta_recurrent,
        "the gated delta rule token by token, in the fixed order of gated_delta.cpp");
}
