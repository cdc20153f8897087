// The CPU library's ops as plain C++ calls, for ops built from others (cpu_layer.cpp): each source
// defines its part of this namespace by forwarding to its own (internal) op.
#pragma once

#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <optional>

namespace infermesh_cpu {
using torch::stable::Tensor;

Tensor paged_decode_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& block_tables,
                              const Tensor& context_lens, double scale, int64_t window = 0,
                              double softcap = 0.0);
Tensor add_rms_norm(const Tensor& x, const std::optional<Tensor>& residual, const Tensor& weight, double eps);
void rope_and_write_kv(const Tensor& qkv, const Tensor& positions, const Tensor& cos, const Tensor& sin,
                       const Tensor& k_cache, const Tensor& v_cache, const Tensor& slots, int64_t num_heads);
Tensor silu_and_mul(const Tensor& gate_up);
Tensor q4_linear(const Tensor& x, const Tensor& packed, int64_t out_features);
void gguf_linear(const Tensor& x, const Tensor& blocks, int64_t kind, const Tensor& out);
}  // namespace infermesh_cpu
