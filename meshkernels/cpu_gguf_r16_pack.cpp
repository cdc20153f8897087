// gguf_repack's work (cpu_gguf.cpp's op): a GGUF weight's rows to cpu_gguf_r16.cpp's layout and back.
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

// The file's block at w from u[8][32] (the q bits only; the scales are copied apart), cpu_gguf.h's decode
// undone.
template <int64_t KIND>
void encode_file(const uint8_t (*u)[kBlock], uint8_t* w) {
  if constexpr (KIND == kQ4_1) {
    for (int l = 0; l < 16; ++l) w[4 + l] = static_cast<uint8_t>(u[0][l] | u[0][l + 16] << 4);
  } else if constexpr (KIND == kQ5_0) {
    uint32_t qh = 0;
    for (int l = 0; l < 16; ++l) w[6 + l] = static_cast<uint8_t>((u[0][l] & 15) | (u[0][l + 16] & 15) << 4);
    for (int l = 0; l < 32; ++l) qh |= static_cast<uint32_t>(u[0][l] >> 4) << l;
    std::memcpy(w + 2, &qh, 4);
  } else if constexpr (KIND == kQ8_0) {
    for (int l = 0; l < 32; ++l) w[2 + l] = static_cast<uint8_t>(u[0][l] ^ 0x80);
  } else if constexpr (KIND == kQ4_K || KIND == kQ5_K) {
    uint8_t* qs = w + (KIND == kQ5_K ? 48 : 16);
    for (int g = 0; g < 4; ++g)
      for (int l = 0; l < 32; ++l) qs[32 * g + l] = static_cast<uint8_t>((u[2 * g][l] & 15) | (u[2 * g + 1][l] & 15) << 4);
    if constexpr (KIND == kQ5_K)
      for (int l = 0; l < 32; ++l) {
        uint8_t bits = 0;
        for (int j = 0; j < 8; ++j) bits |= static_cast<uint8_t>((u[j][l] >> 4) << j);
        w[16 + l] = bits;
      }
  } else {   // Q6_K: block 4 h + g, element l
    std::memset(w, 0, 192);
    for (int h = 0; h < 2; ++h)
      for (int g = 0; g < 4; ++g)
        for (int l = 0; l < 32; ++l) {
          const int q = u[4 * h + g][l];
          w[64 * h + 32 * (g & 1) + l] |= static_cast<uint8_t>((q & 15) << (4 * (g >> 1)));
          w[128 + 32 * h + l] |= static_cast<uint8_t>(((q >> 4) & 3) << (2 * g));
        }
  }
}

// Rows [0, 16 * (n / 16)) of `src` (the file's layout, `row_bytes` a row) into `dst` repacked (forward), or
// back; the last n % 16 rows copied as they are.
template <int64_t KIND>
void repack(const uint8_t* src, int64_t n, int64_t row_bytes, uint8_t* dst, bool forward) {
  using K = Kind<KIND>;
  const int64_t units = row_bytes / K::bytes, groups = n / kCols, unit_bytes = kCols * K::bytes;
  torch::stable::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    uint8_t u[kChunk][kBlock];
    float a[2 * kChunk], mins[kChunk];
    for (int64_t gi = begin; gi < end; ++gi)
      for (int64_t s = 0; s < units; ++s) {
        const int64_t at = gi * kCols * row_bytes + s * unit_bytes;        // the group's unit s
        uint8_t* p = forward ? dst + at : const_cast<uint8_t*>(src) + at;
        if (forward) std::memset(p, 0, static_cast<size_t>(unit_bytes));
        for (int c = 0; c < kCols; ++c) {
          const int64_t file_at = (gi * kCols + c) * row_bytes + s * K::bytes;   // column c's unit s
          uint8_t* w = forward ? const_cast<uint8_t*>(src) + file_at : dst + file_at;
          if (forward) {
            decode<KIND, false>(w, static_cast<int>(blocks_of<KIND>()), u[0], kBlock, a, 1, mins, 1);
            for (int j = 0; j < blocks_of<KIND>(); ++j)
              for (int l = 0; l < kBlock; ++l) write_u<KIND>(p, c, j, l, u[j][l]);
            move_scales<KIND>(p, c, w, true);
          } else {
            for (int j = 0; j < blocks_of<KIND>(); ++j)
              for (int l = 0; l < kBlock; ++l) u[j][l] = static_cast<uint8_t>(read_u<KIND>(p, c, j, l));
            encode_file<KIND>(u, w);
            move_scales<KIND>(p, c, w, false);
          }
        }
      }
  });
  const int64_t done = groups * kCols * row_bytes;
  std::memcpy(dst + done, src + done, static_cast<size_t>(n * row_bytes - done));
}

}  // namespace

namespace infermesh_gguf {

bool r16_repack(int64_t kind, const uint8_t* src, int64_t n, int64_t row_bytes, uint8_t* dst, bool forward) {
  switch (kind) {
    case kQ4_1: repack<kQ4_1>(src, n, row_bytes, dst, forward); return true;
    case kQ5_0: repack<kQ5_0>(src, n, row_bytes, dst, forward); return true;
    case kQ8_0: repack<kQ8_0>(src, n, row_bytes, dst, forward); return true;
    case kQ4_K: repack<kQ4_K>(src, n, row_bytes, dst, forward); return true;
    case kQ5_K: repack<kQ5_K>(src, n, row_bytes, dst, forward); return true;
    case kQ6_K: repack<kQ6_K>(src, n, row_bytes, dst, forward); return true;
    default: return false;
  }
}

}  // namespace infermesh_gguf
