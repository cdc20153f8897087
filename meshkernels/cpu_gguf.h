// Shared by cpu_gguf.cpp (the op, small row counts), cpu_gguf_x.cpp (the activations) and cpu_gguf_amx.cpp
// (AMX tiles): the GGUF block kinds, their decoding, and the quantized activations.  Include after
// cpu_common.h, at global scope.
//
// Every kind decodes, per 32 weights (a "block" here; K-quants hold 8 of them in a 256-weight
// super-block), to 32 unsigned bytes u, a float scale a per "unit" and, for Q4_1 / Q4_K / Q5_K, a float c:
//   w[j] = a[unit(j)] * (u[j] - offset) + c
// A unit is the block (a Q6_K block has two 16-weight units with their own scales).  So each block's
// dot product with activations quantized per block (dx, qx) is
//   dx * (sum over units of a * (sum(u * qx) - offset * sum(qx)) + c * sum(qx))
// with the sums in exact int32 arithmetic.
#pragma once

namespace infermesh_gguf {

// GGML type ids (gguf-py's GGMLQuantizationType), the op's `kind`.
constexpr int64_t kQ4_1 = 3, kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;
constexpr int64_t kBlock = 32;          // weights per block, and per quantized activation block
constexpr int kChunk = 8;               // blocks decoded at a time: one K-quant super-block

// x (T, K) quantized per 32-element block as llama.cpp's Q8_0 activations are: dx = max|x| / 127,
// qx = round(x / dx) (to nearest even).
struct QuantizedX {
  int64_t t = 0, k = 0, nb = 0;
  std::vector<int8_t> q;                // (T, K)
  std::vector<float> d;                 // (T, nb) dx
  std::vector<int32_t> s16;             // (T, 2 nb) the sum of qx over each 16 elements
  std::vector<int32_t> s32;             // (T, nb) the sum of qx over each block
  std::vector<float> ds;                // (T, nb) dx * that sum (float), for the mins of Q4_1 / Q4_K / Q5_K
  // The coarse blocks (quantize_rows(..., fine = true); repacked products asked for them take them): where a block's
  // largest |x| is above kCoarse times its row's root mean square (an outlier channel, which leaves the
  // block's other elements a dx too coarse for them), that element is taken out of the block (the block's
  // qx and dx are the other 31's) and kept as a float: outlier (T, nb) its value, outlier_at (T, nb) its
  // index in the block, and bit r % 64 of fine_rows[b * words + r / 64] set.  words = 0: no coarse block.
  std::vector<float> outlier;
  std::vector<uint8_t> outlier_at;
  std::vector<uint64_t> fine_rows;      // (nb, words)
  int64_t words = 0;
  // Bit r: row r0 + r's block b is coarse, for `count` rows in one word (r0 a multiple of the rows a product
  // takes at once); 0 where no block is.
  uint32_t coarse(int64_t b, int64_t r0, int count) const {
    if (!words) return 0;
    return static_cast<uint32_t>((fine_rows[static_cast<size_t>(b * words + r0 / 64)] >> (r0 % 64)) &
                                 ((uint64_t{1} << count) - 1));
  }
};
constexpr double kCoarse = 5.0;

// x for cpu_gguf_amx.cpp's tiles (cpu_gguf_x.cpp builds it), per tile of W rows (T rounded up to 1, 2, 4, 8
// or 16: a C tile row's 16 int32 then hold 16 / W units' sums, so a few rows do not pay for 16) and group of
// G units (as many as fill A's 64 bytes of K and C's 16 int32 a row): B row k (4 bytes of K) has, in column
// i W + m, row m's 4 bytes where they lie in unit i of the group, else 0, so that C's column i W + m is
// unit i's product alone.  A unit is a block, or a Q6_K half-block (uk = 32 or 16 bytes of K).
constexpr int64_t kTile = 16;           // columns of W per AMX tile, and at most 16 rows of x
struct TiledX {
  int64_t tiles = 0, nb = 0, units = 0, groups = 0, width = 0, g = 0, uk = 0;
  std::vector<int8_t> b;     // (tiles, groups, G uk / 4, G W, 4)
  std::vector<float> dx;     // (tiles, groups, 16): lane l the dx of unit (l / W) % G's block, row l % W
  std::vector<float> ds;     // likewise dx * sum(qx) of the block, for Q4_1 / Q4_K / Q5_K's mins
};
constexpr int64_t group_of(int64_t uk, int64_t w) { return std::min<int64_t>(64 / uk, kTile / w); }
TiledX tile_x(const QuantizedX& qx, int64_t uk, bool mins);

// Fills `out` from x (T, K) (cpu_gguf_x.cpp); `fine`: with the coarse blocks' outliers taken out.
void quantize_rows(const float* x, int64_t t, int64_t k, QuantizedX& out, bool fine = false);
// qx's outliers as activations of their own (each +-127 with dx = |value| / 127, zeros elsewhere), for a
// product that does not take them (the last N % 16 rows of a repacked weight, multiplied as the file has them).
QuantizedX outlier_blocks(const QuantizedX& qx);
// Whether this build has the AMX path and the OS lets this process use AMX tiles (asked once).
bool amx_usable();
// out (T, N) = x W^T by AMX-INT8 tiles; w is N rows of K / 32 blocks of `kind`.
void amx_linear(int64_t kind, const QuantizedX& qx, const uint8_t* w, int64_t n, float* out);
// The same for more than 8 rows (cpu_gguf_amx16.cpp), which amx_linear hands over.
void amx_linear_wide(int64_t kind, const QuantizedX& qx, const uint8_t* w, int64_t n, float* out);
// out (T, N) = x W^T for Q4_K / Q6_K at 1 to kQ8KRows rows with x quantized per 256 (cpu_gguf_q8k.cpp);
// false (nothing done) for other kinds and row counts, and in builds without AVX512-VNNI.
constexpr int64_t kQ8KRows = 4;
bool q8k_linear(int64_t kind, const float* x, int64_t t, int64_t k, const uint8_t* w, int64_t n, float* out);
// Weights repacked 16 columns at a time (cpu_gguf_r16.cpp): gguf_linear's kind + kRepacked names them.
constexpr int64_t kCols = 16, kRepacked = 256;
// kind + kRepacked + kOutliers: the same, with the coarse blocks' outliers kept as floats (QuantizedX::outlier).
constexpr int64_t kOutliers = 512;
// out (T, N) = x W^T over W's first 16 * (N / 16) rows, repacked; false for a kind it lacks.
bool r16_linear(int64_t kind, const QuantizedX& qx, const uint8_t* w, int64_t n, float* out);
// N rows of `row_bytes` at src, the file's layout, repacked into dst (forward), or back; false for a kind it lacks.
bool r16_repack(int64_t kind, const uint8_t* src, int64_t n, int64_t row_bytes, uint8_t* dst, bool forward);

}  // namespace infermesh_gguf

namespace {

using namespace infermesh_gguf;

template <int64_t KIND>
struct Kind;
template <>
struct Kind<kQ8_0> {    // 34 bytes: fp16 d, 32 int8 q; w = d * q
  static constexpr int64_t bytes = 34, weights = 32, offset = 128;
  static constexpr bool halves = false, mins = false;
};
template <>
struct Kind<kQ4_1> {    // 20 bytes: fp16 d, fp16 m, 16 bytes qs; w = d * q + m (c = m, per block)
  static constexpr int64_t bytes = 20, weights = 32, offset = 0;
  static constexpr bool halves = false, mins = true;
};
template <>
struct Kind<kQ5_0> {    // 22 bytes: fp16 d, uint32 qh, 16 bytes qs; w = d * (q - 16)
  static constexpr int64_t bytes = 22, weights = 32, offset = 16;
  static constexpr bool halves = false, mins = false;
};
template <>
struct Kind<kQ4_K> {    // 144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes qs
  static constexpr int64_t bytes = 144, weights = 256, offset = 0;
  static constexpr bool halves = false, mins = true;
};
template <>
struct Kind<kQ5_K> {    // 176 bytes: as Q4_K, with 32 bytes qh (the 5th bits) before qs
  static constexpr int64_t bytes = 176, weights = 256, offset = 0;
  static constexpr bool halves = false, mins = true;
};
template <>
struct Kind<kQ6_K> {    // 210 bytes: 128 bytes ql, 64 bytes qh, 16 int8 scales, fp16 d; w = d * sc * (q - 32)
  static constexpr int64_t bytes = 210, weights = 256, offset = 32;
  static constexpr bool halves = true, mins = false;
};

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return half_bits_to_float(h);
}

// Q4_K / Q5_K's eight 6-bit scales sc[8] and mins m[8] from their 12 bytes s (gguf-py's get_scale_min):
// sc[j] = s[j] & 63, m[j] = s[j + 4] & 63 for j < 4; sc[j] = s[j + 4] & 15 | (s[j - 4] >> 6) << 4,
// m[j] = s[j + 4] >> 4 | (s[j] >> 6) << 4 for j >= 4.  Four bytes at a time, as llama.cpp unpacks them.
inline void scales_mins_k4(const uint8_t* s, uint8_t* sc, uint8_t* m) {
  uint32_t w[3];
  std::memcpy(w, s, 12);
  const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, low2 = 0x03030303;
  const uint32_t out[4] = {w[0] & low6, (w[2] & low4) | (((w[0] >> 6) & low2) << 4), w[1] & low6,
                           ((w[2] >> 4) & low4) | (((w[1] >> 6) & low2) << 4)};
  std::memcpy(sc, out, 8);
  std::memcpy(m, out + 2, 8);
}

// v[j] = scale * (float) b[j] for 8 unsigned (or int8, SIGNED_BYTES) bytes, to v[j * stride].
template <bool SIGNED_BYTES>
inline void scale_bytes(const uint8_t* b, float scale, float* v, int64_t stride) {
#if defined(__AVX2__)
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b));
  const __m256 f = _mm256_mul_ps(_mm256_set1_ps(scale), _mm256_cvtepi32_ps(SIGNED_BYTES ? _mm256_cvtepi8_epi32(bytes)
                                                                                      : _mm256_cvtepu8_epi32(bytes)));
  if (stride == 1) {
    _mm256_storeu_ps(v, f);
    return;
  }
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, f);
  for (int j = 0; j < 8; ++j) v[j * stride] = tmp[j];
#else
  for (int j = 0; j < 8; ++j)
    v[j * stride] = scale * static_cast<float>(SIGNED_BYTES ? static_cast<int8_t>(b[j]) : b[j]);
#endif
}

#if defined(__AVX2__)
inline void store32(uint8_t* dst, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), v); }
inline __m256i load32(const uint8_t* src) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)); }

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

// Decodes `blocks` blocks (all 8 of a super-block for K-quants) starting at w: block j's 32 bytes to
// u + j * us (u - offset as int8 when SIGNED), unit i's scale to a[i * as] (one unit a block, two for
// Q6_K), and for Q4_1 / Q4_K / Q5_K block j's c to c[j * cs].
template <int64_t KIND, bool SIGNED>
inline void decode(const uint8_t* w, int blocks, uint8_t* u, int64_t us, float* a, int64_t as, float* c, int64_t cs) {
  using K = Kind<KIND>;
  if constexpr (KIND == kQ4_1) {       // offset 0: u is the same signed or not
    for (int j = 0; j < blocks; ++j, w += K::bytes, u += us) {
      a[j * as] = half_at(w);
      c[j * cs] = half_at(w + 2);
#if defined(__AVX2__)
      const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 4));
      const __m128i low = _mm_set1_epi8(0x0F);
      store32(u, _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), low), _mm_and_si128(qs, low)));
#else
      for (int l = 0; l < 32; ++l) u[l] = static_cast<uint8_t>((w[4 + l % 16] >> (l < 16 ? 0 : 4)) & 15);
#endif
    }
  } else if constexpr (KIND == kQ8_0 || KIND == kQ5_0) {
    (void)c;
    (void)cs;
    for (int j = 0; j < blocks; ++j, w += K::bytes, u += us) {
      a[j * as] = half_at(w);
#if defined(__AVX2__)
      __m256i v;
      if constexpr (KIND == kQ8_0) {
        v = load32(w + 2);
        if constexpr (!SIGNED) v = _mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x80)));
      } else {
        v = q5_unsigned(w);
        if constexpr (SIGNED) v = _mm256_sub_epi8(v, _mm256_set1_epi8(16));
      }
      store32(u, v);
#else
      uint32_t qh = 0;
      if constexpr (KIND == kQ5_0) std::memcpy(&qh, w + 2, 4);
      for (int l = 0; l < 32; ++l) {
        int q;
        if constexpr (KIND == kQ8_0)
          q = static_cast<int8_t>(w[2 + l]) + 128;
        else
          q = ((w[6 + l % 16] >> (l < 16 ? 0 : 4)) & 15) | (((qh >> l) & 1) << 4);
        u[l] = static_cast<uint8_t>(SIGNED ? q - K::offset : q);
      }
#endif
    }
  } else if constexpr (KIND == kQ4_K || KIND == kQ5_K) {
    (void)blocks;
    const float d = half_at(w), dmin = half_at(w + 2);
    const uint8_t* scales = w + 4;
    const uint8_t* qh = w + 16;
    const uint8_t* qs = w + (KIND == kQ5_K ? 48 : 16);
    uint8_t sc[8], m[8];
    scales_mins_k4(scales, sc, m);
    scale_bytes<false>(sc, d, a, as);
    scale_bytes<false>(m, -dmin, c, cs);      // -(dmin * m), exactly: negation commutes with rounding
#if defined(__AVX2__)
    const __m256i low = _mm256_set1_epi8(0x0F);
    [[maybe_unused]] const __m256i high = KIND == kQ5_K ? load32(qh) : _mm256_setzero_si256();
    for (int g = 0; g < 4; ++g) {
      const __m256i v = load32(qs + 32 * g);
      __m256i q[2] = {_mm256_and_si256(v, low), _mm256_and_si256(_mm256_srli_epi16(v, 4), low)};
      for (int s = 0; s < 2; ++s) {
        if constexpr (KIND == kQ5_K) {   // bit j of qh[l] is the 5th bit of sub-block j's element l
          const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(high, 2 * g + s), _mm256_set1_epi8(1));
          q[s] = _mm256_or_si256(q[s], _mm256_slli_epi16(bit, 4));
        }
        store32(u + (2 * g + s) * us, q[s]);
      }
    }
#else
    for (int j = 0; j < 8; ++j)
      for (int l = 0; l < 32; ++l) {
        int q = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 15;
        if constexpr (KIND == kQ5_K) q |= ((qh[l] >> j) & 1) << 4;
        u[j * us + l] = static_cast<uint8_t>(q);
      }
#endif
  } else {   // Q6_K: element 128 h + 32 g + l (block 4 h + g) is ql[64 h + 32 (g & 1) + l] >> 4 (g >> 1)'s
             // 4 bits and (qh[32 h + l] >> 2 g) & 3 above them
    (void)blocks;
    (void)c;
    (void)cs;
    const uint8_t* ql = w;
    const uint8_t* qh = w + 128;
    const float d = half_at(w + 208);
    scale_bytes<true>(w + 192, d, a, as);
    scale_bytes<true>(w + 200, d, a + 8 * as, as);
    for (int h = 0; h < 2; ++h) {
#if defined(__AVX2__)
      const __m256i low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
      const __m256i l0 = load32(ql + 64 * h), l1 = load32(ql + 64 * h + 32), hv = load32(qh + 32 * h);
      const __m256i hi[4] = {_mm256_and_si256(_mm256_slli_epi16(hv, 4), top),
                             _mm256_and_si256(_mm256_slli_epi16(hv, 2), top), _mm256_and_si256(hv, top),
                             _mm256_and_si256(_mm256_srli_epi16(hv, 2), top)};
      const __m256i lo[4] = {_mm256_and_si256(l0, low), _mm256_and_si256(l1, low),
                             _mm256_and_si256(_mm256_srli_epi16(l0, 4), low),
                             _mm256_and_si256(_mm256_srli_epi16(l1, 4), low)};
      for (int g = 0; g < 4; ++g) {
        __m256i q = _mm256_or_si256(lo[g], hi[g]);
        if constexpr (SIGNED) q = _mm256_sub_epi8(q, _mm256_set1_epi8(32));
        store32(u + (4 * h + g) * us, q);
      }
#else
      for (int g = 0; g < 4; ++g)
        for (int l = 0; l < 32; ++l) {
          const int q = ((ql[64 * h + 32 * (g & 1) + l] >> (4 * (g >> 1))) & 15) |
                        (((qh[32 * h + l] >> (2 * g)) & 3) << 4);
          u[(4 * h + g) * us + l] = static_cast<uint8_t>(SIGNED ? q - 32 : q);
        }
#endif
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// Q4_1 blocks at w and w + 20 as 64 bytes q (0..15), straight from registers: each block's 16 bytes qs
// broadcast to two 128-bit lanes, the second lane's shifted to its high nibbles.
inline __m512i q4_1_pair(const uint8_t* w) {
  __m512i z = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 4)));
  z = _mm512_mask_broadcast_i32x4(z, 0xFF00, _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 24)));
  return _mm512_and_si512(_mm512_srlv_epi64(z, _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4)), _mm512_set1_epi8(0x0F));
}

// Q5_0 blocks at w and w + 22 as 64 signed bytes q - 16, straight from registers: the 16 bytes qs of each
// block broadcast to two 128-bit lanes, the second lane's shifted to its high nibbles, and the 5th bits
// (qh as a byte mask) keep the nibble where set and take 16 off where clear.
inline __m512i q5_pair_signed(const uint8_t* w) {
  __m512i z = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 6)));
  z = _mm512_mask_broadcast_i32x4(z, 0xFF00, _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 28)));
  z = _mm512_and_si512(_mm512_srlv_epi64(z, _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4)), _mm512_set1_epi8(0x0F));
  uint32_t h0, h1;
  std::memcpy(&h0, w + 2, 4);
  std::memcpy(&h1, w + 24, 4);
  const __mmask64 high = static_cast<uint64_t>(h0) | static_cast<uint64_t>(h1) << 32;
  return _mm512_mask_sub_epi8(z, static_cast<__mmask64>(~high), z, _mm512_set1_epi8(16));
}

// One Q4_K / Q6_K super-block at w: its 256 signed bytes to a (64 at a time, two blocks per register), its
// units' scales to scale and Q4_K's -dmin * m to mins.  Other kinds: cpu_gguf.h's decode.
template <int64_t KIND>
inline void decode_super(const uint8_t* w, int8_t* a, float* scale, float* mins) {
  if constexpr (KIND == kQ4_K) {            // blocks 2 g and 2 g + 1: qs[32 g + l]'s low and high nibbles
    uint8_t sc[8], m[8];
    scales_mins_k4(w + 4, sc, m);
    scale_bytes<false>(sc, half_at(w), scale, 1);
    scale_bytes<false>(m, -half_at(w + 2), mins, 1);
    for (int g = 0; g < 4; ++g) {
      const __m512i v = _mm512_broadcast_i64x4(load32(w + 16 + 32 * g));
      const __m512i nibbles = _mm512_srlv_epi64(v, _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4));
      _mm512_storeu_si512(a + 64 * g, _mm512_and_si512(nibbles, _mm512_set1_epi8(0x0F)));
    }
  } else if constexpr (KIND == kQ6_K) {     // blocks 4 h + g (cpu_gguf.h's decode): 4 low bits from ql, 2 from qh
    (void)mins;
    _mm512_storeu_ps(scale, _mm512_mul_ps(_mm512_set1_ps(half_at(w + 208)),
                                          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 192))))));
    const __m512i low = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30), offset = _mm512_set1_epi8(32);
    for (int h = 0; h < 2; ++h) {
      const __m512i ql = _mm512_loadu_si512(w + 64 * h);
      const __m512i qh = _mm512_broadcast_i64x4(load32(w + 128 + 32 * h));
      const __m512i hi01 = _mm512_and_si512(_mm512_sllv_epi64(qh, _mm512_setr_epi64(4, 4, 4, 4, 2, 2, 2, 2)), top);
      const __m512i hi23 = _mm512_and_si512(_mm512_srlv_epi64(qh, _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2)), top);
      const __m512i ql4 = _mm512_srli_epi64(ql, 4);     // 0xEC: (ql & low) | hi
      _mm512_storeu_si512(a + 128 * h, _mm512_sub_epi8(_mm512_ternarylogic_epi64(ql, hi01, low, 0xEC), offset));
      _mm512_storeu_si512(a + 128 * h + 64, _mm512_sub_epi8(_mm512_ternarylogic_epi64(ql4, hi23, low, 0xEC), offset));
    }
  } else {
    decode<KIND, true>(w, kChunk, reinterpret_cast<uint8_t*>(a), kBlock, scale, 1, mins, 1);
  }
}
#endif

}  // namespace
