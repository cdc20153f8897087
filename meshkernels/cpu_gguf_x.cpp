// gguf_linear's activations (cpu_gguf.h's QuantizedX): x (T, K) float32 quantized per row and 32-element
// block as llama.cpp's Q8_0 activations are: dx = max|x| / 127, qx = round(x * (1 / dx)) to nearest even
// (MXCSR's default rounding, as torch.round), with the sums of qx over each 16 elements; with `fine`, the
// coarse blocks' outliers taken out and kept as floats (cpu_gguf.h).

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

namespace {

// One 32-element block: qb, its dx (returned) and the sums of qb over each 16; amax: the largest |x|.
float quantize_block(const float* xb, int8_t* qb, int32_t sum[2], float& amax) {
  sum[0] = sum[1] = 0;
#if defined(__AVX2__)
  __m256 v[4], amax8 = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int h = 0; h < 4; ++h) {
    v[h] = _mm256_loadu_ps(xb + 8 * h);
    amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, v[h]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
  const float d = amax / 127.0f;
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
  amax = 0.0f;
  for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  for (int j = 0; j < kBlock; ++j) {
    qb[j] = static_cast<int8_t>(std::nearbyint(xb[j] * id));
    sum[j / 16] += qb[j];
  }
#endif
  return d;
}

void store_block(QuantizedX& out, int64_t i, float d, const int32_t sum[2]) {
  out.d[static_cast<size_t>(i)] = d;
  out.s16[static_cast<size_t>(2 * i)] = sum[0];
  out.s16[static_cast<size_t>(2 * i + 1)] = sum[1];
  out.s32[static_cast<size_t>(i)] = sum[0] + sum[1];
  out.ds[static_cast<size_t>(i)] = d * static_cast<float>(sum[0] + sum[1]);
}

// out's shape for x (T, K), no coarse blocks; what a fresh QuantizedX gains this way is zeros.
void size_for(QuantizedX& out, int64_t t, int64_t k) {
  const int64_t nb = k / kBlock;
  out.t = t, out.k = k, out.nb = nb;
  out.q.resize(static_cast<size_t>(t * k));
  out.d.resize(static_cast<size_t>(t * nb));
  out.s16.resize(static_cast<size_t>(t * nb * 2));
  out.s32.resize(static_cast<size_t>(t * nb));
  out.ds.resize(static_cast<size_t>(t * nb));
  out.outlier.clear();
  out.outlier_at.clear();
  out.fine_rows.clear();
  out.words = 0;
}

// The sum of a row's squares, in double (each square exact; the order of the sums no matter at this precision).
double square_sum(const float* x, int64_t k) {
  double sum = 0.0;
#if defined(__AVX2__)
  __m256d acc[2] = {_mm256_setzero_pd(), _mm256_setzero_pd()};
  int64_t j = 0;
  for (; j + 8 <= k; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
    acc[0] = _mm256_fmadd_pd(lo, lo, acc[0]);
    acc[1] = _mm256_fmadd_pd(hi, hi, acc[1]);
  }
  alignas(32) double part[4];
  _mm256_store_pd(part, _mm256_add_pd(acc[0], acc[1]));
  sum = (part[0] + part[1]) + (part[2] + part[3]);
  for (; j < k; ++j) sum += static_cast<double>(x[j]) * x[j];
#else
  for (int64_t j = 0; j < k; ++j) sum += static_cast<double>(x[j]) * x[j];
#endif
  return sum;
}

}  // namespace

void quantize_rows(const float* x, int64_t t, int64_t k, QuantizedX& out, bool fine) {
  const int64_t nb = k / kBlock;
  size_for(out, t, k);
  std::vector<float> amax(fine ? static_cast<size_t>(nb) : 0);
  for (int64_t row = 0; row < t; ++row) {
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t i = row * nb + b;
      int32_t sum[2];
      float top;
      const float d = quantize_block(x + i * kBlock, out.q.data() + i * kBlock, sum, top);
      store_block(out, i, d, sum);
      if (fine) amax[static_cast<size_t>(b)] = top;
    }
    if (!fine) continue;
    // coarse: amax^2 > kCoarse^2 * (the row's mean square), as amax^2 * K > kCoarse^2 * (the sum of squares)
    const double bar = kCoarse * kCoarse * square_sum(x + row * k, k);
    for (int64_t b = 0; b < nb; ++b) {
      const float top = amax[static_cast<size_t>(b)];
      if (!(static_cast<double>(top) * top * static_cast<double>(k) > bar)) continue;
      if (!out.words) {
        out.words = (t + 63) / 64;
        out.fine_rows.assign(static_cast<size_t>(nb * out.words), 0);
        out.outlier.assign(static_cast<size_t>(t * nb), 0.0f);
        out.outlier_at.assign(static_cast<size_t>(t * nb), 0);
      }
      const int64_t i = row * nb + b;
      float rest[kBlock];
      std::memcpy(rest, x + i * kBlock, sizeof rest);
      int at = 0;                                   // the first element of the largest |x|
      while (std::fabs(rest[at]) != top) ++at;
      out.outlier[static_cast<size_t>(i)] = rest[at];
      out.outlier_at[static_cast<size_t>(i)] = static_cast<uint8_t>(at);
      rest[at] = 0.0f;
      int32_t sum[2];
      float ignored;
      const float d = quantize_block(rest, out.q.data() + i * kBlock, sum, ignored);
      store_block(out, i, d, sum);
      out.fine_rows[static_cast<size_t>(b * out.words + row / 64)] |= uint64_t{1} << (row % 64);
    }
  }
}

QuantizedX outlier_blocks(const QuantizedX& qx) {
  QuantizedX out;
  size_for(out, qx.t, qx.k);
  for (int64_t row = 0; row < qx.t; ++row)
    for (int64_t b = 0; b < qx.nb; ++b) {
      if (!qx.coarse(b, row, 1)) continue;
      const int64_t i = row * qx.nb + b;
      const float value = qx.outlier[static_cast<size_t>(i)];
      const int8_t q = value < 0.0f ? -127 : 127;
      const int at = qx.outlier_at[static_cast<size_t>(i)];
      out.q[static_cast<size_t>(i * kBlock + at)] = q;
      const int32_t sum[2] = {at < 16 ? q : 0, at < 16 ? 0 : q};
      store_block(out, i, std::fabs(value) / 127.0f, sum);
    }
  return out;
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
