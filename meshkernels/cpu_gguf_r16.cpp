// GGUF blocks repacked 16 output columns at a time, for the vector paths (CPUs without AMX, and any CPU where
// the tuner measures it faster): the same bytes as the file's blocks, laid out at load so that one 512-bit
// register holds 4 weights of each of 16 columns.  A dot-product instruction (VNNI's dpbusd, AVX2's
// maddubs) then multiplies all 16 columns by 4 broadcast activations: the weights are read once, in order,
// with no per-column decoding into memory and no horizontal sums (cpu_gguf.cpp's loop multiplies one
// column per instruction, and decodes each block of it through a buffer first).  llama.cpp's repacked
// types and ik_llama.cpp's R4/R8 layouts do the same; this layout is our own.
//
// A weight (N, K / w * bytes) of kind Q4_1, Q5_0, Q8_0, Q4_K, Q5_K or Q6_K keeps its shape and size: its
// first 16 * (N / 16) rows become groups of 16 rows, each group a run of "units" (a block of 32 weights; a
// K-quant's super-block of 256), each unit 16 * bytes long; the last N % 16 rows stay as the file has them
// (cpu_gguf.cpp multiplies those).  Within a unit, for each 32-weight block j of it (one, or eight), with
// u the weight's unsigned q (Q8_0's q + 128, Q5_0's and Q5_K's 5 bits, Q6_K's 6 bits) and element l
// of the block, g = (l % 16) / 4, i = l % 4, high = l >= 16:
//   nibbles  (all but Q8_0) at 256 j: byte 64 g + 4 c + i, low nibble from l < 16, high from l >= 16: u & 15;
//   Q8_0's bytes: byte 64 (2 g + high) + 4 c + i = u;
//   Q5_0 / Q5_K 5th bits (u >> 4): 8 uint64 masks per block, mask 2 g + high, bit 4 c + i;
//   Q6_K's top 2 bits (u >> 4): 128 bytes per block, byte 64 high + 4 c + i, bits 2 g and 2 g + 1;
// then each column's scales as the file stores them, column c at 2 c (fp16) or in planes:
//   Q4_1: d[16] m[16] after the nibbles (256); Q5_0: masks (256), d (320); Q8_0: d (512);
//   Q4_K: d (2048), dmin (2080), the 12 scale bytes as 3 planes of 16 uint32 (2112: plane p, column c = bytes
//   4 p .. 4 p + 3); Q5_K: masks (2048), d (2560), dmin (2592), planes (2624); Q6_K: top bits (2048), the
//   16 int8 scales as scale s of column c at 3072 + 16 s + c, d (3328).
// So a register load of 64 bytes of nibbles gives, masked, weights 4 g .. 4 g + 3 of all 16 columns
// (shifted: 16 + 4 g ..), the activations' 4 bytes at the same positions broadcast beside them.
//
// The products are gguf_linear's (cpu_gguf.cpp): activations quantized per row and 32 elements (dx, qx),
// every block's integer dot product exact, scale * dx * dot (and the mins' c * dx * sum(qx)) summed in
// float32, but for the coarse blocks (cpu_gguf.h): a block whose largest |x| is an outlier channel's
// (above 5x its row's root mean square) has that element taken out, multiplied as a float by its 16
// columns' weights (decoded once for the rows that share the channel), and the other 31 quantized alone.
// SmolLM2's hidden states have such channels in 8-17% of a row's blocks; int8 of the whole block left
// its mean |d logprob| against float32 at 0.034, this 0.015 (bench/quality.py).  Rows go 8 (AVX-512) or 4 at a time over each group's
// decoded weights; threads split the groups.

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

#include "cpu_gguf_r16.h"

namespace {

// ------------------------------------------------------------------------------------------ the products

// A group multiplied in several passes (more rows than kRowsAtOnce) reads memory in the first alone: the
// prefetch 8 KB ahead of the first pass runs into the next group, the later passes' into bytes already here,
// and memory idles while they compute (at 16 rows the 1.5B's Q4_K ffn_gate took 12.8 ms for rows 0-7, from
// memory, and 9.4 for rows 8-15, from cache).  So every pass prefetches a part of the next group instead,
// spread evenly over all passes' units, into L2: memory streams through all of them (that ffn_gate 22.2 ->
// 18.5-19.2 ms, its Q6_K ffn_down 26.5 -> 23.5-24.6; whole 16-row steps 113-115 -> 98-102 ms, AMX off).
struct Ahead {
  const uint8_t* next = nullptr;    // the next group's weights (null: one-pass products, which do not read it)
  int64_t lines = 0;                // its length in cache lines
  int64_t per = 0;                  // lines prefetched a unit (lines / all passes' units, rounded up)
  int64_t part = 0;                 // this pass's first unit among all passes' units
  Ahead() = default;
  Ahead(const uint8_t* group, int64_t bytes, int64_t units) : next(group), lines((bytes + 63) / 64),
                                                               per((lines + units - 1) / units) {}
};
#if defined(__AVX2__)
// Two prefetches run ahead of the hardware's: the unit 1 KB after this one into L1 (Q4_1 / Q5_0 / Q6_K 1.1-1.4x
// faster at one row with it; without it above one row, slower too), and 8 KB after into L2.  An L1 prefetch
// holds a fill buffer until its line arrives, so it cannot run far ahead; the L2 one can, and it keeps memory
// busy while a group's rows compute (a Sapphire Rapids, AMX off, the whole model step in process:
// Qwen2.5-Coder-0.5B 17.8 -> 14.7-15.4 ms at 1 row and 42.2-43.0 -> 37.8-38.0 at 16, its Q8_0 LM head alone
// 6.8-7.7 -> 4.3-4.6 ms at 8 rows; SmolLM2 5.5 -> 4.5 ms at 1 row; 4 and 16 KB ahead within noise of 8).
constexpr int64_t kAhead = 1024, kFarAhead = 8192;
// always_inline, all of these: GCC takes a prefetching function it has not inlined early for one without
// effects, and drops the call (prefetch_ahead inside prefetch_unit<false> was, and the 1-row products lost theirs).
__attribute__((always_inline)) inline void prefetch_near(const uint8_t* w, int64_t bytes) {
  for (int64_t at = 0; at < bytes; at += 64) _mm_prefetch(reinterpret_cast<const char*>(w + kAhead + at), _MM_HINT_T0);
}
__attribute__((always_inline)) inline void prefetch_ahead(const uint8_t* w, int64_t bytes) {
  prefetch_near(w, bytes);
  for (int64_t at = 0; at < bytes; at += 64)
    _mm_prefetch(reinterpret_cast<const char*>(w + kFarAhead + at), _MM_HINT_T2);
}
__attribute__((always_inline)) inline void prefetch_part(const Ahead& a, int64_t unit) {
  for (int64_t l = (a.part + unit) * a.per, end = std::min(l + a.per, a.lines); l < end; ++l)
    _mm_prefetch(reinterpret_cast<const char*>(a.next + 64 * l), _MM_HINT_T2);
}
// A unit's prefetches: into L1 as ever, and the next group's part (Spread) or 8 KB ahead.
template <bool Spread>
__attribute__((always_inline)) inline void prefetch_unit(const Ahead& a, int64_t unit, const uint8_t* w,
                                                        int64_t bytes) {
  if constexpr (Spread) {
    prefetch_near(w, bytes);
    prefetch_part(a, unit);
  } else {
    prefetch_ahead(w, bytes);
  }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define R16_ZMM 1
constexpr int kRowsAtOnce = 8;
#else
constexpr int kRowsAtOnce = 4;
#endif

#if defined(R16_ZMM)
inline __m512 halves16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// The offset the integer sums carry (u = q + offset), taken off by starting them at -offset * sum(qx).
template <int64_t KIND>
constexpr int64_t offset_left() { return Kind<KIND>::offset; }

// One 32-weight block of a group decoded: for each g, the unsigned weights 4 g .. 4 g + 3 (lo) and 16 + 4 g ..
// (hi) of all 16 columns, and the block's scales (a; a2 for Q6_K's second half; c for the mins).
struct Block16 {
  __m512i lo[4], hi[4];
  __m512 a, a2, c;
};

// What a unit's blocks share: a K-quant's super-block scales (Q4_K / Q5_K: d, -dmin and the 6-bit scales
// and mins as bytes; Q6_K: d).
struct UnitScales {
  __m512 dk, mk, d6;
  __m512i words[4];
};

template <int64_t KIND>
inline UnitScales unit_scales(const uint8_t* w) {
  UnitScales u;
  if constexpr (k_scales<KIND>()) {
    u.dk = halves16(w + R16<KIND>::d);
    u.mk = _mm512_sub_ps(_mm512_setzero_ps(), halves16(w + R16<KIND>::dmin));
    const __m512i w0 = _mm512_loadu_si512(w + R16<KIND>::planes), w1 = _mm512_loadu_si512(w + R16<KIND>::planes + 64),
                  w2 = _mm512_loadu_si512(w + R16<KIND>::planes + 128);
    const __m512i low6 = _mm512_set1_epi32(0x3f3f3f3f), low4 = _mm512_set1_epi32(0x0f0f0f0f),
                  low2 = _mm512_set1_epi32(0x03030303);
    u.words[0] = _mm512_and_si512(w0, low6);
    u.words[1] = _mm512_or_si512(_mm512_and_si512(w2, low4),
                                 _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(w0, 6), low2), 4));
    u.words[2] = _mm512_and_si512(w1, low6);
    u.words[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(w2, 4), low4),
                                 _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(w1, 6), low2), 4));
  }
  if constexpr (KIND == kQ6_K) u.d6 = halves16(w + R16<kQ6_K>::d);
  return u;
}

// Q6_K's top bits of block j (the two registers decode_g takes).
template <int64_t KIND>
inline void top_bits(const uint8_t* w, int j, __m512i* top) {
  if constexpr (KIND == kQ6_K) {
    top[0] = _mm512_loadu_si512(w + R16<kQ6_K>::high + 128 * j);
    top[1] = _mm512_loadu_si512(w + R16<kQ6_K>::high + 128 * j + 64);
  }
}

// The unsigned weights 4 g .. 4 g + 3 (lo) and 16 + 4 g .. (hi) of block j of the unit at w, all 16 columns.
template <int64_t KIND>
inline void decode_g(const uint8_t* w, int j, int g, [[maybe_unused]] const __m512i* top, __m512i& lo, __m512i& hi) {
  if constexpr (KIND == kQ8_0) {
    lo = _mm512_loadu_si512(w + 128 * g);
    hi = _mm512_loadu_si512(w + 128 * g + 64);
  } else {
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512i v = _mm512_loadu_si512(w + 256 * j + 64 * g);
    lo = _mm512_and_si512(v, low);
    hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    if constexpr (five_bits<KIND>()) {
      uint64_t m[2];
      std::memcpy(m, w + R16<KIND>::masks + 64 * j + 16 * g, 16);
      const __m512i sixteen = _mm512_set1_epi8(16);
      lo = _mm512_mask_add_epi8(lo, m[0], lo, sixteen);
      hi = _mm512_mask_add_epi8(hi, m[1], hi, sixteen);
    }
    if constexpr (KIND == kQ6_K) {
      const __m512i mask = _mm512_set1_epi8(0x30);
      __m512i tl, th;
      if (g == 0) {
        tl = _mm512_slli_epi16(top[0], 4), th = _mm512_slli_epi16(top[1], 4);
      } else if (g == 1) {
        tl = _mm512_slli_epi16(top[0], 2), th = _mm512_slli_epi16(top[1], 2);
      } else if (g == 2) {
        tl = top[0], th = top[1];
      } else {
        tl = _mm512_srli_epi16(top[0], 2), th = _mm512_srli_epi16(top[1], 2);
      }
      lo = _mm512_ternarylogic_epi64(lo, tl, mask, 0xF8);    // lo | (tl & mask)
      hi = _mm512_ternarylogic_epi64(hi, th, mask, 0xF8);
    }
  }
}

// Block j of the unit at w.
template <int64_t KIND>
inline void decode(const uint8_t* w, int j, const UnitScales& u, Block16& out) {
  __m512i top[2];
  top_bits<KIND>(w, j, top);
  for (int g = 0; g < 4; ++g) decode_g<KIND>(w, j, g, top, out.lo[g], out.hi[g]);
  out.a2 = out.c = _mm512_setzero_ps();
  if constexpr (KIND == kQ4_1) {
    out.a = halves16(w + R16<kQ4_1>::d);
    out.c = halves16(w + R16<kQ4_1>::m);
  } else if constexpr (KIND == kQ5_0 || KIND == kQ8_0) {
    out.a = halves16(w + R16<KIND>::d);
  } else if constexpr (k_scales<KIND>()) {
    const int shift = 8 * (j % 4);
    const __m512i byte = _mm512_set1_epi32(0xFF);
    out.a = _mm512_mul_ps(u.dk, _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(u.words[j / 4], shift), byte)));
    out.c = _mm512_mul_ps(u.mk, _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(u.words[2 + j / 4], shift), byte)));
  } else {
    const uint8_t* sc = w + R16<kQ6_K>::scales + 32 * j;
    out.a = _mm512_mul_ps(u.d6, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)))));
    out.a2 = _mm512_mul_ps(u.d6, _mm512_cvtepi32_ps(
                                     _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 16)))));
  }
}

// The activations as rows_block reads them: 8 rows at a time (kRowsAtOnce), block by block, so that a row's
// bytes, dx and sums lie at constant offsets from one pointer (the rows of QuantizedX, k apart, took the
// compiler 8 pointers a block, spilled to the stack and moved through vector registers: ~280 scalar
// instructions beside Q4_K's 64 dot products of 8 rows; with the tiles ~70: Qwen2.5-Coder-1.5B's Q4_K ffn_gate
// 23.6 -> 21.5 ms at 16 rows and 66.0 -> 61.0 at 64, whole 0.5B steps 3-9% faster above 8 rows, AMX off).
// Tile i, block b, row r of the tile:
// q[((i nb + b) 8 + r) 32 ..], d and ds [(i nb + b) 8 + r], start [((i nb + b) 8 + r) 2 + half]: the block's
// (half's) -offset * sum(qx), where the products' integer sums carry an offset.
struct Tiles {
  int64_t nb = 0;
  std::vector<int8_t> q;
  std::vector<float> d, ds;
  std::vector<int32_t> start;
};

template <int64_t KIND>
Tiles tiles_of(const QuantizedX& qx) {
  using K = Kind<KIND>;
  Tiles x;
  const int64_t nb = x.nb = qx.nb, slots = (qx.t + kRowsAtOnce - 1) / kRowsAtOnce * kRowsAtOnce * nb;
  x.q.assign(static_cast<size_t>(slots * kBlock), 0);
  x.d.assign(static_cast<size_t>(slots), 0.0f);
  if constexpr (K::mins) x.ds.assign(static_cast<size_t>(slots), 0.0f);
  if constexpr (offset_left<KIND>() != 0) x.start.assign(static_cast<size_t>(2 * slots), 0);
  for (int64_t row = 0; row < qx.t; ++row)
    for (int64_t b = 0; b < nb; ++b) {
      const size_t from = static_cast<size_t>(row * nb + b);
      const size_t to = static_cast<size_t>(((row / kRowsAtOnce) * nb + b) * kRowsAtOnce + row % kRowsAtOnce);
      std::memcpy(x.q.data() + to * kBlock, qx.q.data() + row * qx.k + b * kBlock, kBlock);
      x.d[to] = qx.d[from];
      if constexpr (K::mins) x.ds[to] = qx.ds[from];
      if constexpr (offset_left<KIND>() != 0) {
        constexpr int32_t off = static_cast<int32_t>(offset_left<KIND>());
        if constexpr (K::halves) {
          x.start[2 * to] = -off * qx.s16[2 * from];
          x.start[2 * to + 1] = -off * qx.s16[2 * from + 1];
        } else {
          x.start[2 * to] = -off * qx.s32[from];
        }
      }
    }
  return x;
}

// acc[r] += row r0 + r's products with block b of the group (decoded); r0 a multiple of kRowsAtOnce.
template <int64_t KIND, int R>
inline void rows_block(const Tiles& x, int64_t r0, int64_t b, const Block16& blk, __m512* acc) {
  constexpr bool halves = Kind<KIND>::halves;
  const int64_t at = (r0 / kRowsAtOnce * x.nb + b) * kRowsAtOnce;
  const int8_t* xq = x.q.data() + at * kBlock;
  const float* dx = x.d.data() + at;
  __m512i dot[R], dot2[halves ? R : 1];
  for (int r = 0; r < R; ++r) {
    if constexpr (halves) {
      dot[r] = _mm512_set1_epi32(x.start[static_cast<size_t>(2 * (at + r))]);
      dot2[r] = _mm512_set1_epi32(x.start[static_cast<size_t>(2 * (at + r) + 1)]);
    } else if constexpr (offset_left<KIND>() != 0) {
      dot[r] = _mm512_set1_epi32(x.start[static_cast<size_t>(2 * (at + r))]);
    } else {
      dot[r] = _mm512_setzero_si512();
    }
  }
  for (int g = 0; g < 4; ++g)
    for (int r = 0; r < R; ++r) {
      const int8_t* xs = xq + r * kBlock;
      dot[r] = _mm512_dpbusd_epi32(dot[r], blk.lo[g], bcast4(xs + 4 * g));
      if constexpr (halves)
        dot2[r] = _mm512_dpbusd_epi32(dot2[r], blk.hi[g], bcast4(xs + 16 + 4 * g));
      else
        dot[r] = _mm512_dpbusd_epi32(dot[r], blk.hi[g], bcast4(xs + 16 + 4 * g));
    }
  for (int r = 0; r < R; ++r) {
    const __m512 d = _mm512_set1_ps(dx[r]);
    if constexpr (halves)   // dx (a dot + a2 dot2): one multiply fewer than scaling each half by its a dx
      acc[r] = _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_cvtepi32_ps(dot2[r]), blk.a2,
                                               _mm512_mul_ps(_mm512_cvtepi32_ps(dot[r]), blk.a)), d, acc[r]);
    else
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(blk.a, d), acc[r]);
    if constexpr (Kind<KIND>::mins)
      acc[r] = _mm512_fmadd_ps(blk.c, _mm512_set1_ps(x.ds[static_cast<size_t>(at + r)]), acc[r]);
  }
}

// second[r] += row r0 + r's outlier in block b (decoded) times its weights, for the rows in `bits`: an outlier
// channel is the same element in most rows, whose weights are then decoded once.
// w null: the weights are blk's (decoded in memory); else decoded again from the unit at w (block j of it),
// not read from blk's registers (which an index would move to memory).
template <int64_t KIND>
__attribute__((always_inline)) inline void fine_rows(const QuantizedX& qx, int64_t r0, uint32_t bits, int64_t b,
                                                     const uint8_t* w, int j, const Block16& blk, float* second) {
  int last = -1;
  __m512 wl = _mm512_setzero_ps();
  for (; bits; bits &= bits - 1) {
    const int r = __builtin_ctz(bits);
    const size_t i = static_cast<size_t>((r0 + r) * qx.nb + b);
    if (const int l = qx.outlier_at[i]; l != last) {
      last = l;
      const bool high = l >= 16;
      __m512i top[2], lo, hi;
      if (w) {
        top_bits<KIND>(w, j, top);
        decode_g<KIND>(w, j, (l % 16) / 4, top, lo, hi);
      } else {
        lo = blk.lo[(l % 16) / 4], hi = blk.hi[(l % 16) / 4];
      }
      const __m512i bytes = _mm512_srl_epi32(high ? hi : lo, _mm_cvtsi32_si128(8 * (l % 4)));
      const __m512 q = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0xFF))),
                                     _mm512_set1_ps(static_cast<float>(Kind<KIND>::offset)));
      wl = _mm512_fmadd_ps(Kind<KIND>::halves && high ? blk.a2 : blk.a, q, blk.c);
    }
    _mm512_store_ps(second + kCols * r,
                    _mm512_fmadd_ps(_mm512_set1_ps(qx.outlier[i]), wl, _mm512_load_ps(second + kCols * r)));
  }
}

// out[r * ldo + c] for R rows from r0 and the group's 16 columns at w (its units one after another), each
// block decoded in registers as it is reached; with the coarse blocks' second terms where rows have them.
template <int64_t KIND, int R, bool Spread>
void group_rows(const QuantizedX& qx, int64_t r0, const uint8_t* w, float* out, int64_t ldo, const Tiles& x,
                const Ahead& ahead) {
  using K = Kind<KIND>;
  constexpr int64_t bpu = blocks_of<KIND>();
  const int64_t units = qx.nb / bpu;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  alignas(64) float second[R * kCols] = {};     // in memory: the rows' outlier products (few)
  for (int64_t s = 0; s < units; ++s, w += kCols * K::bytes) {
    prefetch_unit<Spread>(ahead, s, w, kCols * K::bytes);
    const UnitScales u = unit_scales<KIND>(w);
    for (int j = 0; j < bpu; ++j) {
      Block16 blk;
      decode<KIND>(w, j, u, blk);
      rows_block<KIND, R>(x, r0, s * bpu + j, blk, acc);
      if (const uint32_t bits = qx.coarse(s * bpu + j, r0, R))
        fine_rows<KIND>(qx, r0, bits, s * bpu + j, w, j, blk, second);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ldo, _mm512_add_ps(acc[r], _mm512_load_ps(second + kCols * r)));
}

// More rows than kDecodedAbove: the group's blocks decoded once into `blocks` (qx.nb of them), then each
// kRowsAtOnce rows multiplied from there: decoding is shared by every row, not redone per 8, for the price of
// writing the decoded blocks (704 bytes each) and reading them back.  Measured on a Sapphire Rapids, AMX off,
// against decoding in registers: Qwen2.5-0.5B's Q4_K / Q5_0 / Q6_K / Q8_0 GEMMs 0.96x at 32 rows and 0.89x at
// 64 (1.07x at 16: not there); SmolLM2's Q4_1, cheaper to decode, 1.05x at 16 and 0.98x at 64.  Since the
// passes in registers prefetch the next group (Ahead), they are the faster up to 32 rows: Qwen2.5-Coder-1.5B's
// Q4_K ffn_gate / Q6_K ffn_down 0.87x / 0.91x the time at 24 rows, 0.93x / 0.97x at 32, 1.01x / 1.04x at 48.
#define R16_DECODED 1
constexpr int64_t kDecodedAbove = 32;
using Decoded = Block16;
template <int64_t KIND>
void decode_group(const QuantizedX& qx, const uint8_t* w, Block16* blocks) {
  using K = Kind<KIND>;
  constexpr int64_t bpu = blocks_of<KIND>();
  const int64_t units = qx.nb / bpu;
  for (int64_t s = 0; s < units; ++s, w += kCols * K::bytes) {
    prefetch_ahead(w, kCols * K::bytes);
    const UnitScales u = unit_scales<KIND>(w);
    for (int j = 0; j < bpu; ++j) decode<KIND>(w, j, u, blocks[s * bpu + j]);
  }
}

template <int64_t KIND, int R>
void decoded_rows(const QuantizedX& qx, int64_t r0, const Block16* blocks, float* out, int64_t ldo,
                  const Tiles& x) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  alignas(64) float second[R * kCols] = {};
  for (int64_t b = 0; b < qx.nb; ++b) {
    rows_block<KIND, R>(x, r0, b, blocks[b], acc);
    if (const uint32_t bits = qx.coarse(b, r0, R)) fine_rows<KIND>(qx, r0, bits, b, nullptr, 0, blocks[b], second);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ldo, _mm512_add_ps(acc[r], _mm512_load_ps(second + kCols * r)));
}

#else
#include "cpu_gguf_r16_narrow.h"   // AVX2 and portable
#endif

// A row count below kRowsAtOnce for the remainder's dispatch (counts at or above it never reach it).
constexpr int tail(int rows) { return rows < kRowsAtOnce ? rows : 1; }

#if !defined(R16_ZMM)
// Each block's (each Q6_K half's) -offset * sum(qx), where the products' integer sums carry an offset.
template <int64_t KIND>
std::vector<int32_t> offset_starts(const QuantizedX& qx) {
  std::vector<int32_t> start;
  if constexpr (offset_left<KIND>() != 0) {
    const bool halves = Kind<KIND>::halves;
    const std::vector<int32_t>& sums = halves ? qx.s16 : qx.s32;
    start.resize(sums.size());
    for (size_t i = 0; i < sums.size(); ++i) start[i] = -static_cast<int32_t>(offset_left<KIND>()) * sums[i];
  }
  return start;
}
#endif

// The group at wg times all rows, kRowsAtOnce at a time, then the rest.
template <int64_t KIND, bool Spread, typename X>
void group_passes(const QuantizedX& qx, const uint8_t* wg, float* o, int64_t n, const X& xs, Ahead ahead) {
  const int64_t t = qx.t, units = qx.nb / blocks_of<KIND>();
  int64_t r = 0;
  for (; r + kRowsAtOnce <= t; r += kRowsAtOnce, ahead.part += units)
    group_rows<KIND, kRowsAtOnce, Spread>(qx, r, wg, o + r * n, n, xs, ahead);
  switch (t - r) {
    case 7: group_rows<KIND, tail(7), Spread>(qx, r, wg, o + r * n, n, xs, ahead); break;
    case 6: group_rows<KIND, tail(6), Spread>(qx, r, wg, o + r * n, n, xs, ahead); break;
    case 5: group_rows<KIND, tail(5), Spread>(qx, r, wg, o + r * n, n, xs, ahead); break;
    case 4: group_rows<KIND, tail(4), Spread>(qx, r, wg, o + r * n, n, xs, ahead); break;
    case 3: group_rows<KIND, 3, Spread>(qx, r, wg, o + r * n, n, xs, ahead); break;
    case 2: group_rows<KIND, 2, Spread>(qx, r, wg, o + r * n, n, xs, ahead); break;
    case 1: group_rows<KIND, 1, Spread>(qx, r, wg, o + r * n, n, xs, ahead); break;
    default: break;
  }
}

template <int64_t KIND>
void linear(const QuantizedX& qx, const uint8_t* w, int64_t n, float* out) {
#if defined(R16_ZMM)
  const Tiles xs = tiles_of<KIND>(qx);      // the activations as the products read them
#else
  const std::vector<int32_t> starts = offset_starts<KIND>(qx);
  const int32_t* xs = starts.data();
#endif
  const int64_t groups = n / kCols, t = qx.t;
  const int64_t passes = (t + kRowsAtOnce - 1) / kRowsAtOnce, units = qx.nb / blocks_of<KIND>();
  const int64_t group_bytes = kCols * (qx.k / Kind<KIND>::weights) * Kind<KIND>::bytes;
  const int64_t threads = std::max<int64_t>(1, torch::stable::get_num_threads());
  const int64_t grain = std::max<int64_t>(1, (groups + threads - 1) / threads);
  torch::stable::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
    for (int64_t gi = begin; gi < end; ++gi) {
      const uint8_t* wg = w + gi * group_bytes;
      float* o = out + gi * kCols;
#if defined(R16_DECODED)
      if (t > kDecodedAbove) {
        int64_t r = 0;
        thread_local std::vector<Decoded> blocks;
        if (blocks.size() < static_cast<size_t>(qx.nb)) blocks.resize(static_cast<size_t>(qx.nb));
        decode_group<KIND>(qx, wg, blocks.data());
        for (; r + kRowsAtOnce <= t; r += kRowsAtOnce)
          decoded_rows<KIND, kRowsAtOnce>(qx, r, blocks.data(), o + r * n, n, xs);
        switch (t - r) {
          case 7: decoded_rows<KIND, tail(7)>(qx, r, blocks.data(), o + r * n, n, xs); break;
          case 6: decoded_rows<KIND, tail(6)>(qx, r, blocks.data(), o + r * n, n, xs); break;
          case 5: decoded_rows<KIND, tail(5)>(qx, r, blocks.data(), o + r * n, n, xs); break;
          case 4: decoded_rows<KIND, tail(4)>(qx, r, blocks.data(), o + r * n, n, xs); break;
          case 3: decoded_rows<KIND, 3>(qx, r, blocks.data(), o + r * n, n, xs); break;
          case 2: decoded_rows<KIND, 2>(qx, r, blocks.data(), o + r * n, n, xs); break;
          case 1: decoded_rows<KIND, 1>(qx, r, blocks.data(), o + r * n, n, xs); break;
          default: break;
        }
        continue;
      }
#endif
      if (passes > 1 && gi + 1 < end)
        group_passes<KIND, true>(qx, wg, o, n, xs, Ahead(wg + group_bytes, group_bytes, passes * units));
      else
        group_passes<KIND, false>(qx, wg, o, n, xs, Ahead());
    }
  });
}

}  // namespace

namespace infermesh_gguf {

bool r16_linear(int64_t kind, const QuantizedX& qx, const uint8_t* w, int64_t n, float* out) {
  switch (kind) {
    case kQ4_1: linear<kQ4_1>(qx, w, n, out); return true;
    case kQ5_0: linear<kQ5_0>(qx, w, n, out); return true;
    case kQ8_0: linear<kQ8_0>(qx, w, n, out); return true;
    case kQ4_K: linear<kQ4_K>(qx, w, n, out); return true;
    case kQ5_K: linear<kQ5_K>(qx, w, n, out); return true;
    case kQ6_K: linear<kQ6_K>(qx, w, n, out); return true;
    default: return false;
  }
}

}  // namespace infermesh_gguf
