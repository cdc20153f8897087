// Fused float32 CPU ops for the engine's fast (non-"exact") forward; built and loaded by meshkernels/cpu_ops.py.
//
// Each op replaces a run of small torch ops in services/engine/runtime/models/llama.py (about 8-10 us of dispatch
// each), and paged_decode_attention reads K/V rows straight from the paged cache instead of gathering
// them into contiguous copies first.  The math is float32 throughout; results agree with the torch ops
// to rounding (sums are taken in a different order), not bit for bit.
//
// AVX2/FMA paths are compiled when __AVX2__ is defined; the scalar loops beside them are the portable
// path and also handle the tails.
//
// Written against torch's stable C++ API (torch/csrc/stable): its headers compile in a few seconds,
// where <torch/library.h> and ATen take 15-20 s, and torch::stable::parallel_for runs inside libtorch,
// so this file needs no OpenMP flags of its own.

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "cpu_api.h"

namespace {

#include "cpu_common.h"

// ------------------------------------------------------------------------------------ primitives

#ifdef __AVX2__
// The four horizontal sums of a0..a3, in order.
inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}
#endif

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.0f;
#ifdef __AVX2__
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  s = hsum(_mm256_add_ps(acc0, acc1));
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// out[0..3] = dot(q, k[r]) for four rows at once: four independent FMA chains hide the latency that
// one dot product's chain would leave idle.
inline void dot4(const float* q, const float* const k[4], int64_t n, float* out) {
  int64_t i = 0;
#ifdef __AVX2__
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[0] + i), a0);
    a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[1] + i), a1);
    a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[2] + i), a2);
    a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[3] + i), a3);
  }
  _mm_storeu_ps(out, hsum4(a0, a1, a2, a3));
#else
  for (int r = 0; r < 4; ++r) out[r] = 0.0f;
#endif
  for (; i < n; ++i)
    for (int r = 0; r < 4; ++r) out[r] += q[i] * k[r][i];
}

// x[i] = exp(x[i] - shift); returns the sum.
inline float exp_shift_sum(float* x, int64_t n, float shift) {
  int64_t i = 0;
  float s = 0.0f;
#ifdef __AVX2__
  const __m256 sv = _mm256_set1_ps(shift);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), sv));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  s = hsum(acc);
#endif
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - shift);
    s += x[i];
  }
  return s;
}

// acc[0..R*8) += sum_j p[j] * rows[j][0..R*8): R accumulators live in registers across all rows.
#ifdef __AVX2__
template <int R>
inline void weighted_rows(const float* p, const float* const* rows, int64_t n, int64_t col, float* acc) {
  __m256 a[R];
  for (int r = 0; r < R; ++r) a[r] = _mm256_loadu_ps(acc + r * 8);
  for (int64_t j = 0; j < n; ++j) {
    const __m256 w = _mm256_broadcast_ss(p + j);
    const float* row = rows[j] + col;
    for (int r = 0; r < R; ++r) a[r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + r * 8), a[r]);
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(acc + r * 8, a[r]);
}
#endif

// acc[0..d) += sum_j p[j] * rows[j][0..d).
inline void weighted_sum(const float* p, const float* const* rows, int64_t n, int64_t d, float* acc) {
  int64_t c = 0;
#ifdef __AVX2__
  for (; c + 64 <= d; c += 64) weighted_rows<8>(p, rows, n, c, acc + c);
  for (; c + 8 <= d; c += 8) weighted_rows<1>(p, rows, n, c, acc + c);
#endif
  for (; c < d; ++c)
    for (int64_t j = 0; j < n; ++j) acc[c] += p[j] * rows[j][c];
}

// ------------------------------------------------------------------------------ paged attention
//
// Decode attention reads every cached key and value of every sequence once per layer, so it is
// bound by how fast those rows stream in: the cache may hold them in float16 (half the bytes), and
// each (sequence, kv head) item is one pass over its keys with an online softmax (a running max and
// sum, rescaling the output when the max grows), where the g query heads of the kv head share every
// row loaded.  With AVX-512 and a head_dim of 32, 64 or 128 a tile of 16 keys is scored for a head
// by 16 FMA chains reduced together into one vector of 16 scores; elsewhere the portable two-pass
// loops below (scores, softmax, weighted sum) run on float rows, converted from float16 first.
// A softcap > 0 (Gemma 2) caps each scaled score as softcap * tanh(score / softcap) before its softmax;
// 0 skips it (one well-predicted branch per tile).

// Keys are taken in tiles: a tile's K (then V) rows stay in L1 while each head of the group uses them.
constexpr int64_t kTile = 16;


// n elements of a cache row as float.
inline void kv_to_float(const float* src, int64_t n, float* dst) { std::memcpy(dst, src, n * sizeof(float)); }
inline void kv_to_float(const uint16_t* src, int64_t n, float* dst) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = half_bits_to_float(src[i]);
}

// n floats into a cache row (float16: rounded to nearest even, as torch's .half()).
inline void float_to_kv(const float* src, int64_t n, float* dst) { std::memcpy(dst, src, n * sizeof(float)); }
inline void float_to_kv(const float* src, int64_t n, uint16_t* dst) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; i < n; ++i) dst[i] = float_to_half_bits(src[i]);
}

// The portable item: the g heads' scores for all `len` keys, a softmax per head, then the weighted
// sum of the value rows.  q: (g, d) scaled queries; krows/vrows: float rows; o: (g, d).
void attend_two_pass(const float* q, int64_t g, int64_t d, const float* const* krows, const float* const* vrows,
                     int64_t len, float softcap, float* scores, float* o) {
  for (int64_t t0 = 0; t0 < len; t0 += kTile) {
    const int64_t t1 = std::min(len, t0 + kTile);
    for (int64_t i = 0; i < g; ++i) {
      const float* qi = q + i * d;
      float* si = scores + i * len;
      int64_t j = t0;
      for (; j + 4 <= t1; j += 4) dot4(qi, krows + j, d, si + j);
      for (; j < t1; ++j) si[j] = dot(qi, krows[j], d);
    }
  }
  for (int64_t i = 0; i < g; ++i) {
    float* si = scores + i * len;
    if (softcap > 0.0f)
      for (int64_t j = 0; j < len; ++j) si[j] = softcap * std::tanh(si[j] / softcap);
    const float m = *std::max_element(si, si + len);
    const float inv = 1.0f / exp_shift_sum(si, len, m);
    for (int64_t j = 0; j < len; ++j) si[j] *= inv;
  }
  std::fill(o, o + g * d, 0.0f);
  for (int64_t t0 = 0; t0 < len; t0 += kTile) {
    const int64_t n = std::min(len, t0 + kTile) - t0;
    for (int64_t i = 0; i < g; ++i) weighted_sum(scores + i * len + t0, vrows + t0, n, d, o + i * d);
  }
}

#ifdef __AVX512F__
// exp(x) as exp8 computes it, 16 lanes: 0 below exp's normal range, +inf above it.
inline __m512 exp16(__m512 x) {
  const __m512 max_x = _mm512_set1_ps(88.3762626647949f);
  const __m512 min_x = _mm512_set1_ps(-87.3365447505531f);
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, min_x, _CMP_LT_OQ);
  const __mmask16 overflow = _mm512_cmp_ps_mask(x, max_x, _CMP_GT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, min_x), max_x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  const __m512i pow2n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  y = _mm512_mul_ps(y, _mm512_castsi512_ps(pow2n));
  y = _mm512_maskz_mov_ps(static_cast<__mmask16>(~underflow), y);
  return _mm512_mask_blend_ps(overflow, y, _mm512_set1_ps(std::numeric_limits<float>::infinity()));
}

// softcap * tanh(s / softcap), 16 lanes, as 1 - 2 / (exp(2 s / softcap) + 1): exact to a few ulp of 1, so
// within softcap * 1e-7 of the capped score (exp16's 0 and +inf saturate it to -1 and 1).
inline __m512 softcap16(__m512 s, float softcap) {
  const __m512 one = _mm512_set1_ps(1.0f), cap = _mm512_set1_ps(softcap);
  const __m512 e = exp16(_mm512_mul_ps(_mm512_div_ps(s, cap), _mm512_set1_ps(2.0f)));
  return _mm512_mul_ps(cap, _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, one))));
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Lane j of the result is the sum of all 16 lanes of a[j]: 16 horizontal sums in 45 shuffles and adds.
inline __m512 reduce16(const __m512* a) {
  __m512 y[8], z[4], w[2];
  for (int i = 0; i < 8; ++i)   // per 128-bit lane: (a0, a1, a0, a1) partial sums
    y[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i)   // per 128-bit lane: (a0, a1, a2, a3)
    z[i] = _mm512_add_ps(_mm512_shuffle_ps(y[2 * i], y[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(y[2 * i], y[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)   // 128-bit lanes: (A lanes 0+1, A lanes 2+3, B 0+1, B 2+3)
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(z[2 * i], z[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(z[2 * i], z[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// Prefetch the rows of keys [t0, t1) into cache: the rows of one item are scattered over blocks
// (and strided by the other kv heads), which the hardware prefetchers follow poorly.
template <typename T>
inline void prefetch_rows(const T* const* krows, const T* const* vrows, int64_t t0, int64_t t1, int64_t bytes) {
  for (int64_t j = t0; j < t1; ++j)
    for (int64_t off = 0; off < bytes; off += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(krows[j]) + off, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(vrows[j]) + off, _MM_HINT_T0);
    }
}

// One item in one pass, DV vectors of 16 per head row.  q: (G, 16 DV) scaled queries; o: (G, 16 DV).
// Per tile: each head's 16 scores (16 FMA chains reduced together), the online-softmax update, then
// every head's output gains the tile's value rows, each row loaded once for all G heads.
template <int DV, int G, typename T>
void attend_online(const float* q, const T* const* krows, const T* const* vrows, int64_t len, float softcap,
                   float* o) {
  constexpr int64_t D = 16 * DV;
  constexpr int64_t kAhead = 4 * kTile;         // keys prefetched ahead of the tile being computed
  alignas(64) float p[G][kTile];
  float m[G], l[G];
  __m512 out[G][DV];
  for (int i = 0; i < G; ++i) {
    m[i] = -std::numeric_limits<float>::max();
    l[i] = 0.0f;
    for (int c = 0; c < DV; ++c) out[i][c] = _mm512_setzero_ps();
  }
  prefetch_rows(krows, vrows, 0, std::min(len, kAhead), D * sizeof(T));
  for (int64_t t0 = 0; t0 < len; t0 += kTile) {
    const int64_t n = std::min(kTile, len - t0);
    prefetch_rows(krows, vrows, std::min(len, t0 + kAhead), std::min(len, t0 + kAhead + kTile), D * sizeof(T));
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
    for (int i = 0; i < G; ++i) {
      __m512 qv[DV], acc[kTile];
      for (int c = 0; c < DV; ++c) qv[c] = _mm512_loadu_ps(q + i * D + 16 * c);
      for (int64_t j = 0; j < kTile; ++j) {
        if (j >= n) {
          acc[j] = _mm512_setzero_ps();
          continue;
        }
        const T* k = krows[t0 + j];
        __m512 a = _mm512_mul_ps(qv[0], load16(k));
        for (int c = 1; c < DV; ++c) a = _mm512_fmadd_ps(qv[c], load16(k + 16 * c), a);
        acc[j] = a;
      }
      __m512 raw = reduce16(acc);
      if (softcap > 0.0f) raw = softcap16(raw, softcap);
      const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::max()), valid, raw);
      const float mnew = std::max(m[i], _mm512_reduce_max_ps(s));
      const __m512 e = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(s, _mm512_set1_ps(mnew))));
      const float correction = std::exp(m[i] - mnew);
      l[i] = l[i] * correction + _mm512_reduce_add_ps(e);
      m[i] = mnew;
      _mm512_store_ps(p[i], e);
      const __m512 cv = _mm512_set1_ps(correction);
      for (int c = 0; c < DV; ++c) out[i][c] = _mm512_mul_ps(out[i][c], cv);
    }
    for (int64_t j = 0; j < n; ++j) {
      __m512 v[DV];
      for (int c = 0; c < DV; ++c) v[c] = load16(vrows[t0 + j] + 16 * c);
      for (int i = 0; i < G; ++i) {
        const __m512 w = _mm512_set1_ps(p[i][j]);
        for (int c = 0; c < DV; ++c) out[i][c] = _mm512_fmadd_ps(w, v[c], out[i][c]);
      }
    }
  }
  for (int i = 0; i < G; ++i) {
    const __m512 inv = _mm512_set1_ps(1.0f / l[i]);
    for (int c = 0; c < DV; ++c) _mm512_storeu_ps(o + i * D + 16 * c, _mm512_mul_ps(out[i][c], inv));
  }
}

// attend_online for this head_dim and group size, or false: the portable path takes the item.
template <typename T>
bool attend_vector(const float* q, int64_t g, int64_t d, const T* const* krows, const T* const* vrows, int64_t len,
                   float softcap, float* o) {
#define INFERMESH_ATTEND(DV, G) \
  if (d == 16 * (DV) && g == (G)) return attend_online<DV, G>(q, krows, vrows, len, softcap, o), true;
#define INFERMESH_ATTEND_G(DV) \
  INFERMESH_ATTEND(DV, 1) INFERMESH_ATTEND(DV, 2) INFERMESH_ATTEND(DV, 3) INFERMESH_ATTEND(DV, 4) \
  INFERMESH_ATTEND(DV, 5) INFERMESH_ATTEND(DV, 6) INFERMESH_ATTEND(DV, 7) INFERMESH_ATTEND(DV, 8)
  INFERMESH_ATTEND_G(2) INFERMESH_ATTEND_G(4) INFERMESH_ATTEND_G(8)
#undef INFERMESH_ATTEND_G
#undef INFERMESH_ATTEND
  return false;
}
#endif

// Runs items [begin, end) of the (sequence, kv head) list over a cache of element type T.
template <typename T>
void attend_items(int64_t begin, int64_t end, const float* qp, int64_t qs0, int64_t qs1, const T* kp, const T* vp,
                  const int64_t* tables, int64_t width, const int64_t* lens, int64_t max_len, int64_t kh, int64_t g,
                  int64_t d, int64_t bs, int64_t h, float scale, int64_t window, float softcap, float* op_) {
  const int64_t row = kh * d;                    // elements between one token's rows in the cache
  std::vector<const T*> krows(max_len), vrows(max_len);
  std::vector<float> qbuf(g * d);
  // The portable path's float rows (converted when the cache is float16) and scores.
  std::vector<float> scores, kconv, vconv;
  std::vector<const float*> kf, vf;
  for (int64_t item = begin; item < end; ++item) {
    const int64_t s = item / kh, head = item % kh;
    const int64_t len = lens[s];
    const int64_t* table = tables + s * width;
    for (int64_t first = 0; first < len; first += bs) {
      const int64_t base = table[first / bs] * bs * row + head * d;
      for (int64_t j = first; j < std::min(len, first + bs); ++j) {
        krows[j] = kp + base + (j - first) * row;
        vrows[j] = vp + base + (j - first) * row;
      }
    }
    // Scaled copies of the group's queries: the scale is applied once, not per key.
    for (int64_t i = 0; i < g; ++i) {
      const float* src = qp + s * qs0 + (head * g + i) * qs1;
      for (int64_t c = 0; c < d; ++c) qbuf[i * d + c] = src[c] * scale;
    }
    float* o = op_ + s * h * d + head * g * d;   // (g, d): this group's output rows
    // A sliding window attends the last `window` keys only: the item's rows start there.
    const int64_t lo = window > 0 ? std::max<int64_t>(0, lens[s] - window) : 0;
    const T* const* kr = krows.data() + lo;
    const T* const* vr = vrows.data() + lo;
    const int64_t n = len - lo;
#ifdef __AVX512F__
    if (attend_vector(qbuf.data(), g, d, kr, vr, n, softcap, o)) continue;
#endif
    scores.resize(g * n);
    kf.resize(n);
    vf.resize(n);
    if constexpr (std::is_same_v<T, float>) {
      for (int64_t j = 0; j < n; ++j) {
        kf[j] = kr[j];
        vf[j] = vr[j];
      }
    } else {
      kconv.resize(n * d);
      vconv.resize(n * d);
      for (int64_t j = 0; j < n; ++j) {
        kv_to_float(kr[j], d, kconv.data() + j * d);
        kv_to_float(vr[j], d, vconv.data() + j * d);
        kf[j] = kconv.data() + j * d;
        vf[j] = vconv.data() + j * d;
      }
    }
    attend_two_pass(qbuf.data(), g, d, kf.data(), vf.data(), n, softcap, scores.data(), o);
  }
}

Tensor paged_decode_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& block_tables,
                              const Tensor& context_lens, double scale, int64_t window, double softcap) {
  const char* op = "paged_decode_attention";
  CHECK(window >= 0, op, ": window must be >= 0 (0: every key), got ", window);
  CHECK(softcap >= 0, op, ": softcap must be >= 0 (0: no cap), got ", softcap);
  check_float(q, op, "q", 3);
  CHECK(q.stride(2) == 1, op, ": q's last dim must be contiguous, got strides ", str(q.strides()));
  const bool half = check_kv_cache(k_cache, op, "k_cache");
  check_kv_cache(v_cache, op, "v_cache");
  CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(), op, ": k_cache ",
        str(k_cache.sizes()), " ", k_cache.scalar_type(), " and v_cache ", str(v_cache.sizes()), " ",
        v_cache.scalar_type(), " differ");
  check_index(block_tables, op, "block_tables", 2);
  check_index(context_lens, op, "context_lens", 1);
  const int64_t b = q.size(0), h = q.size(1), d = q.size(2);
  const int64_t nb = k_cache.size(0), bs = k_cache.size(1), kh = k_cache.size(2);
  const int64_t width = block_tables.size(1);
  CHECK(k_cache.size(3) == d, op, ": head_dim of q (", d, ") and the cache (", k_cache.size(3), ") differ");
  CHECK(kh > 0 && h % kh == 0, op, ": ", h, " query heads are not a multiple of ", kh, " kv heads");
  CHECK(block_tables.size(0) == b && context_lens.size(0) == b, op, ": q has ", b, " rows, block_tables ",
        block_tables.size(0), ", context_lens ", context_lens.size(0));
  const int64_t* tables = block_tables.const_data_ptr<int64_t>();
  const int64_t* lens = context_lens.const_data_ptr<int64_t>();
  int64_t max_len = 0;
  for (int64_t i = 0; i < b; ++i) {
    CHECK(lens[i] >= 1 && lens[i] <= width * bs, op, ": context_lens[", i, "] = ", lens[i], " is outside 1..",
          width * bs, " (block_tables width x block size)");
    for (int64_t j = 0; j < (lens[i] + bs - 1) / bs; ++j) {
      const int64_t id = tables[i * width + j];
      CHECK(id >= 0 && id < nb, op, ": block_tables[", i, ", ", j, "] = ", id, " is not a block id (0..", nb - 1, ")");
    }
    max_len = std::max(max_len, lens[i]);
  }

  Tensor out = torch::stable::new_empty(q, {b, h, d});
  const int64_t g = h / kh;                      // query heads per kv head
  const float* qp = q.const_data_ptr<float>();
  float* op_ = out.mutable_data_ptr<float>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const float fscale = static_cast<float>(scale), fcap = static_cast<float>(softcap);

  // Work items are (sequence, kv head) pairs: the g query heads of a kv head share every K and V row
  // it loads.  Each thread takes one contiguous range of items with about the same number of keys.
  const int64_t items = b * kh;
  const int64_t threads = torch::stable::get_num_threads();
  const int64_t parts = std::max<int64_t>(1, std::min(items, threads));
  std::vector<int64_t> bounds{0};
  const int64_t total = std::accumulate(lens, lens + b, int64_t{0}) * kh;
  for (int64_t item = 0, keys = 0; item < items; ++item) {
    keys += lens[item / kh];
    if (static_cast<int64_t>(bounds.size()) < parts && keys * parts >= total * static_cast<int64_t>(bounds.size()))
      bounds.push_back(item + 1);
  }
  bounds.resize(parts + 1, items);

  torch::stable::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    if (half)
      attend_items(bounds[begin], bounds[end], qp, qs0, qs1, static_cast<const uint16_t*>(k_cache.const_data_ptr()),
                   static_cast<const uint16_t*>(v_cache.const_data_ptr()), tables, width, lens, max_len, kh, g, d, bs, h,
                   fscale, window, fcap, op_);
    else
      attend_items(bounds[begin], bounds[end], qp, qs0, qs1, k_cache.const_data_ptr<float>(),
                   v_cache.const_data_ptr<float>(), tables, width, lens, max_len, kh, g, d, bs, h, fscale, window, fcap,
                   op_);
  });
  return out;
}

// ----------------------------------------------------------------------------------- RMSNorm

Tensor add_rms_norm(const Tensor& x, const std::optional<Tensor>& residual, const Tensor& weight, double eps) {
  const char* op = "add_rms_norm";
  check_float(x, op, "x", 2);
  check_contiguous(x, op, "x");
  check_float(weight, op, "weight", 1);
  check_contiguous(weight, op, "weight");
  const int64_t t = x.size(0), hidden = x.size(1);
  CHECK(weight.size(0) == hidden, op, ": weight has ", weight.size(0), " elements, x's rows ", hidden);
  const float* rp = nullptr;
  if (residual.has_value()) {
    check_float(*residual, op, "residual", 2);
    check_contiguous(*residual, op, "residual");
    CHECK(residual->sizes() == x.sizes(), op, ": residual ", str(residual->sizes()), " and x ", str(x.sizes()),
          " differ");
    rp = residual->const_data_ptr<float>();
  }
  Tensor out = torch::stable::new_empty(x, {t, hidden});
  float* xp = x.mutable_data_ptr<float>();
  const float* wp = weight.const_data_ptr<float>();
  float* outp = out.mutable_data_ptr<float>();
  const float feps = static_cast<float>(eps);
  torch::stable::parallel_for(0, t, grain_rows(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* xr = xp + r * hidden;
      if (rp != nullptr) {
        const float* rr = rp + r * hidden;
        for (int64_t i = 0; i < hidden; ++i) xr[i] += rr[i];
      }
      const float inv = 1.0f / std::sqrt(dot(xr, xr, hidden) / static_cast<float>(hidden) + feps);
      float* orow = outp + r * hidden;
      // weight * (x * inv), rounded in the same order as the torch reference.
      for (int64_t i = 0; i < hidden; ++i) orow[i] = wp[i] * (xr[i] * inv);
    }
  });
  return out;
}

// ------------------------------------------------------------------------------- RoPE + KV write

void rope_and_write_kv(const Tensor& qkv, const Tensor& positions, const Tensor& cos, const Tensor& sin,
                       const Tensor& k_cache, const Tensor& v_cache, const Tensor& slots, int64_t num_heads) {
  const char* op = "rope_and_write_kv";
  check_float(qkv, op, "qkv", 3);
  check_contiguous(qkv, op, "qkv");
  check_float(cos, op, "cos", 2);
  check_float(sin, op, "sin", 2);
  check_contiguous(cos, op, "cos");
  check_contiguous(sin, op, "sin");
  const bool half_cache = check_kv_cache(k_cache, op, "k_cache");
  check_kv_cache(v_cache, op, "v_cache");
  CHECK(k_cache.scalar_type() == v_cache.scalar_type(), op, ": k_cache is ", k_cache.scalar_type(), ", v_cache ",
        v_cache.scalar_type());
  check_index(positions, op, "positions", 1);
  check_index(slots, op, "slots", 1);
  const int64_t t = qkv.size(0), total_heads = qkv.size(1), d = qkv.size(2);
  const int64_t kh = k_cache.size(2);
  CHECK(d % 2 == 0, op, ": head_dim must be even, got ", d);
  CHECK(total_heads == num_heads + 2 * kh, op, ": qkv has ", total_heads,
        " heads, expected num_heads + 2 * kv_heads = ", num_heads + 2 * kh);
  CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.size(3) == d, op, ": k_cache ", str(k_cache.sizes()),
        " and v_cache ", str(v_cache.sizes()), " must both be (blocks, block_size, ", kh, ", ", d, ")");
  CHECK(cos.sizes() == sin.sizes() && cos.size(1) == d, op, ": cos ", str(cos.sizes()), " and sin ", str(sin.sizes()),
        " must both be (positions, ", d, ")");
  CHECK(positions.size(0) == t && slots.size(0) == t, op, ": qkv has ", t, " rows, positions ", positions.size(0),
        ", slots ", slots.size(0));
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  const int64_t* slot = slots.const_data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1), num_pos = cos.size(0);
  for (int64_t r = 0; r < t; ++r) {
    CHECK(pos[r] >= 0 && pos[r] < num_pos, op, ": positions[", r, "] = ", pos[r], " is outside the RoPE table (0..",
          num_pos - 1, ")");
    CHECK(slot[r] >= 0 && slot[r] < num_slots, op, ": slots[", r, "] = ", slot[r], " is outside the cache (0..",
          num_slots - 1, ")");
  }
  float* xp = qkv.mutable_data_ptr<float>();
  const float* cp = cos.const_data_ptr<float>();
  const float* sp = sin.const_data_ptr<float>();
  void* kc = k_cache.mutable_data_ptr();
  void* vc = v_cache.mutable_data_ptr();
  const int64_t half = d / 2, rotated = num_heads + kh, kv_row = kh * d;
  torch::stable::parallel_for(0, t, grain_rows(total_heads * d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* c = cp + pos[r] * d;
      const float* s = sp + pos[r] * d;
      float* row = xp + r * total_heads * d;
      // x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1): q and k heads alike.
      for (int64_t hd = 0; hd < rotated; ++hd) {
        float* x = row + hd * d;
        int64_t i = 0;
#ifdef __AVX2__
        for (; i + 8 <= half; i += 8) {
          const __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + half + i);
          _mm256_storeu_ps(x + i, _mm256_sub_ps(_mm256_mul_ps(x1, _mm256_loadu_ps(c + i)),
                                                _mm256_mul_ps(x2, _mm256_loadu_ps(s + i))));
          _mm256_storeu_ps(x + half + i, _mm256_add_ps(_mm256_mul_ps(x2, _mm256_loadu_ps(c + half + i)),
                                                       _mm256_mul_ps(x1, _mm256_loadu_ps(s + half + i))));
        }
#endif
        for (; i < half; ++i) {
          const float x1 = x[i], x2 = x[half + i];
          x[i] = x1 * c[i] - x2 * s[i];
          x[half + i] = x2 * c[half + i] + x1 * s[half + i];
        }
      }
      if (half_cache) {
        float_to_kv(row + num_heads * d, kv_row, static_cast<uint16_t*>(kc) + slot[r] * kv_row);
        float_to_kv(row + rotated * d, kv_row, static_cast<uint16_t*>(vc) + slot[r] * kv_row);
      } else {
        float_to_kv(row + num_heads * d, kv_row, static_cast<float*>(kc) + slot[r] * kv_row);
        float_to_kv(row + rotated * d, kv_row, static_cast<float*>(vc) + slot[r] * kv_row);
      }
    }
  });
}

// -------------------------------------------------------------------------------------- SiLU

Tensor silu_and_mul(const Tensor& gate_up) {
  const char* op = "silu_and_mul";
  check_float(gate_up, op, "gate_up", 2);
  check_contiguous(gate_up, op, "gate_up");
  const int64_t t = gate_up.size(0), n = gate_up.size(1) / 2;
  CHECK(gate_up.size(1) % 2 == 0, op, ": gate_up's last dim must be even, got ", gate_up.size(1));
  Tensor out = torch::stable::new_empty(gate_up, {t, n});
  const float* in = gate_up.const_data_ptr<float>();
  float* outp = out.mutable_data_ptr<float>();
  torch::stable::parallel_for(0, t, grain_rows(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = in + r * 2 * n;
      const float* up = gate + n;
      float* o = outp + r * n;
      int64_t i = 0;
#ifdef __AVX2__
      const __m256 one = _mm256_set1_ps(1.0f);
      for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
      }
#endif
      for (; i < n; ++i) o[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
    }
  });
  return out;
}

}  // namespace

namespace infermesh_cpu {
Tensor paged_decode_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& block_tables,
                              const Tensor& context_lens, double scale, int64_t window, double softcap) {
  return ::paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, window, softcap);
}
Tensor add_rms_norm(const Tensor& x, const std::optional<Tensor>& residual, const Tensor& weight, double eps) {
  return ::add_rms_norm(x, residual, weight, eps);
}
void rope_and_write_kv(const Tensor& qkv, const Tensor& positions, const Tensor& cos, const Tensor& sin,
                       const Tensor& k_cache, const Tensor& v_cache, const Tensor& slots, int64_t num_heads) {
  ::rope_and_write_kv(qkv, positions, cos, sin, k_cache, v_cache, slots, num_heads);
}
Tensor silu_and_mul(const Tensor& gate_up) { return ::silu_and_mul(gate_up); }
}  // namespace infermesh_cpu

STABLE_TORCH_LIBRARY(infermesh, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale, int window=0, float softcap=0.0) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) x, Tensor? residual, Tensor weight, float eps) -> Tensor");
  m.def("rope_and_write_kv(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, Tensor(b!) k_cache, "
        "Tensor(c!) v_cache, Tensor slots, int num_heads) -> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(infermesh, CPU, m) {
  m.impl("paged_decode_attention", TORCH_BOX(&paged_decode_attention));
  m.impl("add_rms_norm", TORCH_BOX(&add_rms_norm));
  m.impl("rope_and_write_kv", TORCH_BOX(&rope_and_write_kv));
  m.impl("silu_and_mul", TORCH_BOX(&silu_and_mul));
}
