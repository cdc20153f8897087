// gguf_linear's path for Q4_K and Q6_K at 1 to kQ8KRows rows (cpu_gguf.cpp asks it first; AVX512-VNNI
// builds only, else q8k_linear declines and the other paths run): activations quantized per 256 as
// llama.cpp's Q8_K (one float dx per super-block, so a super-block's whole dot product is one integer).
//
// x (T, K) per row and 256 elements: dx = max|x| / 127, qx = round(x * (1 / dx)) (to nearest even), with
// the sums of qx over each 16 (Q6_K's offset) and 32 (Q4_K's mins) elements.  Per weight column and
// super-block, decoded in registers 64 weights at a time (unsigned: Q4_K's 4-bit q, Q6_K's 6-bit q without
// its offset 32), maddubs(q, qx) makes 16-bit pair sums (at most 2 * 63 * 127, no saturation) and
// dpwssd multiplies them by the unit's integer scale (Q4_K's 6-bit sc per 32, Q6_K's int8 per 16) into
// int32 lanes, exact:
//   Q4_K: isum = sum_j sc_j dot(q_j, qx_j),              out += dx (d isum - dmin sum_j m_j sum(qx_j))
//   Q6_K: isum = sum_j sc_j (dot(q_j, qx_j) - 32 sum(qx_j)), out += dx d isum
// so the float work is one convert and multiply-add per super-block (the per-32 paths do it per block).
// The price is coarser activations (dx per 256, not per 32): what llama.cpp accepts for K-quants, and
// what tests/unit/test_gguf_blocks.py checks against (gguf_blocks.gguf_linear_reference(..., block=256)).
//
// Threads split the columns; each takes kCols adjacent columns at a time (independent streams for the
// out-of-order core), prefetching the next group's bytes as it reads these.

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

namespace {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr int64_t kSuper = 256;

// x (T, K) quantized per 256 elements (llama.cpp's Q8_K, with a float32 dx).
struct Q8K {
  int64_t t = 0, k = 0, ns = 0;
  std::vector<int8_t> q;          // (T, K)
  std::vector<float> d;           // (T, K / 256) dx
  std::vector<int16_t> s16;       // (T, K / 16) -16 times the sums of qx over each 16 elements (|sum| <= 2032)
  std::vector<int16_t> s32;       // (T, K / 32) the sums over each 32
};

void quantize_q8k(const float* x, int64_t t, int64_t k, Q8K& out) {
  const int64_t ns = k / kSuper;
  out.t = t, out.k = k, out.ns = ns;
  out.q.resize(static_cast<size_t>(t * k));
  out.d.resize(static_cast<size_t>(t * ns));
  out.s16.resize(static_cast<size_t>(t * k / 16));
  out.s32.resize(static_cast<size_t>(t * k / 32));
  for (int64_t i = 0; i < t * ns; ++i) {
    const float* xs = x + i * kSuper;
    __m512 amax = _mm512_setzero_ps();
    for (int j = 0; j < 16; ++j) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(xs + 16 * j)));
    const float d = _mm512_reduce_max_ps(amax) / 127.0f;
    const __m512 inv = _mm512_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    int32_t sums[16];
    for (int j = 0; j < 16; ++j) {     // cvtps_epi32 rounds to nearest even (MXCSR's default); |q| <= 127
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xs + 16 * j), inv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out.q.data() + i * kSuper + 16 * j), _mm512_cvtepi32_epi8(q));
      sums[j] = _mm512_reduce_add_epi32(q);
      out.s16[static_cast<size_t>(i * 16 + j)] = static_cast<int16_t>(-16 * sums[j]);
    }
    for (int j = 0; j < 8; ++j)
      out.s32[static_cast<size_t>(i * 8 + j)] = static_cast<int16_t>(sums[2 * j] + sums[2 * j + 1]);
    out.d[static_cast<size_t>(i)] = d;
  }
}

// Columns per step, and the prefetch distances in groups of them (2 threads of a Sapphire Rapids, 1-4 rows:
// 4 columns beat 1, 2 or 3 at every row count; into L1 2 groups ahead was no faster than 1; into L2 8 groups
// ahead as well: Qwen2.5-Coder-1.5B's Q4_K ffn_gate 8.7-9.0 -> 7.9-8.3 ms at 1 row, its Q6_K within noise).
constexpr int kCols = 4;
constexpr int64_t kAheadGroups = 1, kFarGroups = 8;

inline __m512i load64(const void* p) { return _mm512_loadu_si512(p); }
inline __m256i load32(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline __m128i load16(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }
inline __m128i load8(const void* p) { return _mm_loadl_epi64(static_cast<const __m128i*>(p)); }
inline __m512i twice32(const void* p) { return _mm512_broadcast_i64x4(load32(p)); }   // 32 bytes in both halves

// out[r * n + j0 + c] for R rows and C columns from column j0 (its row of super-blocks at w).
template <int64_t KIND, int R, int C>
void group(const Q8K& xq, const uint8_t* w, int64_t row_bytes, float* out, int64_t n, int64_t j0) {
  using K = Kind<KIND>;
  static_assert(C >= 1 && C <= 4, "Q4_K's mins take 4 lanes a column");
  const int64_t ns = xq.ns, k = xq.k;
  const int64_t ahead = kAheadGroups * C * row_bytes;
  // int16 lane l of the 64 weights g takes scale 2 g + l / 16 (Q4_K, per 32) or 4 g + l / 8 (Q6_K, per 16)
  __m512i pick[4];
  for (int g = 0; g < 4; ++g) {
    alignas(64) int16_t idx[32];
    for (int l = 0; l < 32; ++l) idx[l] = static_cast<int16_t>(KIND == kQ4_K ? 2 * g + l / 16 : 4 * g + l / 8);
    pick[g] = load64(idx);
  }
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R][C], mins[R];      // mins: Q4_K's dmin terms, column c's in lanes 4 c to 4 c + 3
  for (int r = 0; r < R; ++r) {
    mins[r] = _mm512_setzero_ps();
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  for (int64_t s = 0; s < ns; ++s) {
    const int8_t* qx = xq.q.data() + s * kSuper;      // row r's at qx + r k
    __m512 dx[R];
    for (int r = 0; r < R; ++r) dx[r] = _mm512_set1_ps(xq.d[static_cast<size_t>(r * ns + s)]);
    [[maybe_unused]] __m512i m4 = _mm512_setzero_si512();
    [[maybe_unused]] __m512 dmin4 = _mm512_setzero_ps();
    for (int c = 0; c < C; ++c) {
      const uint8_t* b = w + (j0 + c) * row_bytes + s * K::bytes;
      for (int64_t l = 0; l < K::bytes; l += 64)
        _mm_prefetch(reinterpret_cast<const char*>(b + ahead + l), _MM_HINT_T0);
      for (int64_t l = 0; l < K::bytes; l += 64)
        _mm_prefetch(reinterpret_cast<const char*>(b + kFarGroups * ahead + l), _MM_HINT_T2);
      __m512i isum[R];
      for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
      __m512 d;
      if constexpr (KIND == kQ4_K) {
        uint8_t sc[8], m[8];
        scales_mins_k4(b + 4, sc, m);
        d = _mm512_set1_ps(half_at(b));
        const __mmask16 lanes = static_cast<__mmask16>(0xF << (4 * c));
        dmin4 = _mm512_mask_broadcastss_ps(dmin4, lanes, _mm_set_ss(half_at(b + 2)));
        m4 = _mm512_mask_broadcast_i32x4(m4, lanes, _mm_cvtepu8_epi16(load8(m)));
        const __m512i sc16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(load8(sc)));
        for (int g = 0; g < 4; ++g) {       // sub-blocks 2 g and 2 g + 1: qs[32 g + l]'s low and high nibbles
          const __m512i v = _mm512_srlv_epi64(twice32(b + 16 + 32 * g), _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4));
          const __m512i q = _mm512_and_si512(v, low);
          const __m512i scl = _mm512_permutexvar_epi16(pick[g], sc16);
          for (int r = 0; r < R; ++r)
            isum[r] = _mm512_dpwssd_epi32(isum[r], _mm512_maddubs_epi16(q, load64(qx + r * k + 64 * g)), scl);
        }
      } else {   // Q6_K, as cpu_gguf.h's decode_super: 4 low bits from ql, 2 from qh, elements in order
        d = _mm512_set1_ps(half_at(b + 208));
        const __m256i sc16 = _mm256_cvtepi8_epi16(load16(b + 192));
        const __m512i top = _mm512_set1_epi8(0x30);
        for (int h = 0; h < 2; ++h) {
          const __m512i ql = load64(b + 64 * h), qh = twice32(b + 128 + 32 * h);
          const __m512i hi01 = _mm512_and_si512(_mm512_sllv_epi64(qh, _mm512_setr_epi64(4, 4, 4, 4, 2, 2, 2, 2)), top);
          const __m512i hi23 = _mm512_and_si512(_mm512_srlv_epi64(qh, _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2)), top);
          const __m512i q[2] = {_mm512_ternarylogic_epi64(ql, hi01, low, 0xEC),     // (ql & low) | hi
                                _mm512_ternarylogic_epi64(_mm512_srli_epi64(ql, 4), hi23, low, 0xEC)};
          for (int e = 0; e < 2; ++e) {
            const int g = 2 * h + e;
            const __m512i scl = _mm512_permutexvar_epi16(pick[g], _mm512_castsi256_si512(sc16));
            for (int r = 0; r < R; ++r)
              isum[r] = _mm512_dpwssd_epi32(isum[r], _mm512_maddubs_epi16(q[e], load64(qx + r * k + 64 * g)), scl);
          }
        }
        // the offset, -32 sum_j sc_j sum(qx_j), as (2 sc_j) (-16 sum(qx_j)): both fit int16
        const __m512i sc2 = _mm512_zextsi256_si512(_mm256_add_epi16(sc16, sc16));
        for (int r = 0; r < R; ++r)
          isum[r] = _mm512_dpwssd_epi32(isum[r], sc2,
                                        _mm512_zextsi256_si512(load32(xq.s16.data() + (r * ns + s) * 16)));
      }
      for (int r = 0; r < R; ++r)
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(d, dx[r]), acc[r][c]);
    }
    if constexpr (KIND == kQ4_K)
      for (int r = 0; r < R; ++r) {   // C columns' sum_j m_j sum(qx_j) at once, 4 int32 lanes each
        const __m512i sums = _mm512_broadcast_i32x4(load16(xq.s32.data() + (r * ns + s) * 8));
        mins[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(m4, sums)), _mm512_mul_ps(dmin4, dx[r]),
                                  mins[r]);
      }
  }
  for (int r = 0; r < R; ++r) {
    alignas(64) float m[16];
    _mm512_store_ps(m, mins[r]);
    for (int c = 0; c < C; ++c)
      out[r * n + j0 + c] = _mm512_reduce_add_ps(acc[r][c]) - (m[4 * c] + m[4 * c + 1] + m[4 * c + 2] + m[4 * c + 3]);
  }
}

template <int64_t KIND, int R>
void linear(const Q8K& xq, const uint8_t* w, int64_t n, float* out) {
  const int64_t row_bytes = xq.ns * Kind<KIND>::bytes;
  const int64_t threads = std::max<int64_t>(1, torch::stable::get_num_threads());
  const int64_t grain = std::max<int64_t>(16, (n / kCols + threads - 1) / threads * kCols);
  torch::stable::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    int64_t j = begin;
    for (; j + kCols <= end; j += kCols) group<KIND, R, kCols>(xq, w, row_bytes, out, n, j);
    for (; j < end; ++j) group<KIND, R, 1>(xq, w, row_bytes, out, n, j);
  });
}

template <int64_t KIND>
void linear_rows(const Q8K& xq, const uint8_t* w, int64_t n, float* out) {
  switch (xq.t) {
    case 1: linear<KIND, 1>(xq, w, n, out); break;
    case 2: linear<KIND, 2>(xq, w, n, out); break;
    case 3: linear<KIND, 3>(xq, w, n, out); break;
    default: linear<KIND, 4>(xq, w, n, out); break;
  }
}
#endif

}  // namespace

namespace infermesh_gguf {

bool q8k_linear(int64_t kind, const float* x, int64_t t, int64_t k, const uint8_t* w, int64_t n, float* out) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  if ((kind != kQ4_K && kind != kQ6_K) || t < 1 || t > kQ8KRows) return false;
  Q8K xq;
  quantize_q8k(x, t, k, xq);
  if (kind == kQ4_K)
    linear_rows<kQ4_K>(xq, w, n, out);
  else
    linear_rows<kQ6_K>(xq, w, n, out);
  return true;
#else
  (void)kind, (void)x, (void)t, (void)k, (void)w, (void)n, (void)out;
  return false;
#endif
}

}  // namespace infermesh_gguf
