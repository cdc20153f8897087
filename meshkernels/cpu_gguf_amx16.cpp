// gguf_linear's AMX-INT8 path for more than 8 rows (cpu_gguf_amx.cpp's amx_linear hands them here): x in
// 16-row tiles, one unit (a block, or a Q6_K half-block) per tdpbssd, W's blocks decoded to signed bytes
// (cpu_gguf.h's decode, u - offset) 16 output columns at a time.  cpu_gguf_amx.cpp's row-sized tiles and
// interleaved decoding measured slower from 9 rows on (Q6_K down at 16 rows: 0.60 ms there, 0.45 here).
//
// A tile = 16 weight columns x one unit's bytes (32, or a Q6_K half-block's 16), B tile = the same
// bytes of 16 activation rows in AMX's 4-byte-interleaved layout (built once per call), C (16 x 16
// int32) = tdpbssd(A, B): each column's exact integer dot product with each row for that unit.  Scales
// differ per unit on both sides, so every unit's C is stored and added in float32 into 16 accumulators
// (one per column, lanes = rows): acc += float(C) * (dx * a) (+ c * dx * sum(qx) for Q4_1 / Q4_K / Q5_K's mins),
// the same arithmetic as the vector paths.  That per-unit float work (and the tile store before it) is
// most of the time from about 16 rows on: tdpbssd itself would take a fraction.
//
// Per thread, a range of 16-column tiles; per tile: decode its blocks (chunk by chunk across the 16
// columns, so the A buffer's chunk stays in L1), prefetch the next tile's rows into L2, then for each
// 16-row tile of x run the units with A/B tiles alternating over two sets and C over four (AMX tiles are
// not renamed), adding each unit's C kLag units after its product.
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
constexpr int64_t kRowTile = kTile;    // rows of x, and columns of W, per tile

// x in B-tile layout, per tile of 16 rows (rows past T are zeros):
struct WideX {
  int64_t tiles = 0, nb = 0, units = 0;
  std::vector<int8_t> b;     // (tiles, nb, 8, 64): row i of block b holds bytes 4i..4i+3 of each of the 16 rows
  std::vector<float> dx;     // (tiles, units, 16) the rows' dx for the unit's block
  std::vector<float> ds;     // (tiles, nb, 16) dx * sum(qx), for Q4_1 / Q4_K / Q5_K's mins
};

WideX wide_x(const QuantizedX& qx, int64_t upb, bool mins) {
  WideX out;
  const int64_t nb = qx.nb;
  out.tiles = (qx.t + kRowTile - 1) / kRowTile, out.nb = nb, out.units = nb * upb;
  out.b.assign(static_cast<size_t>(out.tiles * nb * 512), 0);
  out.dx.assign(static_cast<size_t>(out.tiles * out.units * kRowTile), 0.0f);
  if (mins) out.ds.assign(static_cast<size_t>(out.tiles * nb * kRowTile), 0.0f);
  const __m512i row_at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(static_cast<int>(qx.k)));
  for (int64_t rt = 0; rt < out.tiles; ++rt) {
    const int64_t rows = std::min(kRowTile, qx.t - rt * kRowTile);
    const __mmask16 live = static_cast<__mmask16>((1u << rows) - 1);
    const int8_t* q = qx.q.data() + rt * kRowTile * qx.k;
    for (int64_t b = 0; b < nb; ++b)      // row i of block b's B tile: bytes 4 i..4 i + 3 of each of the 16 rows
      for (int i = 0; i < 8; ++i) {
        const int8_t* at = q + b * kBlock + 4 * i;
        _mm512_storeu_si512(out.b.data() + (rt * nb + b) * 512 + i * 64,
                            _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, row_at, at, 1));
      }
    for (int64_t m = 0; m < rows; ++m) {
      const int64_t row = rt * kRowTile + m;
      for (int64_t b = 0; b < nb; ++b) {
        const float d = qx.d[static_cast<size_t>(row * nb + b)];
        for (int64_t u = 0; u < upb; ++u)
          out.dx[static_cast<size_t>((rt * out.units + b * upb + u) * kRowTile + m)] = d;
        if (mins)
          out.ds[static_cast<size_t>((rt * nb + b) * kRowTile + m)] =
              d * static_cast<float>(qx.s16[static_cast<size_t>(2 * (row * nb + b))] +
                                     qx.s16[static_cast<size_t>(2 * (row * nb + b) + 1)]);
      }
    }
  }
  return out;
}

// One thread's decoded tile of 16 weight columns.
struct WideTile {
  std::vector<int8_t> a;     // (nb, 16, 32): block b of column c, signed
  std::vector<float> scale;  // (units, 16)
  std::vector<float> c;      // (nb, 16)
  alignas(64) int32_t cb[kLag][kRowTile * kRowTile];  // the last kLag units' C tiles
  alignas(64) float acc[kRowTile * kRowTile];
};

template <int64_t KIND>
void decode_tile(const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t cols, WideTile& s) {
  using K = Kind<KIND>;
  constexpr int64_t upb = K::halves ? 2 : 1;
  if (cols < kRowTile) {        // the last tile's missing columns: zero weights and scales
    std::fill(s.a.begin(), s.a.end(), 0);
    std::fill(s.scale.begin(), s.scale.end(), 0.0f);
    std::fill(s.c.begin(), s.c.end(), 0.0f);
  }
  // Chunk by chunk, all columns: a chunk's 4 KB of A stays in L1 while its 16 columns fill it (column
  // by column, the 512-byte stride would cycle 8 cache sets and miss on every store).
  for (int64_t b0 = 0; b0 < nb; b0 += kChunk) {
    const int blocks = static_cast<int>(std::min<int64_t>(kChunk, nb - b0));
    for (int64_t col = 0; col < cols; ++col)
      decode<KIND, true>(w + col * row_bytes + b0 * kBlock / K::weights * K::bytes,
                         blocks, reinterpret_cast<uint8_t*>(s.a.data() + (b0 * kRowTile + col) * kBlock),
                         kRowTile * kBlock, s.scale.data() + b0 * upb * kRowTile + col, kRowTile,
                         K::mins ? s.c.data() + b0 * kRowTile + col : nullptr, kRowTile);
  }
}

// acc[c] (lanes = rows) += unit u's C tile, scaled.
template <bool MINS>
inline void add_unit(const int32_t* cb, const WideX& tx, const WideTile& s, int64_t rt, int64_t u, __m512* acc) {
  const __m512 dxv = _mm512_loadu_ps(tx.dx.data() + (rt * tx.units + u) * kRowTile);
  const float* scale = s.scale.data() + u * kRowTile;
  for (int c = 0; c < kRowTile; ++c)
    acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cb + c * kRowTile)),
                             _mm512_mul_ps(dxv, _mm512_set1_ps(scale[c])), acc[c]);
  if constexpr (MINS) {      // units are blocks here
    const __m512 dsv = _mm512_loadu_ps(tx.ds.data() + (rt * tx.nb + u) * kRowTile);
    const float* cmin = s.c.data() + u * kRowTile;
    for (int c = 0; c < kRowTile; ++c) acc[c] = _mm512_fmadd_ps(dsv, _mm512_set1_ps(cmin[c]), acc[c]);
  }
}

template <int64_t KIND>
void tile_columns(const WideX& tx, const QuantizedX& qx, const uint8_t* w, int64_t n, float* out, int64_t begin,
                  int64_t end) {
  using K = Kind<KIND>;
  constexpr int64_t uk = K::halves ? 16 : 32;          // K bytes per unit
  const int64_t nb = tx.nb, units = tx.units, row_bytes = qx.k / K::weights * K::bytes;
  TileConfig cfg;
  for (int i : {0, 3}) cfg.rows[i] = kRowTile, cfg.colsb[i] = uk;               // A: 16 columns x uk bytes
  for (int i : {1, 4}) cfg.rows[i] = uk / 4, cfg.colsb[i] = 64;              // B: uk / 4 rows x 16 rows x 4
  for (int i : {2, 5, 6, 7}) cfg.rows[i] = kRowTile, cfg.colsb[i] = 64;         // C: 16 x 16 int32
  _tile_loadconfig(&cfg);
  WideTile s;
  s.a.resize(static_cast<size_t>(nb * kRowTile * kBlock));
  s.scale.resize(static_cast<size_t>(units * kRowTile));
  s.c.resize(static_cast<size_t>(nb * kRowTile));
  const auto a_at = [&](int64_t u) {
    return s.a.data() + (K::halves ? (u / 2) * kRowTile * kBlock + (u % 2) * 16 : u * kRowTile * kBlock);
  };
  const __m512i gather = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
  const int64_t stop = std::min(n, end * kRowTile), steps = tx.tiles * units;
  for (int64_t n0 = begin * kRowTile; n0 < stop; n0 += kRowTile) {
    const int64_t cols = std::min(kRowTile, n - n0);
    decode_tile<KIND>(w + n0 * row_bytes, row_bytes, nb, cols, s);
    // The next tile's rows (contiguous) are fetched into L2 while this one multiplies: the decode above
    // would otherwise wait on memory with no arithmetic beside it.
    const char* ahead = reinterpret_cast<const char*>(w + (n0 + cols) * row_bytes);
    const char* ahead_end = reinterpret_cast<const char*>(w + std::min(stop, n0 + cols + kRowTile) * row_bytes);
    const int64_t per_step = (ahead_end - ahead + 64 * steps - 1) / (64 * steps);
    for (int64_t rt = 0; rt < tx.tiles; ++rt) {
      const int8_t* bx = tx.b.data() + rt * nb * 512;
      __m512 acc[kRowTile];
      for (auto& v : acc) v = _mm512_setzero_ps();
      // The units in rotation (cpu_gguf_amx.h), the next tile's rows prefetched evenly beside them.
      rotate_units(
          units,
          [&](int64_t) {
            for (int64_t j = 0; j < per_step && ahead < ahead_end; ++j, ahead += 64) _mm_prefetch(ahead, _MM_HINT_T1);
          },
          a_at, kBlock, [&](int64_t u) { return bx + u * uk * 16; }, 64, s.cb, 64,
          [&](const int32_t* c, int64_t u) { add_unit<K::mins>(c, tx, s, rt, u, acc); });
      // acc[c] lane m is out[rt * 16 + m][n0 + c]
      for (int c = 0; c < kRowTile; ++c) _mm512_store_ps(s.acc + c * kRowTile, acc[c]);
      const __mmask16 keep = static_cast<__mmask16>((1u << cols) - 1);
      for (int64_t m = 0; m < std::min(kRowTile, qx.t - rt * kRowTile); ++m)
        _mm512_mask_storeu_ps(out + (rt * kRowTile + m) * n + n0, keep,
                              _mm512_i32gather_ps(_mm512_add_epi32(gather, _mm512_set1_epi32(static_cast<int>(m))),
                                                  s.acc, 4));
    }
  }
  _tile_release();
}

template <int64_t KIND>
void amx_kind(const QuantizedX& qx, const uint8_t* w, int64_t n, float* out) {
  const WideX tx = wide_x(qx, Kind<KIND>::halves ? 2 : 1, Kind<KIND>::mins);
  const int64_t tiles = (n + kRowTile - 1) / kRowTile;
  const int64_t threads = std::max<int64_t>(1, torch::stable::get_num_threads());
  const int64_t grain = std::max<int64_t>(1, (tiles + threads - 1) / threads);
  torch::stable::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    tile_columns<KIND>(tx, qx, w, n, out, begin, end);
  });
}
#endif

}  // namespace

namespace infermesh_gguf {

void amx_linear_wide(int64_t kind, const QuantizedX& qx, const uint8_t* w, int64_t n, float* out) {
#if defined(GGUF_AMX)
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
