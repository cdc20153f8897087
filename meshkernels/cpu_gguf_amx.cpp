// gguf_linear's AMX-INT8 path (cpu_gguf.cpp calls it from its kind's amx_rows rows on): out = x W^T with
// W's GGUF blocks decoded to signed bytes (q - offset) 16 output columns at a time.
//
// A tile = 16 weight columns x G units' bytes (64 bytes of K: two blocks, or four Q6_K half-blocks), B tile
// = the same K bytes of W rows of x (W = T rounded up to 1, 2, 4, 8 or 16), spread so that each unit's rows
// get their own C columns (cpu_gguf.h's TiledX; G = 16 / W at most), C = tdpbssd(A, B) (16 x G W int32):
// each column's exact integer dot product with each row for each unit.  Scales differ per unit on both
// sides, so every group's C is stored and added in float32 into G W accumulators: acc += float(C) *
// (dx * a) (+ c * dx * sum(qx) for Q4_1 / Q4_K / Q5_K's mins), the vector paths' arithmetic.  Sizing B and C to
// the rows is what makes one to four rows cheap: the float work per group is G W vectors, not 16.
//
// Per thread, a range of 16-column tiles; while one tile's groups multiply (A/B tiles alternating over two
// sets and C over four, as AMX tiles are not renamed, each group's C added kLag groups after its product),
// the next tile is decoded column by column into the other buffer, in registers 64 bytes at a time (Q4_1 /
// Q5_0 pairs, Q4_K / Q6_K super-blocks; Q5_K through cpu_gguf.h's decode), each column's row prefetched whole
// just before.  Q4_1 / Q5_0 / Q8_0's fp16 scales (and Q4_1's m) are gathered from the blocks when their group
// is added.
//
// Built where the CPU has AMX-TILE and AMX-INT8 (meshkernels/cpu_ops.py adds the flags); used only after
// Linux grants the process the tile state (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)),
// asked once; else amx_usable() is false and gguf_linear keeps its vector path.

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
#include "cpu_gguf_amx.h"

namespace {

#if defined(GGUF_AMX)
inline __m512i lanes16() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }

// A decoded tile of 16 weight columns (each thread has two: it decodes the next tile while it multiplies
// this one, so the tile loads never wait on the decoding's stores, and the decoding fills the AMX unit's
// latency).
struct ColumnTile {
  std::vector<int8_t> buffer;  // a, 64-byte aligned, with 64 bytes to spare (a last group's missing unit)
  int8_t* a = nullptr;       // (16, K): column c's blocks, signed, one after another (A tiles read 16 rows of it)
  std::vector<float> scale;  // (groups, 16, G): unit g G + i of column c at (g 16 + c) G + i
  std::vector<float> c;      // likewise, Q4_K / Q5_K's -dmin * m

  void allocate(int64_t k, int64_t size) {
    buffer.resize(static_cast<size_t>(kTile * k + 128));
    a = buffer.data() + (64 - reinterpret_cast<uintptr_t>(buffer.data()) % 64) % 64;
    scale.assign(static_cast<size_t>(size), 0.0f);
    c.assign(scale.size(), 0.0f);
  }
  void clear(int64_t k) {    // the last tile's missing columns: zero weights and scales
    std::fill_n(a, kTile * k, 0);
    std::fill(scale.begin(), scale.end(), 0.0f);
    std::fill(c.begin(), c.end(), 0.0f);
  }
};

// Column col's row of blocks at w into s: its signed bytes to s.a + col * K; K-quants' scales (and mins) to
// their places in s.scale and s.c (Q4_1 / Q5_0 / Q8_0's are gathered from the blocks when used: half_scales).
template <int64_t KIND, int64_t G>
void decode_column(const uint8_t* w, int64_t nb, int64_t col, ColumnTile& s) {
  using K = Kind<KIND>;
  int8_t* a = s.a + col * nb * kBlock;
  if constexpr (KIND == kQ4_1) {     // pairs of blocks in registers (a last odd one alone: a pair would read past
    int64_t b = 0;                   // the row)
    for (; b + 2 <= nb; b += 2) _mm512_storeu_si512(a + b * kBlock, q4_1_pair(w + b * K::bytes));
    if (b < nb) {
      float d, m;
      decode<KIND, true>(w + b * K::bytes, 1, reinterpret_cast<uint8_t*>(a + b * kBlock), kBlock, &d, 1, &m, 1);
    }
  } else if constexpr (KIND == kQ5_0 || KIND == kQ8_0) {
    int64_t b = 0;
    if constexpr (KIND == kQ5_0)
      for (; b + 2 <= nb; b += 2) _mm512_storeu_si512(a + b * kBlock, q5_pair_signed(w + b * K::bytes));
    for (; b < nb; ++b) {
      const uint8_t* blk = w + b * K::bytes;
      const __m256i v = KIND == kQ8_0 ? load32(blk + 2) : _mm256_sub_epi8(q5_unsigned(blk), _mm256_set1_epi8(16));
      store32(reinterpret_cast<uint8_t*>(a + b * kBlock), v);
    }
  } else {
    constexpr int64_t upb = K::halves ? 2 : 1, units = kChunk * upb;
    alignas(64) float scale[units], mins[kChunk];
    for (int64_t sb = 0; sb < nb / kChunk; ++sb) {
      decode_super<KIND>(w + sb * K::bytes, a + sb * K::weights, scale, mins);
      // a group's G units of one column lie together: (groups, 16, G)
      for (int64_t i = 0; i < units; i += G) {
        std::memcpy(s.scale.data() + ((sb * units + i) / G * kTile + col) * G, scale + i, G * sizeof(float));
        if (K::mins && i < kChunk)
          std::memcpy(s.c.data() + ((sb * kChunk + i) / G * kTile + col) * G, mins + i, G * sizeof(float));
      }
    }
  }
}

// Q4_1 / Q5_0 / Q8_0: group gi's scales, (16, G) as s.scale holds them, straight from the fp16 d of the blocks
// of the tile's `cols` columns at w (a last group's missing unit and missing columns read 0); with `mins`,
// Q4_1's m (the fp16 after d, in the same gathered dword) likewise.
template <int64_t KIND, int G>
inline void half_scales(const uint8_t* w, int64_t row_bytes, int64_t gi, int64_t units, int64_t cols, float* out,
                        float* mins = nullptr) {
  const __m512i rows = _mm512_mullo_epi32(lanes16(),
                                          _mm512_set1_epi32(static_cast<int>(row_bytes)));
  const __mmask16 live = static_cast<__mmask16>((1u << cols) - 1);
  const uint8_t* at = w + gi * G * Kind<KIND>::bytes;
  __m512i d[G];
  for (int i = 0; i < G; ++i)
    d[i] = gi * G + i < units
               ? _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, rows, at + i * Kind<KIND>::bytes, 1)
               : _mm512_setzero_si512();
  if constexpr (G == 1) {
    _mm512_storeu_ps(out, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(d[0])));
    if (mins) _mm512_storeu_ps(mins, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(d[0], 16))));
  } else {                   // G == 2: dword c holds column c's two halves, in (c, i) order
    const __m512i pairs = _mm512_mask_blend_epi16(0xAAAAAAAA, d[0], _mm512_slli_epi32(d[1], 16));
    _mm512_storeu_ps(out, _mm512_cvtph_ps(_mm512_castsi512_si256(pairs)));
    _mm512_storeu_ps(out + kTile, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(pairs, 1)));
    if (mins) {              // the high halves
      const __m512i high = _mm512_mask_blend_epi16(0xAAAAAAAA, _mm512_srli_epi32(d[0], 16), d[1]);
      _mm512_storeu_ps(mins, _mm512_cvtph_ps(_mm512_castsi512_si256(high)));
      _mm512_storeu_ps(mins + kTile, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(high, 1)));
    }
  }
}

// acc (16 columns x G units x W rows: acc[j] lane l is flat index f = 16 j + l = (c G + i) W + m) += group
// gi's C tile, scaled: lane l takes the scale at f / W of the group's (16, G) and the dx pattern's lane l.
template <int W, int G, bool MINS>
inline void add_group(const int32_t* cb, const TiledX& tx, const float* scale, const float* cmin, int64_t rt,
                      int64_t gi, __m512* acc) {
  const __m512 dxv = _mm512_loadu_ps(tx.dx.data() + (rt * tx.groups + gi) * kTile);
  [[maybe_unused]] const __m512 dsv = MINS ? _mm512_loadu_ps(tx.ds.data() + (rt * tx.groups + gi) * kTile)
                                           : _mm512_setzero_ps();
  const auto spread = [](const float* v) {   // v[l / W] in lane l
    if constexpr (W == 1) return _mm512_loadu_ps(v);
    else if constexpr (W == kTile) return _mm512_set1_ps(v[0]);
    else
      return _mm512_permutexvar_ps(_mm512_srli_epi32(lanes16(), W == 2 ? 1 : W == 4 ? 2 : 3), _mm512_loadu_ps(v));
  };
  for (int j = 0; j < G * W; ++j) {
    acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cb + j * kTile)),
                             _mm512_mul_ps(dxv, spread(scale + j * kTile / W)), acc[j]);
    if constexpr (MINS) acc[j] = _mm512_fmadd_ps(dsv, spread(cmin + j * kTile / W), acc[j]);
  }
}

template <int64_t KIND, int W>
void tile_columns(const TiledX& tx, const QuantizedX& qx, const uint8_t* w, int64_t n, float* out, int64_t begin,
                  int64_t end) {
  using K = Kind<KIND>;
  constexpr int64_t uk = K::halves ? 16 : 32;          // K bytes per unit
  constexpr int G = static_cast<int>(group_of(uk, W));
  const int64_t nb = tx.nb, groups = tx.groups, row_bytes = qx.k / K::weights * K::bytes, lda = qx.k;
  TileConfig cfg;
  for (int i : {0, 3}) cfg.rows[i] = kTile, cfg.colsb[i] = G * uk;           // A: 16 columns x G units' bytes
  for (int i : {1, 4}) cfg.rows[i] = G * uk / 4, cfg.colsb[i] = 4 * G * W;   // B: those bytes / 4 x G W x 4
  for (int i : {2, 5, 6, 7}) cfg.rows[i] = kTile, cfg.colsb[i] = 4 * G * W;  // C: 16 columns x G W int32
  _tile_loadconfig(&cfg);
  ColumnTile side[2];
  for (ColumnTile& t : side) t.allocate(qx.k, groups * kTile * G);
  alignas(64) int32_t cb[kLag][kTile * kTile];   // the last kLag groups' C tiles
  alignas(64) float sums[kTile * kTile];
  const int64_t stop = std::min(n, end * kTile), steps = tx.tiles * groups;
  const auto columns_at = [&](int64_t n0) { return n0 < stop ? std::min(kTile, n - n0) : int64_t{0}; };
  // Each column's row is asked of memory whole (prefetcht1, all its lines at once) just before it is decoded:
  // measured, that streams faster than the hardware's prefetch alone, or than software prefetch further ahead.
  const auto decode_at = [&](int64_t first, int64_t col, ColumnTile& into) {
    const char* row = reinterpret_cast<const char*>(w + (first + col) * row_bytes);
    for (const char* line = row; line < row + row_bytes; line += 64) _mm_prefetch(line, _MM_HINT_T1);
    decode_column<KIND, G>(w + (first + col) * row_bytes, nb, col, into);
  };
  if (columns_at(begin * kTile) < kTile) side[0].clear(qx.k);
  for (int64_t col = 0; col < columns_at(begin * kTile); ++col) decode_at(begin * kTile, col, side[0]);
  for (int64_t n0 = begin * kTile, now = 0; n0 < stop; n0 += kTile, now ^= 1) {
    const int64_t cols = columns_at(n0), next_cols = columns_at(n0 + kTile);
    const ColumnTile& s = side[now];
    const auto add = [&](const int32_t* c, int64_t rt, int64_t gi, __m512* acc) {
      alignas(64) float gathered[kTile * G], gathered_c[kTile * G];
      const float* scale = s.scale.data() + gi * kTile * G;
      const float* cmin = s.c.data() + gi * kTile * G;
      if constexpr (KIND == kQ4_1 || KIND == kQ5_0 || KIND == kQ8_0) {
        half_scales<KIND, G>(w + n0 * row_bytes, row_bytes, gi, tx.units, cols, gathered,
                             KIND == kQ4_1 ? gathered_c : nullptr);
        scale = gathered;
        if constexpr (KIND == kQ4_1) cmin = gathered_c;
      }
      add_group<W, G, K::mins>(c, tx, scale, cmin, rt, gi, acc);
    };
    ColumnTile& next = side[now ^ 1];
    if (next_cols > 0 && next_cols < kTile) next.clear(qx.k);
    int64_t decoded = 0, due = 0;       // the next tile's columns decoded so far, spread evenly over the steps
    for (int64_t rt = 0; rt < tx.tiles; ++rt) {
      const int8_t* bx = tx.b.data() + rt * groups * G * uk * G * W;
      __m512 acc[G * W];
      for (auto& v : acc) v = _mm512_setzero_ps();
      // The groups in rotation (cpu_gguf_amx.h), the next tile's columns decoded evenly beside them.
      rotate_units(
          groups,
          [&](int64_t) {
            for (due += next_cols; due >= steps; due -= steps, ++decoded) decode_at(n0 + kTile, decoded, next);
          },
          [&](int64_t u) { return s.a + u * G * uk; }, lda, [&](int64_t u) { return bx + u * G * uk * G * W; },
          4 * G * W, cb, 4 * G * W, [&](const int32_t* c, int64_t u) { add(c, rt, u, acc); });
      // out[rt W + m][n0 + c] is the sum over i of sums[(c G + i) W + m]
      for (int j = 0; j < G * W; ++j) _mm512_store_ps(sums + j * kTile, acc[j]);
      const __mmask16 keep = static_cast<__mmask16>((1u << cols) - 1);
      const __m512i at = _mm512_mullo_epi32(lanes16(),
                                            _mm512_set1_epi32(G * W));
      for (int64_t m = 0; m < std::min<int64_t>(W, qx.t - rt * W); ++m) {
        __m512 sum = _mm512_setzero_ps();
        for (int i = 0; i < G; ++i) {
          const __m512i index = _mm512_add_epi32(at, _mm512_set1_epi32(static_cast<int>(i * W + m)));
          sum = _mm512_add_ps(sum, _mm512_i32gather_ps(index, sums, 4));
        }
        _mm512_mask_storeu_ps(out + (rt * W + m) * n + n0, keep, sum);
      }
    }
    for (; decoded < next_cols; ++decoded) decode_at(n0 + kTile, decoded, next);
  }
  _tile_release();
}

template <int64_t KIND>
void amx_kind(const QuantizedX& qx, const uint8_t* w, int64_t n, float* out) {
  const TiledX tx = tile_x(qx, Kind<KIND>::halves ? 16 : 32, Kind<KIND>::mins);
  const int64_t tiles = (n + kTile - 1) / kTile;
  const int64_t threads = std::max<int64_t>(1, torch::stable::get_num_threads());
  const int64_t grain = std::max<int64_t>(1, (tiles + threads - 1) / threads);
  torch::stable::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    switch (tx.width) {
      case 1: tile_columns<KIND, 1>(tx, qx, w, n, out, begin, end); break;
      case 2: tile_columns<KIND, 2>(tx, qx, w, n, out, begin, end); break;
      case 4: tile_columns<KIND, 4>(tx, qx, w, n, out, begin, end); break;
      case 8: tile_columns<KIND, 8>(tx, qx, w, n, out, begin, end); break;
      default: tile_columns<KIND, 16>(tx, qx, w, n, out, begin, end); break;
    }
  });
}
#endif

}  // namespace

namespace infermesh_gguf {

bool amx_usable() {
#if defined(GGUF_AMX)
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;     // <asm/prctl.h>, the kernel's xstate
  static const bool granted = syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
#else
  return false;
#endif
}

void amx_linear(int64_t kind, const QuantizedX& qx, const uint8_t* w, int64_t n, float* out) {
#if defined(GGUF_AMX)
  if (qx.t > 8) return amx_linear_wide(kind, qx, w, n, out);
  switch (kind) {
    case kQ4_1: amx_kind<kQ4_1>(qx, w, n, out); break;
    case kQ5_0: amx_kind<kQ5_0>(qx, w, n, out); break;
    case kQ8_0: amx_kind<kQ8_0>(qx, w, n, out); break;
    case kQ4_K: amx_kind<kQ4_K>(qx, w, n, out); break;
    case kQ5_K: amx_kind<kQ5_K>(qx, w, n, out); break;
    case kQ6_K: amx_kind<kQ6_K>(qx, w, n, out); break;
    default: break;
  }
#else
  (void)kind, (void)qx, (void)w, (void)n, (void)out;
#endif
}

}  // namespace infermesh_gguf
