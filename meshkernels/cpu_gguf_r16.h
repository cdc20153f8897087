// cpu_gguf_r16.cpp's layout (its header comment describes it): where each weight's bits and each column's
// scales lie in a repacked unit.  Shared by the products (cpu_gguf_r16.cpp: the portable loop reads it weight
// by weight) and the repacking (cpu_gguf_r16_pack.cpp).  Include after cpu_gguf.h.
#pragma once

namespace {

using namespace infermesh_gguf;

// Byte offsets within one unit of a group (see the header comment).
template <int64_t KIND>
struct R16;
template <>
struct R16<kQ4_1> {
  static constexpr int64_t d = 256, m = 288;
};
template <>
struct R16<kQ5_0> {
  static constexpr int64_t masks = 256, d = 320;
};
template <>
struct R16<kQ8_0> {
  static constexpr int64_t d = 512;
};
template <>
struct R16<kQ4_K> {
  static constexpr int64_t d = 2048, dmin = 2080, planes = 2112;
};
template <>
struct R16<kQ5_K> {
  static constexpr int64_t masks = 2048, d = 2560, dmin = 2592, planes = 2624;
};
template <>
struct R16<kQ6_K> {
  static constexpr int64_t high = 2048, scales = 3072, d = 3328;
};

template <int64_t KIND>
constexpr int64_t blocks_of() { return Kind<KIND>::weights / kBlock; }   // 32-weight blocks per unit
template <int64_t KIND>
constexpr bool five_bits() { return KIND == kQ5_0 || KIND == kQ5_K; }
template <int64_t KIND>
constexpr bool k_scales() { return KIND == kQ4_K || KIND == kQ5_K; }

// u of element l of block j of column c, read from a repacked unit p.
template <int64_t KIND>
int read_u(const uint8_t* p, int c, int j, int l) {
  const int g = (l % 16) / 4, i = l % 4, high = l >= 16;
  if constexpr (KIND == kQ8_0) {
    return p[64 * (2 * g + high) + 4 * c + i];
  } else {
    int u = (p[256 * j + 64 * g + 4 * c + i] >> (4 * high)) & 15;
    if constexpr (five_bits<KIND>()) {
      uint64_t mask;
      std::memcpy(&mask, p + R16<KIND>::masks + 64 * j + 8 * (2 * g + high), 8);
      u |= static_cast<int>((mask >> (4 * c + i)) & 1) << 4;
    }
    if constexpr (KIND == kQ6_K) u |= ((p[R16<kQ6_K>::high + 128 * j + 64 * high + 4 * c + i] >> (2 * g)) & 3) << 4;
    return u;
  }
}

template <int64_t KIND>
void write_u(uint8_t* p, int c, int j, int l, int u) {
  const int g = (l % 16) / 4, i = l % 4, high = l >= 16;
  if constexpr (KIND == kQ8_0) {
    p[64 * (2 * g + high) + 4 * c + i] = static_cast<uint8_t>(u);
  } else {
    p[256 * j + 64 * g + 4 * c + i] |= static_cast<uint8_t>((u & 15) << (4 * high));
    if constexpr (five_bits<KIND>()) {
      uint64_t mask;
      uint8_t* at = p + R16<KIND>::masks + 64 * j + 8 * (2 * g + high);
      std::memcpy(&mask, at, 8);
      mask |= static_cast<uint64_t>((u >> 4) & 1) << (4 * c + i);
      std::memcpy(at, &mask, 8);
    }
    if constexpr (KIND == kQ6_K)
      p[R16<kQ6_K>::high + 128 * j + 64 * high + 4 * c + i] |= static_cast<uint8_t>(((u >> 4) & 3) << (2 * g));
  }
}

// The scale bytes of column c's unit w (the file's) to and from the repacked unit p.
template <int64_t KIND>
void move_scales(uint8_t* p, int c, uint8_t* w, bool to_repacked) {
  auto move = [&](int64_t at, int64_t from, int64_t bytes) {
    if (to_repacked)
      std::memcpy(p + at, w + from, bytes);
    else
      std::memcpy(w + from, p + at, bytes);
  };
  if constexpr (KIND == kQ4_1) {
    move(R16<kQ4_1>::d + 2 * c, 0, 2);
    move(R16<kQ4_1>::m + 2 * c, 2, 2);
  } else if constexpr (KIND == kQ5_0 || KIND == kQ8_0) {
    move(R16<KIND>::d + 2 * c, 0, 2);
  } else if constexpr (k_scales<KIND>()) {
    move(R16<KIND>::d + 2 * c, 0, 2);
    move(R16<KIND>::dmin + 2 * c, 2, 2);
    for (int plane = 0; plane < 3; ++plane) move(R16<KIND>::planes + 64 * plane + 4 * c, 4 + 4 * plane, 4);
  } else {
    for (int s = 0; s < 16; ++s) move(R16<kQ6_K>::scales + 16 * s + c, 192 + s, 1);
    move(R16<kQ6_K>::d + 2 * c, 208, 2);
  }
}

}  // namespace
