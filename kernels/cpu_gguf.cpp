// GGUF Q8_0 / Q5_0 weight blocks, exactly as a GGUF file stores them, times int8-quantized activations
// (as llama.cpp multiplies them); built with cpu_ops.cpp into one library by kernels/cpu_ops.py.
//
// gguf_linear(x (T, K) float32, blocks (N, K/32 * bytes) uint8, kind, out (T, N)! float32):
//   out = x W^T where W's rows are N rows of K/32 blocks of kind 8 (Q8_0) or 5 (Q5_0).
//
// Block layouts (gguf-py's gguf.quants dequantizes them; kernels/gguf_blocks.py is the torch reference):
//   Q8_0: 34 bytes = fp16 d, 32 int8 q; weight j is d * q[j].
//   Q5_0: 22 bytes = fp16 d, uint32 qh (little-endian), 16 bytes qs; element j < 16 has the 4 low bits
//         qs[j] & 15, element j + 16 has qs[j] >> 4, and element i's 5th bit is (qh >> i) & 1; weight i
//         is d * (q[i] - 16).
//
// x is quantized once per call, per row and per 32-element block, as llama.cpp's Q8_0 activations are:
// dx = max|x| / 127, qx = round(x * (1 / dx)) (to nearest even), kept with a float32 dx (not fp16).  Each
// block's integer dot product sum(q_w * qx) is exact in int32; the row's sum adds dw * dx * dot in float.
//
// The unsigned-by-signed byte products (VNNI's dpbusd, AVX2's maddubs) take the weight as the unsigned
// operand with an offset: Q5_0's q in 0..31 (offset 16), Q8_0's q + 128 (q ^ 0x80, offset 128) under VNNI;
// the offset times the block's sum of qx, precomputed per activation block, is taken off in the integer
// sum.  AVX2's maddubs would saturate Q8_0's offset pairs, so that path moves the weight's sign onto
// qx instead (|q| unsigned, sign(qx, q)), as llama.cpp does.
//
// Paths: VNNI (AVX512-VNNI + VL's 256-bit dpbusd, else AVX-VNNI), AVX2, portable scalar; kernels/cpu_ops.py
// picks the flags.

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

constexpr int64_t kBlock = 32;
constexpr int64_t kQ8Bytes = 34;
constexpr int64_t kQ5Bytes = 22;
#if defined(__AVX512F__)
constexpr int kRows = 8;          // rows of x multiplied by one decoded weight block at a time
#else
constexpr int kRows = 4;
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define GGUF_DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif defined(__AVXVNNI__)
#define GGUF_DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// Two blocks per 512-bit vector: lanes 0-7 hold block b's partial sums, lanes 8-15 block b + 1's.
#define GGUF_ZMM 1
#endif

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return half_bits_to_float(h);
}

// The activations, quantized: per row K int8 q, and per block the float scale and -offset * sum(q).
struct QuantizedX {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> corr;
#if defined(GGUF_ZMM)
  // Per row and pair of blocks (the last one half empty when K / 32 is odd), 16 lanes each: the dot
  // products' starting values (corr in lanes 0 and 8, else 0) and the scales dx (lanes 0-7 block b's,
  // 8-15 block b + 1's).
  std::vector<int32_t> init;
  std::vector<float> scale;
#endif
};

void quantize_rows(const float* x, int64_t t, int64_t k, int32_t offset, QuantizedX& out) {
  const int64_t nb = k / kBlock;
  out.q.resize(static_cast<size_t>(t * k));
  out.d.resize(static_cast<size_t>(t * nb));
  out.corr.resize(static_cast<size_t>(t * nb));
  for (int64_t i = 0; i < t * nb; ++i) {
    const float* xb = x + i * kBlock;
    int8_t* qb = out.q.data() + i * kBlock;
    float amax = 0.0f;
    for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    int32_t sum = 0;
#if defined(__AVX2__)
    const __m256 idv = _mm256_set1_ps(id);
    __m256i v[4];
    for (int h = 0; h < 4; ++h)     // cvtps_epi32 rounds to nearest even (MXCSR's default)
      v[h] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * h), idv));
    // packs interleave 128-bit lanes: (0,1) -> 0 2 1 3 order in 32-bit groups; permute back.
    const __m256i w16a = _mm256_packs_epi32(v[0], v[1]), w16b = _mm256_packs_epi32(v[2], v[3]);
    __m256i w8 = _mm256_packs_epi16(w16a, w16b);
    w8 = _mm256_permutevar8x32_epi32(w8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), w8);
    for (int j = 0; j < kBlock; ++j) sum += qb[j];
#else
    for (int j = 0; j < kBlock; ++j) {
      qb[j] = static_cast<int8_t>(std::nearbyint(xb[j] * id));
      sum += qb[j];
    }
#endif
    out.d[static_cast<size_t>(i)] = d;
    out.corr[static_cast<size_t>(i)] = -offset * sum;
  }
#if defined(GGUF_ZMM)
  const int64_t pairs = (nb + 1) / 2;
  out.init.assign(static_cast<size_t>(t * pairs * 16), 0);
  out.scale.assign(static_cast<size_t>(t * pairs * 16), 0.0f);
  for (int64_t r = 0; r < t; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const size_t at = static_cast<size_t>((r * pairs + b / 2) * 16 + (b % 2) * 8);
      out.init[at] = out.corr[static_cast<size_t>(r * nb + b)];
      std::fill_n(out.scale.begin() + static_cast<std::ptrdiff_t>(at), 8, out.d[static_cast<size_t>(r * nb + b)]);
    }
#endif
}

#if defined(__AVX2__)
inline float hsum8(__m256 s) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
}

// Q5_0's 32 unsigned 5-bit q (0..31) in byte order 0..31.
inline __m256i q5_unsigned(const uint8_t* blk) {
  uint32_t qh;
  std::memcpy(&qh, blk + 2, 4);
  const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 6));
  const __m128i low = _mm_set1_epi8(0x0F);
  const __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), low), _mm_and_si128(qs, low));
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  const __m256i bits = _mm256_maskz_mov_epi8(qh, _mm256_set1_epi8(0x10));
#else
  // byte i = 0xFF where bit i of qh is set (llama.cpp's bytes_from_bits_32)
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(qh)), shuf);
  bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  const __m256i bits = _mm256_and_si256(_mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
#endif
  return _mm256_or_si256(nib, bits);
}
#endif

// out[r * ldo] = x[r] . W[n] for R rows of quantized x starting at row r0, W[n] being nb blocks at w.
template <int R, bool Q8>
inline void dot_rows(const QuantizedX& qx, int64_t r0, int64_t nb, const uint8_t* w, float* out, int64_t ldo) {
  const int64_t bytes = Q8 ? kQ8Bytes : kQ5Bytes;
  const int8_t* q = qx.q.data() + r0 * nb * kBlock;
  const float* dx = qx.d.data() + r0 * nb;
  const int32_t* corr = qx.corr.data() + r0 * nb;
#if defined(GGUF_ZMM)
  (void)dx;
  (void)corr;
  const int64_t pairs = (nb + 1) / 2;
  const int32_t* init = qx.init.data() + r0 * pairs * 16;
  const float* scale = qx.scale.data() + r0 * pairs * 16;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p, w += 2 * bytes) {
    const bool two = 2 * p + 1 < nb;       // else the last block alone, the upper half zero
    const __m512 dw = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(half_at(w)),
                                           _mm512_set1_ps(two ? half_at(w + bytes) : 0.0f));
    __m512i u;
    if constexpr (Q8) {
      const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
      const __m256i lo = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 2)), flip);
      const __m256i hi = two ? _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + bytes + 2)),
                                                flip)
                             : _mm256_setzero_si256();
      u = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    } else {
      u = _mm512_inserti64x4(_mm512_castsi256_si512(q5_unsigned(w)),
                             two ? q5_unsigned(w + bytes) : _mm256_setzero_si256(), 1);
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* xs = q + (r * nb + 2 * p) * kBlock;
      const __m512i s = two ? _mm512_loadu_si512(xs)
                            : _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs)));
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_loadu_si512(init + (r * pairs + p) * 16), u, s);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, _mm512_loadu_ps(scale + (r * pairs + p) * 16)),
                               acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r * ldo] = _mm512_reduce_add_ps(acc[r]);
#elif defined(__AVX2__)
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
#if !defined(GGUF_DPBUSD)
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  for (int64_t b = 0; b < nb; ++b, w += bytes) {
    const float dw = half_at(w);
#if defined(GGUF_DPBUSD)
    const __m256i u = Q8 ? _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 2)),
                                            _mm256_set1_epi8(static_cast<char>(0x80)))
                         : q5_unsigned(w);
    for (int r = 0; r < R; ++r) {
      const __m256i s = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (r * nb + b) * kBlock));
      const __m256i init = _mm256_zextsi128_si256(_mm_cvtsi32_si128(corr[r * nb + b]));
      const __m256i dot = GGUF_DPBUSD(init, u, s);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dw * dx[r * nb + b]), acc[r]);
    }
#else
    if constexpr (Q8) {
      const __m256i wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 2));
      const __m256i aw = _mm256_sign_epi8(wq, wq);       // |q| as unsigned: -128 -> 128
      for (int r = 0; r < R; ++r) {
        const __m256i s = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (r * nb + b) * kBlock));
        const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(s, wq)), ones);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dw * dx[r * nb + b]), acc[r]);
      }
    } else {
      const __m256i u = q5_unsigned(w);
      for (int r = 0; r < R; ++r) {
        const __m256i s = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (r * nb + b) * kBlock));
        __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), ones);     // pairs: 2 * 31 * 127, no saturation
        dot = _mm256_add_epi32(dot, _mm256_zextsi128_si256(_mm_cvtsi32_si128(corr[r * nb + b])));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dw * dx[r * nb + b]), acc[r]);
      }
    }
#endif
  }
  for (int r = 0; r < R; ++r) out[r * ldo] = hsum8(acc[r]);
#else
  (void)corr;
  float acc[R] = {};
  int32_t wq[kBlock];
  for (int64_t b = 0; b < nb; ++b, w += bytes) {
    const float dw = half_at(w);
    if constexpr (Q8) {
      for (int j = 0; j < kBlock; ++j) wq[j] = static_cast<int8_t>(w[2 + j]);
    } else {
      uint32_t qh;
      std::memcpy(&qh, w + 2, 4);
      for (int j = 0; j < 16; ++j) {
        wq[j] = static_cast<int32_t>((w[6 + j] & 15) | (((qh >> j) & 1) << 4)) - 16;
        wq[j + 16] = static_cast<int32_t>((w[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16;
      }
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* s = q + (r * nb + b) * kBlock;
      int32_t dot = 0;
      for (int j = 0; j < kBlock; ++j) dot += wq[j] * s[j];
      acc[r] += dw * dx[r * nb + b] * static_cast<float>(dot);
    }
  }
  for (int r = 0; r < R; ++r) out[r * ldo] = acc[r];
#endif
}

// A row count below kRows for the remainder's dispatch (counts at or above kRows never reach it).
constexpr int tail(int rows) { return rows < kRows ? rows : 1; }

template <bool Q8>
void column(const QuantizedX& qx, int64_t t, int64_t nb, const uint8_t* w, float* out, int64_t n) {
  int64_t r = 0;
  for (; r + kRows <= t; r += kRows) dot_rows<kRows, Q8>(qx, r, nb, w, out + r * n, n);
  switch (t - r) {
    case 7: dot_rows<tail(7), Q8>(qx, r, nb, w, out + r * n, n); break;
    case 6: dot_rows<tail(6), Q8>(qx, r, nb, w, out + r * n, n); break;
    case 5: dot_rows<tail(5), Q8>(qx, r, nb, w, out + r * n, n); break;
    case 4: dot_rows<tail(4), Q8>(qx, r, nb, w, out + r * n, n); break;
    case 3: dot_rows<3, Q8>(qx, r, nb, w, out + r * n, n); break;
    case 2: dot_rows<2, Q8>(qx, r, nb, w, out + r * n, n); break;
    case 1: dot_rows<1, Q8>(qx, r, nb, w, out + r * n, n); break;
    default: break;
  }
}

void gguf_linear(const Tensor& x, const Tensor& blocks, int64_t kind, const Tensor& out) {
  const char* op = "gguf_linear";
  CHECK(kind == 8 || kind == 5, op, ": kind must be 8 (Q8_0) or 5 (Q5_0), got ", kind);
  check_float(x, op, "x", 2);
  check_contiguous(x, op, "x");
  check_tensor(blocks, ScalarType::Byte, "uint8", op, "blocks", 2);
  check_contiguous(blocks, op, "blocks");
  check_float(out, op, "out", 2);
  check_contiguous(out, op, "out");
  const bool q8 = kind == 8;
  const int64_t t = x.size(0), k = x.size(1), n = blocks.size(0), bytes = q8 ? kQ8Bytes : kQ5Bytes;
  CHECK(k % kBlock == 0, op, ": in_features ", k, " is not a multiple of ", kBlock);
  const int64_t nb = k / kBlock;
  CHECK(blocks.size(1) == nb * bytes, op, ": blocks ", str(blocks.sizes()), " do not hold rows of ", nb, " ",
        q8 ? "Q8_0" : "Q5_0", " blocks of ", bytes, " bytes (in_features ", k, ")");
  CHECK(out.size(0) == t && out.size(1) == n, op, ": out must have shape (", t, ", ", n, "), got ",
        str(out.sizes()));
  if (t == 0 || n == 0) return;
  QuantizedX qx;
  quantize_rows(x.const_data_ptr<float>(), t, k, q8 ? 128 : 16, qx);
  const uint8_t* wp = blocks.const_data_ptr<uint8_t>();
  float* yp = out.mutable_data_ptr<float>();
  // Output features split evenly across threads; each thread streams its rows of W once.
  const int64_t threads = std::max<int64_t>(1, torch::stable::get_num_threads());
  const int64_t grain = std::max<int64_t>(16, (n + threads - 1) / threads);
  torch::stable::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      if (q8)
        column<true>(qx, t, nb, wp + j * nb * bytes, yp + j, n);
      else
        column<false>(qx, t, nb, wp + j * nb * bytes, yp + j, n);
    }
  });
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(infermesh, m) {
  m.def("gguf_linear(Tensor x, Tensor blocks, int kind, Tensor(a!) out) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(infermesh, CPU, m) {
  m.impl("gguf_linear", TORCH_BOX(&gguf_linear));
}
