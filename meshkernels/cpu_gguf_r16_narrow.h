// cpu_gguf_r16.cpp's products for builds without AVX-512 VNNI: AVX2 (with AVX-VNNI or AVX512-VNNI on 256 bits
// where the build has it, else maddubs) 8 columns at a time, and the portable loop that reads the layout weight
// by weight.  Included by cpu_gguf_r16.cpp alone, inside its anonymous namespace (its prefetch_ahead,
// kRowsAtOnce and the layout of cpu_gguf_r16.h come before).
#pragma once

#if defined(__AVX2__)

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define R16_DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif defined(__AVXVNNI__)
#define R16_DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#endif

inline __m256 halves8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
// 0x10 in byte i where bit i of m is set.
inline __m256i bits16(uint32_t m) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  return _mm256_maskz_mov_epi8(m, _mm256_set1_epi8(0x10));
#else
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(m)), shuf);
  bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
#endif
}

// acc += u . s per 4 bytes (u unsigned, s signed), exact: the products pair_sums() takes one at a time, so VNNI's
// dpbusd, or without it Q8_0's maddubs: u is q + 128 and would saturate maddubs' pairs, so q's sign moves onto s
// (|q| unsigned) and no offset is taken off after.
template <int64_t KIND>
inline __m256i dot4(__m256i acc, __m256i u, __m256i s) {
#if defined(R16_DPBUSD)
  return R16_DPBUSD(acc, u, s);
#else
  static_assert(KIND == kQ8_0, "without VNNI the other kinds add several products in 16 bits (pair_sums)");
  const __m256i q = _mm256_xor_si256(u, _mm256_set1_epi8(static_cast<char>(0x80)));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(s, q)),
                                                 _mm256_set1_epi16(1)));
#endif
}

// maddubs' 16-bit pair sums of one product are at most 2 * top * 127 (top: the largest unsigned weight), so
// several products' pairs add exactly in 16 bits before one madd widens them: 8 for 4-bit weights, 4 for 5-bit,
// 2 for Q6_K's 6 bits; Q8_0's (|q| up to 128 against the sign moved onto qx) take one each.  1 with VNNI (dpbusd
// sums four bytes into 32 bits itself).
template <int64_t KIND>
constexpr int pair_sums() {
#if defined(R16_DPBUSD)
  return 1;
#else
  constexpr int top = KIND == kQ8_0 ? 128 : KIND == kQ6_K ? 63 : five_bits<KIND>() ? 31 : 15;
  constexpr int sums = 32767 / (2 * top * 127);
  return sums >= 8 ? 8 : sums >= 4 ? 4 : sums >= 2 ? 2 : 1;
#endif
}

// The offset the integer sums still carry (all but Q8_0 without VNNI), taken off by starting them at
// -offset * sum(qx).
template <int64_t KIND>
constexpr int64_t offset_left() {
#if defined(R16_DPBUSD)
  return Kind<KIND>::offset;
#else
  return KIND == kQ8_0 ? 0 : Kind<KIND>::offset;
#endif
}

// Weights 4 g .. 4 g + 3 (lo) and 16 + 4 g .. (hi) of block j of the unit at w, columns 8 half .. 8 half + 7.
template <int64_t KIND>
inline void decode8(const uint8_t* w, int j, int g, int half, __m256i& lo, __m256i& hi) {
  const int64_t at = 32 * half;
  if constexpr (KIND == kQ8_0) {
    lo = load32(w + 128 * g + at);
    hi = load32(w + 128 * g + 64 + at);
  } else {
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i v = load32(w + 256 * j + 64 * g + at);
    lo = _mm256_and_si256(v, low);
    hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    if constexpr (five_bits<KIND>()) {
      uint32_t m[2];
      std::memcpy(&m[0], w + R16<KIND>::masks + 64 * j + 16 * g + 4 * half, 4);
      std::memcpy(&m[1], w + R16<KIND>::masks + 64 * j + 16 * g + 8 + 4 * half, 4);
      lo = _mm256_or_si256(lo, bits16(m[0]));
      hi = _mm256_or_si256(hi, bits16(m[1]));
    }
    if constexpr (KIND == kQ6_K) {
      const __m256i mask = _mm256_set1_epi8(0x30);
      const __m256i t0 = load32(w + R16<kQ6_K>::high + 128 * j + at);
      const __m256i t1 = load32(w + R16<kQ6_K>::high + 128 * j + 64 + at);
      const int left = 4 - 2 * g;      // bits 2 g, 2 g + 1 to bits 4, 5
      const __m256i tl = left >= 0 ? _mm256_slli_epi16(t0, left) : _mm256_srli_epi16(t0, -left);
      const __m256i th = left >= 0 ? _mm256_slli_epi16(t1, left) : _mm256_srli_epi16(t1, -left);
      lo = _mm256_or_si256(lo, _mm256_and_si256(tl, mask));
      hi = _mm256_or_si256(hi, _mm256_and_si256(th, mask));
    }
  }
}

// What a unit's blocks share in columns 8 half .. 8 half + 7: a K-quant's super-block scales (Q4_K / Q5_K: d,
// -dmin and the 6-bit scales and mins as bytes; Q6_K: d).
struct UnitScales8 {
  __m256 dk, mk, d6;
  __m256i words[4];
};

template <int64_t KIND>
inline UnitScales8 unit_scales8(const uint8_t* w, int half) {
  UnitScales8 u;
  const int64_t at = 32 * half;
  if constexpr (k_scales<KIND>()) {
    u.dk = halves8(w + R16<KIND>::d + 16 * half);
    u.mk = _mm256_sub_ps(_mm256_setzero_ps(), halves8(w + R16<KIND>::dmin + 16 * half));
    const __m256i w0 = load32(w + R16<KIND>::planes + at), w1 = load32(w + R16<KIND>::planes + 64 + at),
                  w2 = load32(w + R16<KIND>::planes + 128 + at);
    const __m256i low6 = _mm256_set1_epi32(0x3f3f3f3f), low4 = _mm256_set1_epi32(0x0f0f0f0f),
                  low2 = _mm256_set1_epi32(0x03030303);
    u.words[0] = _mm256_and_si256(w0, low6);
    u.words[1] = _mm256_or_si256(_mm256_and_si256(w2, low4),
                                 _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(w0, 6), low2), 4));
    u.words[2] = _mm256_and_si256(w1, low6);
    u.words[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(w2, 4), low4),
                                 _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(w1, 6), low2), 4));
  }
  if constexpr (KIND == kQ6_K) u.d6 = halves8(w + R16<kQ6_K>::d + 16 * half);
  return u;
}

// Block j's scales in columns 8 half ..: a (a2 for Q6_K's second half), c for the mins.
template <int64_t KIND>
inline void block_scales8(const uint8_t* w, int j, int half, const UnitScales8& u, __m256& a, __m256& a2, __m256& c) {
  a2 = c = _mm256_setzero_ps();
  if constexpr (KIND == kQ4_1) {
    a = halves8(w + R16<kQ4_1>::d + 16 * half);
    c = halves8(w + R16<kQ4_1>::m + 16 * half);
  } else if constexpr (KIND == kQ5_0 || KIND == kQ8_0) {
    a = halves8(w + R16<KIND>::d + 16 * half);
  } else if constexpr (k_scales<KIND>()) {
    const int shift = 8 * (j % 4);
    const __m256i byte = _mm256_set1_epi32(0xFF);
    a = _mm256_mul_ps(u.dk, _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(u.words[j / 4], shift), byte)));
    c = _mm256_mul_ps(u.mk, _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(u.words[2 + j / 4], shift), byte)));
  } else {
    const uint8_t* sc = w + R16<kQ6_K>::scales + 32 * j + 8 * half;
    a = _mm256_mul_ps(u.d6, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc)))));
    a2 = _mm256_mul_ps(u.d6, _mm256_cvtepi32_ps(
                                 _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 16)))));
  }
}

// One 32-weight block of 8 columns decoded (decode_group): for each g, the unsigned weights 4 g .. 4 g + 3 (lo)
// and 16 + 4 g .. (hi), and the block's scales.
struct Block8 {
  __m256i lo[4], hi[4];
  __m256 a, a2, c;
};
struct Decoded {        // a block of the group's 16 columns: both halves
  Block8 half[2];
};

// R rows' outlier products in 8 columns, in registers or (InMemory) on the stack.
template <int R, bool InMemory>
struct Second {
  __m256 v[R] = {};
  void fma(int r, __m256 a, __m256 b) { v[r] = _mm256_fmadd_ps(a, b, v[r]); }
  __m256 get(int r) const { return v[r]; }
};
template <int R>
struct Second<R, true> {
  alignas(32) float v[R * 8] = {};
  void fma(int r, __m256 a, __m256 b) { _mm256_store_ps(v + 8 * r, _mm256_fmadd_ps(a, b, _mm256_load_ps(v + 8 * r))); }
  __m256 get(int r) const { return _mm256_load_ps(v + 8 * r); }
};

// Columns 8 half .. 8 half + 7 of the group at w, for R rows from r0: each block decoded in registers as it
// is reached or (Read) read from `decoded` (decode_group's, shared by all passes of the group; w unused).
template <int64_t KIND, int R, bool Read>
void half_rows(const QuantizedX& qx, int64_t r0, const uint8_t* w, int half, float* out, int64_t ldo,
               const int32_t* start, const Decoded* decoded) {
  using K = Kind<KIND>;
  constexpr int64_t bpu = blocks_of<KIND>(), offset = offset_left<KIND>();
  constexpr bool halves = K::halves;
  const int64_t units = qx.nb / bpu, k = qx.k;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  // The rows' outlier products (few): in registers for one row, in memory above (the 4-row pass's sums need the
  // registers: its 16-row products in cache 1.15-1.3x faster so, its 1-row ones 1.15x slower).
  Second<R, (R > 1)> second;
  for (int64_t s = 0; s < units; ++s) {
    [[maybe_unused]] UnitScales8 u;
    [[maybe_unused]] const uint8_t* wu = nullptr;
    if constexpr (!Read) {
      wu = w + s * kCols * K::bytes;
      if (half == 0) prefetch_ahead(wu, kCols * K::bytes);
      u = unit_scales8<KIND>(wu, half);
    }
    for (int j = 0; j < bpu; ++j) {
      const int64_t b = s * bpu + j;
      [[maybe_unused]] const Block8* blk = Read ? &decoded[b].half[half] : nullptr;
      // weights 4 g .. (lo) and 16 + 4 g .. (hi) of this block
      auto weights = [&](int g, __m256i& lo, __m256i& hi) {
        if constexpr (Read)
          lo = blk->lo[g], hi = blk->hi[g];
        else
          decode8<KIND>(wu, j, g, half, lo, hi);
      };
      __m256i dot[R], dot2[halves ? R : 1];
      for (int r = 0; r < R; ++r) {
        if constexpr (halves) {
          dot[r] = _mm256_set1_epi32(start[2 * ((r0 + r) * qx.nb + b)]);
          dot2[r] = _mm256_set1_epi32(start[2 * ((r0 + r) * qx.nb + b) + 1]);
        } else if constexpr (offset != 0) {
          dot[r] = _mm256_set1_epi32(start[(r0 + r) * qx.nb + b]);
        } else {
          dot[r] = _mm256_setzero_si256();
        }
      }
      if constexpr (pair_sums<KIND>() > 1) {
        // g in chunks whose pair sums fit 16 bits (both halves of a g count in one sum unless `halves`):
        // each chunk's weights decoded, then per row its products summed in 16 bits and widened once.
        constexpr int chunk = halves ? pair_sums<KIND>() : pair_sums<KIND>() / 2;
        const __m256i ones = _mm256_set1_epi16(1);
        for (int g0 = 0; g0 < 4; g0 += chunk) {
          __m256i lo[chunk], hi[chunk];
          for (int c = 0; c < chunk; ++c) weights(g0 + c, lo[c], hi[c]);
          for (int r = 0; r < R; ++r) {
            const int8_t* xs = qx.q.data() + (r0 + r) * k + b * kBlock;
            __m256i p = _mm256_setzero_si256(), p2 = _mm256_setzero_si256();
            for (int c = 0; c < chunk; ++c) {
              p = _mm256_add_epi16(p, _mm256_maddubs_epi16(lo[c], bcast4(xs + 4 * (g0 + c))));
              const __m256i h = _mm256_maddubs_epi16(hi[c], bcast4(xs + 16 + 4 * (g0 + c)));
              if constexpr (halves)
                p2 = _mm256_add_epi16(p2, h);
              else
                p = _mm256_add_epi16(p, h);
            }
            dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(p, ones));
            if constexpr (halves) dot2[r] = _mm256_add_epi32(dot2[r], _mm256_madd_epi16(p2, ones));
          }
        }
      } else {
        for (int g = 0; g < 4; ++g) {
          __m256i lo, hi;
          weights(g, lo, hi);
          for (int r = 0; r < R; ++r) {
            const int8_t* xs = qx.q.data() + (r0 + r) * k + b * kBlock;
            dot[r] = dot4<KIND>(dot[r], lo, bcast4(xs + 4 * g));
            if constexpr (halves)
              dot2[r] = dot4<KIND>(dot2[r], hi, bcast4(xs + 16 + 4 * g));
            else
              dot[r] = dot4<KIND>(dot[r], hi, bcast4(xs + 16 + 4 * g));
          }
        }
      }
      __m256 a, a2, c;
      if constexpr (Read)
        a = blk->a, a2 = blk->a2, c = blk->c;
      else
        block_scales8<KIND>(wu, j, half, u, a, a2, c);
      for (int r = 0; r < R; ++r) {
        const int64_t row = r0 + r;
        const __m256 dx = _mm256_set1_ps(qx.d[static_cast<size_t>(row * qx.nb + b)]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), _mm256_mul_ps(a, dx), acc[r]);
        if constexpr (halves) acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot2[r]), _mm256_mul_ps(a2, dx), acc[r]);
        if constexpr (K::mins)
          acc[r] = _mm256_fmadd_ps(c, _mm256_set1_ps(qx.ds[static_cast<size_t>(row * qx.nb + b)]), acc[r]);
      }
      for (uint32_t bits = qx.coarse(b, r0, R); bits; bits &= bits - 1) {   // the outliers' weights decoded again
        const int r = __builtin_ctz(bits);
        const size_t i = static_cast<size_t>((r0 + r) * qx.nb + b);
        const int l = qx.outlier_at[i], high = l >= 16;
        __m256i lo, hi;
        weights((l % 16) / 4, lo, hi);
        const __m256i bytes = _mm256_srl_epi32(high ? hi : lo, _mm_cvtsi32_si128(8 * (l % 4)));
        const __m256 q = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(0xFF))),
                                       _mm256_set1_ps(static_cast<float>(K::offset)));
        const __m256 wl = _mm256_fmadd_ps(halves && high ? a2 : a, q, c);
        second.fma(r, _mm256_set1_ps(qx.outlier[i]), wl);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    _mm256_storeu_ps(out + r * ldo + 8 * half, _mm256_add_ps(acc[r], second.get(r)));
}

// Spread (the next group prefetched over the passes, cpu_gguf_r16.cpp's Ahead) not taken here: this path is
// compute-bound well before memory idles (the AVX2 build on a Sapphire Rapids, the 1.5B's products at 8-16 rows:
// Q4_K 1.06-1.12x faster with it, Q6_K 0.85-0.90x slower).
template <int64_t KIND, int R, bool Spread>
void group_rows(const QuantizedX& qx, int64_t r0, const uint8_t* w, float* out, int64_t ldo, const int32_t* start,
                const Ahead&) {
  half_rows<KIND, R, false>(qx, r0, w, 0, out, ldo, start, nullptr);
  half_rows<KIND, R, false>(qx, r0, w, 1, out, ldo, start, nullptr);
}

// More rows than kDecodedAbove (more than one pass): the group's blocks decoded once into `blocks` (qx.nb of
// them, 704 bytes each), which every pass reads instead of decoding again.  Measured on a Zen 3 EPYC (AVX2, no
// VNNI; one thread, layer 0's tensors in cache, two processes at once on the two cores, swapped): the 0.5B's
// Q5_0 ffn_gate at 16 rows 1.28 -> 1.09-1.18 ms, its Q6_K ffn_down 1.60-1.74 -> 1.41-1.44, 8 rows even; the
// 1.5B's Q4_K (cheap to decode) within noise.
#define R16_DECODED 1
constexpr int64_t kDecodedAbove = kRowsAtOnce;
template <int64_t KIND>
void decode_group(const QuantizedX& qx, const uint8_t* w, Decoded* blocks) {
  constexpr int64_t bpu = blocks_of<KIND>();
  const int64_t units = qx.nb / bpu;
  for (int64_t s = 0; s < units; ++s, w += kCols * Kind<KIND>::bytes) {
    prefetch_ahead(w, kCols * Kind<KIND>::bytes);
    for (int half = 0; half < 2; ++half) {
      const UnitScales8 u = unit_scales8<KIND>(w, half);
      for (int j = 0; j < bpu; ++j) {
        Block8& blk = blocks[s * bpu + j].half[half];
        for (int g = 0; g < 4; ++g) decode8<KIND>(w, j, g, half, blk.lo[g], blk.hi[g]);
        block_scales8<KIND>(w, j, half, u, blk.a, blk.a2, blk.c);
      }
    }
  }
}

template <int64_t KIND, int R>
void decoded_rows(const QuantizedX& qx, int64_t r0, const Decoded* blocks, float* out, int64_t ldo,
                  const int32_t* start) {
  half_rows<KIND, R, true>(qx, r0, nullptr, 0, out, ldo, start, blocks);
  half_rows<KIND, R, true>(qx, r0, nullptr, 1, out, ldo, start, blocks);
}

#else   // portable: the layout read weight by weight

template <int64_t KIND>
constexpr int64_t offset_left() { return 0; }      // the loop below takes the offset off each weight

template <int64_t KIND, int R, bool Spread>
void group_rows(const QuantizedX& qx, int64_t r0, const uint8_t* w, float* out, int64_t ldo, const int32_t*,
                const Ahead&) {
  using K = Kind<KIND>;
  constexpr int64_t bpu = blocks_of<KIND>();
  const int64_t units = qx.nb / bpu, k = qx.k;
  float acc[R][kCols] = {}, second[R][kCols] = {};
  for (int64_t s = 0; s < units; ++s, w += kCols * K::bytes)
    for (int c = 0; c < kCols; ++c) {
      uint8_t file[Kind<KIND>::bytes];        // the column's scales, as the file has them
      move_scales<KIND>(const_cast<uint8_t*>(w), c, file, false);
      uint8_t scales[8], min_bytes[8];
      if constexpr (k_scales<KIND>()) scales_mins_k4(file + 4, scales, min_bytes);
      for (int j = 0; j < bpu; ++j) {
        const int64_t b = s * bpu + j;
        const uint32_t bits = qx.coarse(b, r0, R);
        for (int r = 0; r < R; ++r) {
          const int64_t row = r0 + r;
          const int8_t* xs = qx.q.data() + row * k + b * kBlock;
          int32_t dot[2] = {0, 0};
          for (int l = 0; l < kBlock; ++l) dot[l / 16] += (read_u<KIND>(w, c, j, l) - static_cast<int>(K::offset)) * xs[l];
          const float dx = qx.d[static_cast<size_t>(row * qx.nb + b)];
          float a[2], cmin = 0.0f;
          if constexpr (KIND == kQ4_1) {
            a[0] = a[1] = half_at(file);
            cmin = half_at(file + 2);
          } else if constexpr (KIND == kQ5_0 || KIND == kQ8_0) {
            a[0] = a[1] = half_at(file);
          } else if constexpr (k_scales<KIND>()) {
            a[0] = a[1] = half_at(file) * static_cast<float>(scales[j]);
            cmin = -half_at(file + 2) * static_cast<float>(min_bytes[j]);
          } else {
            const float d = half_at(file + 208);
            a[0] = d * static_cast<float>(static_cast<int8_t>(file[192 + 2 * j]));
            a[1] = d * static_cast<float>(static_cast<int8_t>(file[192 + 2 * j + 1]));
          }
          if constexpr (K::halves)
            acc[r][c] += static_cast<float>(dot[0]) * (a[0] * dx) + static_cast<float>(dot[1]) * (a[1] * dx);
          else
            acc[r][c] += static_cast<float>(dot[0] + dot[1]) * (a[0] * dx);
          if constexpr (K::mins) acc[r][c] += cmin * qx.ds[static_cast<size_t>(row * qx.nb + b)];
          if ((bits >> r) & 1) {          // the outlier: x * w(l), w(l) = a * (u - offset) + c
            const size_t i = static_cast<size_t>(row * qx.nb + b);
            const int l = qx.outlier_at[i];
            const float q = static_cast<float>(read_u<KIND>(w, c, j, l) - static_cast<int>(K::offset));
            second[r][c] += qx.outlier[i] * std::fma(a[K::halves ? l / 16 : 0], q, cmin);
          }
        }
      }
    }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kCols; ++c) out[r * ldo + c] = acc[r][c] + second[r][c];
}

#endif
