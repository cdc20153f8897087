// One decoder layer of a pure-decode step in one call, for small batches with a GGUF's own blocks
// (services/engine/runtime/models/llama.py takes it when the plan's small kind is `gguf`): decode_layer_q4's
// ops (cpu_layer.cpp) with gguf_linear products.  A GGUF may store q, k and v (or gate and up) in
// different types, so each of those is up to three (two) products, one per type, placed side by side as
// models/linear.py's Concat places them, with q/k/v's biases added after.  Same math, same order as the
// op-by-op forward: the result equals it bit for bit.

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "cpu_api.h"

namespace {

using torch::stable::Tensor;

struct Part {
  const Tensor* blocks;
  int64_t kind;
};

// h (T, K) times the parts' blocks, outputs side by side (T, sum of their rows), plus `bias` if given.
Tensor products(const Tensor& h, const std::vector<Part>& parts, const std::optional<Tensor>& bias) {
  const int64_t t = h.size(0);
  int64_t total = 0;
  for (const Part& p : parts) total += p.blocks->size(0);
  Tensor out = torch::stable::new_empty(h, {t, total});
  if (parts.size() == 1) {
    infermesh_cpu::gguf_linear(h, *parts[0].blocks, parts[0].kind, out);
  } else {
    float* dst = out.mutable_data_ptr<float>();
    int64_t at = 0;
    for (const Part& p : parts) {
      const int64_t n = p.blocks->size(0);
      Tensor part = torch::stable::new_empty(h, {t, n});
      infermesh_cpu::gguf_linear(h, *p.blocks, p.kind, part);
      const float* src = part.const_data_ptr<float>();
      for (int64_t r = 0; r < t; ++r) std::memcpy(dst + r * total + at, src + r * n, sizeof(float) * n);
      at += n;
    }
  }
  if (bias.has_value()) {
    const float* b = bias->const_data_ptr<float>();
    float* o = out.mutable_data_ptr<float>();
    for (int64_t r = 0; r < t; ++r)
      for (int64_t j = 0; j < total; ++j) o[r * total + j] += b[j];
  }
  return out;
}

std::vector<Part> parts_of(const Tensor& first, int64_t first_kind, const std::optional<Tensor>& second,
                           int64_t second_kind, const std::optional<Tensor>& third = std::nullopt,
                           int64_t third_kind = 0) {
  std::vector<Part> out{{&first, first_kind}};
  if (second.has_value()) out.push_back({&*second, second_kind});
  if (third.has_value()) out.push_back({&*third, third_kind});
  return out;
}

// x (T, H) += update (in place); returns the layer's update for the next layer's norm to add.
Tensor decode_layer_gguf(const Tensor& x, const std::optional<Tensor>& update, const Tensor& input_norm,
                         const Tensor& qkv_a, int64_t qkv_a_kind, const std::optional<Tensor>& qkv_b,
                         int64_t qkv_b_kind, const std::optional<Tensor>& qkv_c, int64_t qkv_c_kind,
                         const std::optional<Tensor>& qkv_bias, const Tensor& o_w, int64_t o_kind,
                         const Tensor& post_norm, const Tensor& gate_up_a, int64_t gate_up_a_kind,
                         const std::optional<Tensor>& gate_up_b, int64_t gate_up_b_kind, const Tensor& down_w,
                         int64_t down_kind, double eps, const Tensor& positions, const Tensor& cos,
                         const Tensor& sin, const Tensor& k_cache, const Tensor& v_cache, const Tensor& slots,
                         const Tensor& tables, const Tensor& lens, double scale, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, int64_t intermediate) {
  namespace ic = infermesh_cpu;
  (void)intermediate;      // decode_layer_q4's argument list, so one call site serves both
  const int64_t t = x.size(0), heads = num_heads + 2 * num_kv_heads;
  Tensor h = ic::add_rms_norm(x, update, input_norm, eps);
  Tensor qkv = torch::stable::view(
      products(h, parts_of(qkv_a, qkv_a_kind, qkv_b, qkv_b_kind, qkv_c, qkv_c_kind), qkv_bias), {t, heads, head_dim});
  ic::rope_and_write_kv(qkv, positions, cos, sin, k_cache, v_cache, slots, num_heads);
  Tensor attn = ic::paged_decode_attention(torch::stable::narrow(qkv, 1, 0, num_heads), k_cache, v_cache, tables,
                                           lens, scale);
  Tensor o = products(torch::stable::reshape(attn, {t, num_heads * head_dim}), {{&o_w, o_kind}}, std::nullopt);
  Tensor h2 = ic::add_rms_norm(x, o, post_norm, eps);
  Tensor gate_up = products(h2, parts_of(gate_up_a, gate_up_a_kind, gate_up_b, gate_up_b_kind), std::nullopt);
  return products(ic::silu_and_mul(gate_up), {{&down_w, down_kind}}, std::nullopt);
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(infermesh, m) {
  m.def("decode_layer_gguf(Tensor(a!) x, Tensor? update, Tensor input_norm, Tensor qkv_a, int qkv_a_kind, "
        "Tensor? qkv_b, int qkv_b_kind, Tensor? qkv_c, int qkv_c_kind, Tensor? qkv_bias, Tensor o_w, int o_kind, "
        "Tensor post_norm, Tensor gate_up_a, int gate_up_a_kind, Tensor? gate_up_b, int gate_up_b_kind, "
        "Tensor down_w, int down_kind, float eps, Tensor positions, Tensor cos, Tensor sin, Tensor(b!) k_cache, "
        "Tensor(c!) v_cache, Tensor slots, Tensor tables, Tensor lens, float scale, int num_heads, "
        "int num_kv_heads, int head_dim, int intermediate) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(infermesh, CPU, m) {
  m.impl("decode_layer_gguf", TORCH_BOX(&decode_layer_gguf));
}
