// What gguf_linear's two AMX-INT8 paths share (cpu_gguf_amx.cpp: 1-8 rows of x; cpu_gguf_amx16.cpp: more):
// when the build has AMX (GGUF_AMX), the tile configuration's layout and the rotation of tiles over a row
// tile's units (rotate_units).  Included after cpu_gguf.h (kTile).

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__linux__)
#define GGUF_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(GGUF_AMX)
namespace {

constexpr int64_t kLag = 8;         // units between a C tile's product and its float sum

struct TileConfig {                 // ldtilecfg's 64-byte palette-1 layout
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// A unit's product into tile C (A in tile TA, B in TB); a macro, as GCC's tile intrinsics take the tile
// numbers as literal text.
#define GGUF_MULTIPLY(TA, TB, C, a, b) \
  do {                                 \
    _tile_loadd(TA, a, lda);           \
    _tile_loadd(TB, b, ldb);           \
    _tile_zero(C);                     \
    _tile_dpbssd(C, TA, TB);           \
  } while (false)

// One row tile's units in order: unit u multiplies in A and B tiles (0, 1) or (3, 4) by u's parity into C
// tile 2, 5, 6 or 7 by u % 4, while unit u - 1's C tile is stored (to cb[(u - 1) % kLag], ldc bytes a row) and
// unit u - kLag's, stored kLag - 1 units ago, is added; then the last C is stored and the last kLag added.
// AMX tiles are not renamed (a tile is rewritten only once what reads it is done), so rotating them lets
// the tile unit run ahead, and the float work never waits on its latency.  before(u) runs first at each
// unit (decoding or prefetching the next column tile beside the products); a_at(u) / b_at(u) give the
// unit's A (lda bytes a row) and B (ldb); add(c, u) adds unit u's stored C into the accumulators.  Always
// inlined: called through a function, the accumulators left the registers (up to 15% slower, measured).
template <typename Before, typename AAt, typename BAt, typename Add>
__attribute__((always_inline)) inline void rotate_units(int64_t units, Before&& before, AAt&& a_at, int64_t lda,
                                                       BAt&& b_at, int64_t ldb, int32_t (*cb)[kTile * kTile],
                                                       int64_t ldc, Add&& add) {
  for (int64_t u = 0; u < units; ++u) {
    before(u);
    const int8_t* a = a_at(u);
    const int8_t* b = b_at(u);
    int32_t* prev = cb[(u + kLag - 1) % kLag];
    switch (u % 4) {
      case 0: GGUF_MULTIPLY(0, 1, 2, a, b); if (u > 0) _tile_stored(7, prev, ldc); break;
      case 1: GGUF_MULTIPLY(3, 4, 5, a, b); _tile_stored(2, prev, ldc); break;
      case 2: GGUF_MULTIPLY(0, 1, 6, a, b); _tile_stored(5, prev, ldc); break;
      default: GGUF_MULTIPLY(3, 4, 7, a, b); _tile_stored(6, prev, ldc); break;
    }
    if (u >= kLag) add(cb[(u - kLag) % kLag], u - kLag);
  }
  int32_t* last = cb[(units - 1) % kLag];
  switch ((units - 1) % 4) {
    case 0: _tile_stored(2, last, ldc); break;
    case 1: _tile_stored(5, last, ldc); break;
    case 2: _tile_stored(6, last, ldc); break;
    default: _tile_stored(7, last, ldc); break;
  }
  for (int64_t u = std::max<int64_t>(0, units - kLag); u < units; ++u) add(cb[u % kLag], u);
}

#undef GGUF_MULTIPLY

}  // namespace
#endif
