// Weight-only quantized linears for the CPU: y = x W^T with W stored in 32-weight blocks, x and y
// float32; built with cpu_ops.cpp into one library by meshkernels/cpu_ops.py.
//
// A decode step of a small model reads every weight once per step, so at 1-16 rows its GEMMs are
// bound by memory, not arithmetic: fewer bytes per weight is the lever.  Each block is dequantized
// into registers once and multiplied into every row of x (up to kRows at a time), so a weight is
// read from memory once per step whatever the batch.
//
// Block layouts (the packing is meshkernels/quant.py, the torch references beside it):
//   q4: 20 bytes = fp16 d, fp16 m, 16 bytes of nibbles; weight j (0..15) is d * (byte[j] & 15) + m,
//       weight j + 16 is d * (byte[j] >> 4) + m.
//   q8: 34 bytes = fp16 d, 32 int8; weight j is d * q[j].
// d * q is exact in float32 (an 11-bit by 4- or 8-bit product), so one fused multiply-add gives the
// same weight as dequantizing in float32 would: a model whose weights came from such blocks (a
// GGUF's Q4_1 / Q8_0 tensors) is multiplied by exactly its own weights; sums run in another order
// than MKL's, so results agree with the float32 GEMM to rounding.
//
// AVX-512 and AVX2 paths are compiled where the CPU has them (meshkernels/cpu_ops.py picks the flags);
// the scalar loops are the portable path.

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_api.h"

namespace {

#include "cpu_common.h"

constexpr int64_t kBlock = 32;
constexpr int64_t kQ4Bytes = 20;
constexpr int64_t kQ8Bytes = 34;
constexpr int kRows = 4;          // rows of x multiplied by one dequantized block at a time

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return half_bits_to_float(h);
}

// The block's 32 weights as floats (the scalar path, and the tails of nothing: K is a multiple of 32).
inline void q4_weights(const uint8_t* blk, float* w) {
  const float d = half_to_float(blk), m = half_to_float(blk + 2);
  for (int j = 0; j < 16; ++j) {
    w[j] = d * static_cast<float>(blk[4 + j] & 15) + m;
    w[j + 16] = d * static_cast<float>(blk[4 + j] >> 4) + m;
  }
}

inline void q8_weights(const uint8_t* blk, float* w) {
  const float d = half_to_float(blk);
  for (int j = 0; j < 32; ++j) w[j] = d * static_cast<float>(static_cast<int8_t>(blk[2 + j]));
}

// out[r * ldo] = x[r] . W[n] for R rows of x, W[n] being nb blocks at w.
template <int R, bool Q4>
inline void dot_rows(const float* x, int64_t ldx, const uint8_t* w, int64_t nb, float* out, int64_t ldo) {
  const int64_t bytes = Q4 ? kQ4Bytes : kQ8Bytes;
#if defined(__AVX512F__)
  __m512 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b, w += bytes) {
    const __m512 d = _mm512_set1_ps(half_to_float(w));
    __m512 w0, w1;
    if constexpr (Q4) {
      const __m512 m = _mm512_set1_ps(half_to_float(w + 2));
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 4));
      w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, low))), d, m);
      w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), low))), d, m);
    } else {
      w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
               reinterpret_cast<const __m128i*>(w + 2)))), d);
      w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
               reinterpret_cast<const __m128i*>(w + 18)))), d);
    }
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * ldx + b * kBlock;
      acc0[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xr), w0, acc0[r]);
      acc1[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xr + 16), w1, acc1[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r * ldo] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[r], acc1[r]));
#elif defined(__AVX2__)
  __m256 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b, w += bytes) {
    const __m256 d = _mm256_set1_ps(half_to_float(w));
    __m256 ws[4];
    if constexpr (Q4) {
      const __m256 m = _mm256_set1_ps(half_to_float(w + 2));
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 4));
      const __m128i lo = _mm_and_si128(q, low), hi = _mm_and_si128(_mm_srli_epi16(q, 4), low);
      ws[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), d, m);
      ws[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), d, m);
      ws[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), d, m);
      ws[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), d, m);
    } else {
      for (int k = 0; k < 4; ++k) {
        const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + 2 + 8 * k));
        ws[k] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
      }
    }
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * ldx + b * kBlock;
      acc0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr), ws[0], acc0[r]);
      acc1[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), ws[1], acc1[r]);
      acc0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), ws[2], acc0[r]);
      acc1[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), ws[3], acc1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m256 s = _mm256_add_ps(acc0[r], acc1[r]);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    out[r * ldo] = _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
  }
#else
  float acc[R] = {};
  float wf[kBlock];
  for (int64_t b = 0; b < nb; ++b, w += bytes) {
    if constexpr (Q4) q4_weights(w, wf); else q8_weights(w, wf);
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * ldx + b * kBlock;
      for (int j = 0; j < kBlock; ++j) acc[r] += xr[j] * wf[j];
    }
  }
  for (int r = 0; r < R; ++r) out[r * ldo] = acc[r];
#endif
}

#if defined(__AVX512F__)
// Batches above kRows: each group of 4 output features is dequantized once into `buf` (block by block,
// 4 x 32 floats per block, L1-resident), then every 4-row tile of x multiplies it with 16 accumulators
// in registers: 32 FMAs per 16 loads, so the product runs at the FMA units' rate.
template <bool Q4>
inline void dequantize_block(const uint8_t* w, float* out) {
  const __m512 d = _mm512_set1_ps(half_to_float(w));
  if constexpr (Q4) {
    const __m128i low = _mm_set1_epi8(0x0F);
    const __m512 m = _mm512_set1_ps(half_to_float(w + 2));
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 4));
    _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, low))), d, m));
    _mm512_storeu_ps(out + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
        _mm_and_si128(_mm_srli_epi16(q, 4), low))), d, m));
  } else {
    for (int h = 0; h < 2; ++h)
      _mm512_storeu_ps(out + 16 * h, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(w + 2 + 16 * h)))), d));
  }
}

// out[r * ldo + c] = x[r] . buf's column c, for R rows and C columns; buf holds nb blocks of C x 32.
template <int R, int C>
inline void tile(const float* x, int64_t ldx, const float* buf, int64_t nb, float* out, int64_t ldo) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const float* wb = buf + b * 4 * kBlock;
    __m512 w0[C], w1[C];
    for (int c = 0; c < C; ++c) {
      w0[c] = _mm512_loadu_ps(wb + c * kBlock);
      w1[c] = _mm512_loadu_ps(wb + c * kBlock + 16);
    }
    for (int r = 0; r < R; ++r) {
      const __m512 x0 = _mm512_loadu_ps(x + r * ldx + b * kBlock), x1 = _mm512_loadu_ps(x + r * ldx + b * kBlock + 16);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(x1, w1[c], _mm512_fmadd_ps(x0, w0[c], acc[r][c]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * ldo + c] = _mm512_reduce_add_ps(acc[r][c]);
}

template <int C>
inline void column_group(const float* x, int64_t t, int64_t k, const float* buf, int64_t nb, float* out, int64_t n) {
  int64_t r = 0;
  for (; r + 4 <= t; r += 4) tile<4, C>(x + r * k, k, buf, nb, out + r * n, n);
  switch (t - r) {
    case 3: tile<3, C>(x + r * k, k, buf, nb, out + r * n, n); break;
    case 2: tile<2, C>(x + r * k, k, buf, nb, out + r * n, n); break;
    case 1: tile<1, C>(x + r * k, k, buf, nb, out + r * n, n); break;
    default: break;
  }
}

template <bool Q4>
void batched(const float* x, int64_t t, int64_t k, const uint8_t* w, int64_t begin, int64_t end, float* out,
             int64_t n) {
  const int64_t nb = k / kBlock, bytes = Q4 ? kQ4Bytes : kQ8Bytes;
  std::vector<float> buf(static_cast<size_t>(nb * 4 * kBlock));
  for (int64_t j = begin; j < end; j += 4) {
    const int64_t cols = std::min<int64_t>(4, end - j);
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t c = 0; c < cols; ++c)
        dequantize_block<Q4>(w + (j + c) * nb * bytes + b * bytes, buf.data() + b * 4 * kBlock + c * kBlock);
    switch (cols) {
      case 4: column_group<4>(x, t, k, buf.data(), nb, out + j, n); break;
      case 3: column_group<3>(x, t, k, buf.data(), nb, out + j, n); break;
      case 2: column_group<2>(x, t, k, buf.data(), nb, out + j, n); break;
      default: column_group<1>(x, t, k, buf.data(), nb, out + j, n); break;
    }
  }
}
#endif

template <bool Q4>
Tensor quant_linear(const Tensor& x, const Tensor& packed, int64_t n, const char* op) {
  check_float(x, op, "x", 2);
  check_contiguous(x, op, "x");
  check_tensor(packed, ScalarType::Byte, "uint8", op, "packed", 2);
  check_contiguous(packed, op, "packed");
  const int64_t t = x.size(0), k = x.size(1), bytes = Q4 ? kQ4Bytes : kQ8Bytes;
  CHECK(k % kBlock == 0, op, ": in_features ", k, " is not a multiple of ", kBlock);
  const int64_t nb = k / kBlock;
  CHECK(packed.size(0) == n && packed.size(1) == nb * bytes, op, ": packed weight ", str(packed.sizes()),
        " does not hold ", n, " rows of ", nb, " blocks of ", bytes, " bytes (in_features ", k, ")");
  Tensor out = torch::stable::new_empty(x, {t, n});
  const float* xp = x.const_data_ptr<float>();
  const uint8_t* wp = packed.const_data_ptr<uint8_t>();
  float* op_ = out.mutable_data_ptr<float>();
  // Output features split evenly across threads; each thread streams its rows of W once.
  const int64_t threads = std::max<int64_t>(1, torch::stable::get_num_threads());
  const int64_t grain = std::max<int64_t>(16, (n + threads - 1) / threads);
  torch::stable::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
#if defined(__AVX512F__)
    if (t > kRows) {
      batched<Q4>(xp, t, k, wp, begin, end, op_, n);
      return;
    }
#endif
    for (int64_t j = begin; j < end; ++j) {
      const uint8_t* wj = wp + j * nb * bytes;
      int64_t r = 0;
      for (; r + kRows <= t; r += kRows) dot_rows<kRows, Q4>(xp + r * k, k, wj, nb, op_ + r * n + j, n);
      switch (t - r) {
        case 3: dot_rows<3, Q4>(xp + r * k, k, wj, nb, op_ + r * n + j, n); break;
        case 2: dot_rows<2, Q4>(xp + r * k, k, wj, nb, op_ + r * n + j, n); break;
        case 1: dot_rows<1, Q4>(xp + r * k, k, wj, nb, op_ + r * n + j, n); break;
        default: break;
      }
    }
  });
  return out;
}

Tensor q4_linear(const Tensor& x, const Tensor& packed, int64_t out_features) {
  return quant_linear<true>(x, packed, out_features, "q4_linear");
}

Tensor q8_linear(const Tensor& x, const Tensor& packed, int64_t out_features) {
  return quant_linear<false>(x, packed, out_features, "q8_linear");
}

}  // namespace

namespace infermesh_cpu {
Tensor q4_linear(const Tensor& x, const Tensor& packed, int64_t out_features) {
  return ::q4_linear(x, packed, out_features);
}
}  // namespace infermesh_cpu

STABLE_TORCH_LIBRARY_FRAGMENT(infermesh, m) {
  m.def("q4_linear(Tensor x, Tensor packed, int out_features) -> Tensor");
  m.def("q8_linear(Tensor x, Tensor packed, int out_features) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(infermesh, CPU, m) {
  m.impl("q4_linear", TORCH_BOX(&q4_linear));
  m.impl("q8_linear", TORCH_BOX(&q8_linear));
}
