// gguf_linear's activations (cpu_gguf.h's QuantizedX): x (T, K) float32 quantized per row and 32-element
// block as llama.cpp's Q8_0 activations are: dx = max|x| / 127, qx = round(x * (1 / dx)) to nearest even
// (MXCSR's default rounding, as torch.round), with the sums of qx over each 16 elements.

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
namespace {
#include "cpu_common.h"
}  // namespace
#include "cpu_gguf.h"

namespace infermesh_gguf {

void quantize_rows(const float* x, int64_t t, int64_t k, QuantizedX& out) {
  const int64_t nb = k / kBlock;
  out.t = t, out.k = k, out.nb = nb;
  out.q.resize(static_cast<size_t>(t * k));
  out.d.resize(static_cast<size_t>(t * nb));
  out.s16.resize(static_cast<size_t>(t * nb * 2));
  out.s32.resize(static_cast<size_t>(t * nb));
  out.ds.resize(static_cast<size_t>(t * nb));
  for (int64_t i = 0; i < t * nb; ++i) {
    const float* xb = x + i * kBlock;
    int8_t* qb = out.q.data() + i * kBlock;
    int32_t sum[2] = {0, 0};
#if defined(__AVX2__)
    __m256 v[4], amax8 = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int h = 0; h < 4; ++h) {
      v[h] = _mm256_loadu_ps(xb + 8 * h);
      amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, v[h]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float d = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1))) / 127.0f;
    const __m256 idv = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    __m256i r[4];
    for (int h = 0; h < 4; ++h)     // cvtps_epi32 rounds to nearest even (MXCSR's default)
      r[h] = _mm256_cvtps_epi32(_mm256_mul_ps(v[h], idv));
    // packs interleave 128-bit lanes: (0,1) -> 0 2 1 3 order in 32-bit groups; permute back.
    __m256i w8 = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
    w8 = _mm256_permutevar8x32_epi32(w8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), w8);
    // sums of q + 128 over each 8 bytes; each half of 16 is two of them
    const __m256i sad = _mm256_sad_epu8(_mm256_xor_si256(w8, _mm256_set1_epi8(static_cast<char>(0x80))),
                                        _mm256_setzero_si256());
    alignas(32) int64_t part[4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(part), sad);
    sum[0] = static_cast<int32_t>(part[0] + part[1]) - 16 * 128;
    sum[1] = static_cast<int32_t>(part[2] + part[3]) - 16 * 128;
#else
    float amax = 0.0f;
    for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int j = 0; j < kBlock; ++j) {
      qb[j] = static_cast<int8_t>(std::nearbyint(xb[j] * id));
      sum[j / 16] += qb[j];
    }
#endif
    out.d[static_cast<size_t>(i)] = d;
    out.s16[static_cast<size_t>(2 * i)] = sum[0];
    out.s16[static_cast<size_t>(2 * i + 1)] = sum[1];
    out.s32[static_cast<size_t>(i)] = sum[0] + sum[1];
    out.ds[static_cast<size_t>(i)] = d * static_cast<float>(sum[0] + sum[1]);
  }
}

// x (quantized) in AMX B-tile layout (cpu_gguf.h's TiledX); rows past T are zeros.
TiledX tile_x(const QuantizedX& qx, int64_t uk, bool mins) {
  TiledX out;
  int64_t w = 1;
  while (w < qx.t && w < kTile) w *= 2;
  const int64_t nb = qx.nb, g = group_of(uk, w), upb = kBlock / uk;
  out.width = w, out.g = g, out.uk = uk, out.tiles = (qx.t + w - 1) / w, out.nb = nb, out.units = nb * upb;
  out.groups = (out.units + g - 1) / g;
  const int64_t cols = g * w, rows_b = g * uk / 4;
  out.b.assign(static_cast<size_t>(out.tiles * out.groups * rows_b * cols * 4), 0);
  out.dx.assign(static_cast<size_t>(out.tiles * out.groups * kTile), 0.0f);
  if (mins) out.ds.assign(out.dx.size(), 0.0f);
  for (int64_t rt = 0; rt < out.tiles; ++rt)
    for (int64_t m = 0; m < std::min(w, qx.t - rt * w); ++m) {
      const int64_t row = rt * w + m;
      const int8_t* q = qx.q.data() + row * qx.k;
      for (int64_t u = 0; u < out.units; ++u) {
        const int64_t gi = rt * out.groups + u / g, i = u % g, b = u / upb;
        int8_t* dst = out.b.data() + gi * rows_b * cols * 4;
        for (int64_t k = 0; k < uk / 4; ++k)
          std::memcpy(dst + ((i * uk / 4 + k) * cols + i * w + m) * 4, q + u * uk + 4 * k, 4);
        const float d = qx.d[static_cast<size_t>(row * nb + b)];
        for (int64_t l = i * w + m; l < kTile; l += cols) {
          out.dx[static_cast<size_t>(gi * kTile + l)] = d;
          if (mins)
            out.ds[static_cast<size_t>(gi * kTile + l)] =
                d * static_cast<float>(qx.s16[static_cast<size_t>(2 * (row * nb + b))] +
                                       qx.s16[static_cast<size_t>(2 * (row * nb + b) + 1)]);
        }
      }
    }
  return out;
}

}  // namespace infermesh_gguf
