// One decoder layer of a pure-decode step in one call, for small batches with the q4 weights
// (services/engine/runtime/models/llama.py takes it when the plan allows): the same ops the Python forward
// calls one by one (add + RMSNorm, the q4 GEMMs, RoPE + KV write, paged decode attention, SiLU x up),
// called from C++, so a step pays one dispatch per layer instead of nine.  Same math, same order:
// the result equals the op-by-op forward's bit for bit.

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <optional>

#include "cpu_api.h"

namespace {

using torch::stable::Tensor;

// x (T, H) += update (in place); returns the layer's update for the next layer's norm to add.
Tensor decode_layer_q4(const Tensor& x, const std::optional<Tensor>& update, const Tensor& input_norm,
                       const Tensor& qkv_w, const Tensor& o_w, const Tensor& post_norm, const Tensor& gate_up_w,
                       const Tensor& down_w, double eps, const Tensor& positions, const Tensor& cos,
                       const Tensor& sin, const Tensor& k_cache, const Tensor& v_cache, const Tensor& slots,
                       const Tensor& tables, const Tensor& lens, double scale, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, int64_t intermediate) {
  namespace ic = infermesh_cpu;
  const int64_t t = x.size(0), hidden = x.size(1), heads = num_heads + 2 * num_kv_heads;
  Tensor h = ic::add_rms_norm(x, update, input_norm, eps);
  Tensor qkv = torch::stable::view(ic::q4_linear(h, qkv_w, heads * head_dim), {t, heads, head_dim});
  ic::rope_and_write_kv(qkv, positions, cos, sin, k_cache, v_cache, slots, num_heads);
  Tensor attn = ic::paged_decode_attention(torch::stable::narrow(qkv, 1, 0, num_heads), k_cache, v_cache, tables,
                                           lens, scale);
  Tensor o = ic::q4_linear(torch::stable::reshape(attn, {t, num_heads * head_dim}), o_w, hidden);
  Tensor h2 = ic::add_rms_norm(x, o, post_norm, eps);
  return ic::q4_linear(ic::silu_and_mul(ic::q4_linear(h2, gate_up_w, 2 * intermediate)), down_w, hidden);
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(infermesh, m) {
  m.def("decode_layer_q4(Tensor(a!) x, Tensor? update, Tensor input_norm, Tensor qkv_w, Tensor o_w, "
        "Tensor post_norm, Tensor gate_up_w, Tensor down_w, float eps, Tensor positions, Tensor cos, Tensor sin, "
        "Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slots, Tensor tables, Tensor lens, float scale, "
        "int num_heads, int num_kv_heads, int head_dim, int intermediate) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(infermesh, CPU, m) {
  m.impl("decode_layer_q4", TORCH_BOX(&decode_layer_q4));
}
