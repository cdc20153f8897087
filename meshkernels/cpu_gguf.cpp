// GGUF weight blocks, exactly as a GGUF file stores them, times int8-quantized activations (as
// llama.cpp multiplies them); built with the other CPU sources into one library by meshkernels/cpu_ops.py.
//
// gguf_linear(x (T, K) float32, blocks (N, K / 32 * bytes) uint8, kind, out (T, N)! float32):
//   out = x W^T where W's rows are N rows of blocks of `kind`, a GGML type id:
//   Q4_1 = 3 (20 bytes / 32 weights), Q5_0 = 6 (22 / 32), Q8_0 = 8 (34 / 32), Q4_K = 12 (144 / 256),
//   Q5_K = 13 (176 / 256), Q6_K = 14 (210 / 256).  K-quants need K a multiple of 256.
//
// Block layouts (gguf-py's gguf.quants dequantizes them; meshkernels/gguf_blocks.py is the torch reference):
//   Q4_1: fp16 d, fp16 m, 16 bytes qs; element j < 16 is qs[j] & 15, element j + 16 is qs[j] >> 4;
//         weight i is d * q[i] + m.
//   Q8_0: fp16 d, 32 int8 q; weight j is d * q[j].
//   Q5_0: fp16 d, uint32 qh (little-endian), 16 bytes qs; element j < 16 has the 4 low bits qs[j] & 15,
//         element j + 16 has qs[j] >> 4, and element i's 5th bit is (qh >> i) & 1; weight i is
//         d * (q[i] - 16).
//   Q4_K: fp16 d, fp16 dmin, 12 bytes of 6-bit scales sc[8] and mins m[8] (cpu_gguf.h's scales_mins_k4),
//         128 bytes qs: sub-block 2g + s (32 weights) is qs[32 g + l] >> 4 s & 15; w = d sc q - dmin m.
//   Q5_K: as Q4_K with 32 bytes qh after the scales: bit j of qh[l] is the 5th bit of sub-block j's l.
//   Q6_K: 128 bytes ql, 64 bytes qh, 16 int8 scales (one per 16 weights), fp16 d; element 128 h + 32 g + l
//         is (ql[64 h + 32 (g & 1) + l] >> 4 (g >> 1)) & 15 | ((qh[32 h + l] >> 2 g) & 3) << 4;
//         w = d * sc * (q - 32).
//
// x is quantized once per call, per row and per 32-element block, as llama.cpp's Q8_0 activations are
// (cpu_gguf_x.cpp): dx = max|x| / 127, qx = round(x * (1 / dx)) (to nearest even), kept with a float32 dx
// (not fp16).  Each block's (or Q6_K half-block's) integer dot product is exact in int32; the row's sum
// adds scale * dx * dot (and the block's c * dx * sum(qx): Q4_1's m, Q4_K / Q5_K's -dmin * m) in float32.
//
// Paths.  Q4_K and Q6_K at 1-4 rows (AVX512-VNNI builds): cpu_gguf_q8k.cpp, with x quantized per 256 instead
// (llama.cpp's Q8_K) and each super-block's dot product one integer (faster than AMX there, measured).
// Else from KindInfo::amx_rows rows on (1 for Q4_1, Q5_0, Q4_K, Q5_K, Q6_K; 2 for Q8_0), AMX-INT8 tiles where
// the CPU and the OS allow them (cpu_gguf_amx.cpp up to 8 rows: tiles sized to the rows, the next 16 columns
// decoded in registers while the tile unit multiplies these; cpu_gguf_amx16.cpp from 9 rows: 16-row tiles).
// Else, per output column, 8 (AVX-512) or 4 rows at a time share each decoded block: the weight is the
// unsigned operand of VNNI's dpbusd / AVX2's maddubs, with an offset (Q5_0's 16, Q8_0's 128 as q ^ 0x80,
// Q6_K's 32) whose product with the activations is taken off in each lane's integer sum (so every lane
// holds an exact partial dot product);
// AVX2 would saturate Q8_0's offset pairs, so there the weight's sign moves onto qx instead (|q| unsigned,
// sign(qx, q)), as llama.cpp does.  Vector paths: AVX512-VNNI (two blocks per 512-bit vector), VNNI on
// 256 bits (AVX512-VL or AVX-VNNI), AVX2, portable scalar.  meshkernels/cpu_ops.py picks the compiler flags
// (INFERMESH_CPU_ISA=avx512|avxvnni|avx2|portable builds a lower path; avx512 is all but AMX).
//
// kind + 256: blocks repacked 16 rows at a time by gguf_repack (cpu_gguf_r16.cpp's layout and products,
// cpu_gguf_r16_pack.cpp's repacking): one vector instruction multiplies 16 columns; the plan's `ggufr` kind.
// gguf_repack(blocks (N, row bytes) uint8, kind, forward) -> (N, row bytes): the repacked blocks (forward),
// or the file's again.

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
#include "cpu_api.h"

namespace {

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

// The per-row vectors the column loop reads (built once per call for the kind's offset):
struct Lanes {
  std::vector<int32_t> init;   // -offset * the sum of the 4 qx whose products each dpbusd lane sums, so that
                               // every lane holds its own exact partial dot product (taking the offset off
                               // in one lane would leave float32 to cancel it across lanes): (T, K / 4)
  std::vector<float> scale;    // ZMM: (T, pairs, 16), dx of block 2 p in lanes 0-7, of block 2 p + 1 in 8-15
  std::vector<float> ds;       // (T, nb) dx * sum(qx), for Q4_1 / Q4_K / Q5_K's mins
};

Lanes lanes_for(const QuantizedX& qx, int64_t offset, bool mins) {
  Lanes out;
  const int64_t t = qx.t, nb = qx.nb;
#if defined(GGUF_ZMM)
  const int64_t pairs = (nb + 1) / 2;
  out.scale.assign(static_cast<size_t>(t * pairs * 16), 0.0f);
  for (int64_t i = 0; i < t * nb; ++i) {
    const int64_t r = i / nb, b = i % nb;
    std::fill_n(out.scale.begin() + ((r * pairs + b / 2) * 16 + (b % 2) * 8), 8, qx.d[static_cast<size_t>(i)]);
  }
#endif
  if (offset) {
    // Rows padded to whole pairs (an odd last block's partner lanes read zeros).
    const int64_t width = (nb + 1) / 2 * 16;
    out.init.assign(static_cast<size_t>(t * width), 0);
    for (int64_t r = 0; r < t; ++r)
      for (int64_t l = 0; l < qx.k / 4; ++l) {
        const int8_t* q = qx.q.data() + r * qx.k + 4 * l;
        out.init[static_cast<size_t>(r * width + l)] = static_cast<int32_t>(-offset * (q[0] + q[1] + q[2] + q[3]));
      }
  }
  if (mins) {
    out.ds.resize(static_cast<size_t>(t * nb));
    for (int64_t i = 0; i < t * nb; ++i)
      out.ds[static_cast<size_t>(i)] = qx.d[static_cast<size_t>(i)] *
          static_cast<float>(qx.s16[static_cast<size_t>(2 * i)] + qx.s16[static_cast<size_t>(2 * i + 1)]);
  }
  return out;
}

// One column's decoded chunk of up to 8 blocks.
struct Decoded {
  alignas(64) uint8_t u[kChunk][kBlock];
  alignas(64) float a[2 * kChunk];      // per unit: a block, or a Q6_K half-block
  alignas(32) float c[kChunk];
};

// out[r * ldo] = x[r0 + r] . W[n] for R rows, W[n] being the row of blocks at w.
template <int64_t KIND, int R>
void dot_rows(const QuantizedX& qx, const Lanes& ln, int64_t r0, const uint8_t* w, float* out, int64_t ldo) {
  using K = Kind<KIND>;
  constexpr int units = K::halves ? 2 : 1;
  const int64_t nb = qx.nb, k = qx.k;
  const int8_t* q = qx.q.data() + r0 * k;
  Decoded dec;
  std::fill_n(dec.a, 2 * kChunk, 0.0f);     // an odd last block's partner lanes read finite scales
  float mins[R] = {};
#if defined(GGUF_ZMM)
  const int64_t pairs = (nb + 1) / 2;
  // unit i's scale over the lanes its sums land in: a block's 8 lanes, or a half-block's 4
  const __m512i spread = K::halves ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)
                                   : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
#elif defined(__AVX2__)
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
#else
  float acc[R] = {};
#endif
  for (int64_t b0 = 0; b0 < nb; b0 += kChunk, w += Kind<KIND>::bytes * (K::weights == kBlock ? kChunk : 1)) {
    const int blocks = static_cast<int>(std::min<int64_t>(kChunk, nb - b0));
#if defined(GGUF_ZMM)
    if constexpr (KIND != kQ8_0)
#endif
      decode<KIND, false>(w, blocks, dec.u[0], kBlock, dec.a, 1, dec.c, 1);
#if defined(GGUF_ZMM)
    for (int j = 0; j < blocks; j += 2) {
      const bool two = j + 1 < blocks;       // else the last block alone, the upper half zero
      const int64_t p = (b0 + j) / 2;
      __m512i u;
      __m512 dw;
      if constexpr (KIND == kQ8_0) {         // straight into registers: a store and reload would cost more
        const uint8_t* lo = w + j * K::bytes;  // than its decoding (Q5_0's, measured, is better decoded first)
        const uint8_t* hi = lo + K::bytes;
        const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
        u = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_xor_si256(load32(lo + 2), flip)),
                               two ? _mm256_xor_si256(load32(hi + 2), flip) : _mm256_setzero_si256(), 1);
        dw = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(half_at(lo)), _mm512_set1_ps(two ? half_at(hi) : 0.0f));
      } else {
        u = two ? _mm512_loadu_si512(dec.u[j]) : _mm512_zextsi256_si512(load32(dec.u[j]));
        dw = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(dec.a + units * j)));
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* xs = q + r * k + (b0 + j) * kBlock;
        const __m512i s = two ? _mm512_loadu_si512(xs)
                              : _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs)));
        const __m512i init = K::offset ? _mm512_loadu_si512(ln.init.data() + (r0 + r) * pairs * 16 + p * 16)
                                       : _mm512_setzero_si512();
        const __m512i dot = _mm512_dpbusd_epi32(init, u, s);
        const __m512 dx = _mm512_loadu_ps(ln.scale.data() + ((r0 + r) * pairs + p) * 16);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, dx), acc[r]);
      }
    }
#elif defined(__AVX2__)
    for (int j = 0; j < blocks; ++j) {
      const int64_t b = b0 + j;
      const __m256i u = load32(dec.u[j]);
      __m256 dw = _mm256_set1_ps(dec.a[units * j]);
      if constexpr (K::halves)
        dw = _mm256_blend_ps(dw, _mm256_set1_ps(dec.a[2 * j + 1]), 0xF0);
#if !defined(GGUF_DPBUSD)
      [[maybe_unused]] const __m256i wq = _mm256_xor_si256(u, _mm256_set1_epi8(static_cast<char>(0x80)));
#endif
      for (int r = 0; r < R; ++r) {
        const __m256i s = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * k + b * kBlock));
        const __m256i init = K::offset ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                             ln.init.data() + (r0 + r) * ((nb + 1) / 2 * 16) + b * 8))
                                       : _mm256_setzero_si256();
#if defined(GGUF_DPBUSD)
        const __m256i dot = GGUF_DPBUSD(init, u, s);
#else
        __m256i dot;
        if constexpr (KIND == kQ8_0)      // |q| as unsigned (-128 -> 128), q's sign onto qx
          dot = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(s, wq)), ones);
        else                              // pairs: at most 2 * 63 * 127, no saturation
          dot = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(u, s), ones), init);
#endif
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw, _mm256_set1_ps(qx.d[(r0 + r) * nb + b])),
                                 acc[r]);
      }
    }
#else
    for (int j = 0; j < blocks; ++j) {
      const int64_t b = b0 + j;
      for (int r = 0; r < R; ++r) {
        const int8_t* s = q + r * k + b * kBlock;
        float sum = 0.0f;
        for (int h = 0; h < 2; ++h) {
          int32_t dot = 0;
          for (int l = 16 * h; l < 16 * h + 16; ++l) dot += (static_cast<int32_t>(dec.u[j][l]) - K::offset) * s[l];
          sum += dec.a[units * j + (K::halves ? h : 0)] * static_cast<float>(dot);
        }
        acc[r] += qx.d[(r0 + r) * nb + b] * sum;
      }
    }
#endif
    if constexpr (K::mins)      // K-quant chunks are whole super-blocks
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < blocks; ++j) mins[r] += dec.c[j] * ln.ds[(r0 + r) * nb + b0 + j];
  }
  for (int r = 0; r < R; ++r) {
#if defined(GGUF_ZMM)
    out[r * ldo] = _mm512_reduce_add_ps(acc[r]) + mins[r];
#elif defined(__AVX2__)
    out[r * ldo] = hsum(acc[r]) + mins[r];
#else
    out[r * ldo] = acc[r] + mins[r];
#endif
  }
}

// A row count below kRows for the remainder's dispatch (counts at or above kRows never reach it).
constexpr int tail(int rows) { return rows < kRows ? rows : 1; }

template <int64_t KIND>
void columns(const QuantizedX& qx, const Lanes& ln, const uint8_t* w, int64_t row_bytes, float* out, int64_t n,
             int64_t begin, int64_t end) {
  const int64_t t = qx.t;
  for (int64_t j = begin; j < end; ++j) {
    const uint8_t* wj = w + j * row_bytes;
    float* o = out + j;
    int64_t r = 0;
    for (; r + kRows <= t; r += kRows) dot_rows<KIND, kRows>(qx, ln, r, wj, o + r * n, n);
    switch (t - r) {
      case 7: dot_rows<KIND, tail(7)>(qx, ln, r, wj, o + r * n, n); break;
      case 6: dot_rows<KIND, tail(6)>(qx, ln, r, wj, o + r * n, n); break;
      case 5: dot_rows<KIND, tail(5)>(qx, ln, r, wj, o + r * n, n); break;
      case 4: dot_rows<KIND, tail(4)>(qx, ln, r, wj, o + r * n, n); break;
      case 3: dot_rows<KIND, 3>(qx, ln, r, wj, o + r * n, n); break;
      case 2: dot_rows<KIND, 2>(qx, ln, r, wj, o + r * n, n); break;
      case 1: dot_rows<KIND, 1>(qx, ln, r, wj, o + r * n, n); break;
      default: break;
    }
  }
}

// Columns [first, n) of out (T, N) = x W^T.
template <int64_t KIND>
void vector_linear(const QuantizedX& qx, const uint8_t* w, int64_t n, float* out, int64_t first) {
  const Lanes ln = lanes_for(qx, Kind<KIND>::offset, Kind<KIND>::mins);
  const int64_t row_bytes = qx.k / Kind<KIND>::weights * Kind<KIND>::bytes;
  // Output features split evenly across threads; each thread streams its rows of W once.
  const int64_t threads = std::max<int64_t>(1, torch::stable::get_num_threads());
  const int64_t grain = std::max<int64_t>(16, (n - first + threads - 1) / threads);
  torch::stable::parallel_for(first, n, grain, [&](int64_t begin, int64_t end) {
    columns<KIND>(qx, ln, w, row_bytes, out, n, begin, end);
  });
}

struct KindInfo {
  int64_t id;
  const char* name;
  int64_t bytes, weights;
  int64_t amx_rows;          // from this many rows on, AMX tiles where usable
  void (*linear)(const QuantizedX&, const uint8_t*, int64_t, float*, int64_t);
};

// AMX from one row for all but Q8_0: its B and C tiles are sized to the rows, so one to four rows cost
// little more than decoding the blocks, which it does in registers; Q8_0 needs no decoding, and its vector
// loop streams the LM head faster at one row (bench/gguf_kernels.py, 2 threads of a Sapphire Rapids, 2 MB
// pages: Q6_K down 0.26 ms on AMX vs 0.38 vector at 1 row; Q8_0 LM head 6.0 vector vs 6.4 AMX at 1 row,
// 7.7 AMX vs 10.8 vector at 2 rows; Q4_1 on SmolLM2's gate_up 576x3072, 1 / 4 rows: 0.086 / 0.105 AMX vs
// 0.145 / 0.185 vector).
constexpr KindInfo kKinds[] = {
    {kQ4_1, "Q4_1", 20, 32, 1, &vector_linear<kQ4_1>},   {kQ5_0, "Q5_0", 22, 32, 1, &vector_linear<kQ5_0>},
    {kQ8_0, "Q8_0", 34, 32, 2, &vector_linear<kQ8_0>},   {kQ4_K, "Q4_K", 144, 256, 1, &vector_linear<kQ4_K>},
    {kQ5_K, "Q5_K", 176, 256, 1, &vector_linear<kQ5_K>}, {kQ6_K, "Q6_K", 210, 256, 1, &vector_linear<kQ6_K>},
};

// The kind's entry (a repacked kind's, kind + kRepacked, where `repacked` allows one), else a precise error.
static_assert(kRepacked == 256, "kind_info's message names it");
const KindInfo* kind_info(int64_t kind, bool repacked, const char* op) {
  for (const KindInfo& candidate : kKinds)
    if (candidate.id == kind || (repacked && candidate.id + kRepacked == kind)) return &candidate;
  fail(op, ": kind must be 3 (Q4_1), 6 (Q5_0), 8 (Q8_0), 12 (Q4_K), 13 (Q5_K) or 14 (Q6_K)",
       repacked ? ", or one of them + 256 (repacked by gguf_repack)" : "", ", got ", kind);
}

void gguf_linear(const Tensor& x, const Tensor& blocks, int64_t kind, const Tensor& out) {
  const char* op = "gguf_linear";
  const bool outliers = kind >= kOutliers;      // repacked blocks, the coarse blocks' outliers kept as floats
  if (outliers) kind -= kOutliers;
  const KindInfo* info = kind_info(kind, true, op);
  const bool repacked = kind >= kRepacked;
  CHECK(repacked || !outliers, op, ": kind + 512 (outliers kept as floats) needs repacked blocks (kind + 256 + 512), got ",
        kind + kOutliers);
  check_float(x, op, "x", 2);
  check_contiguous(x, op, "x");
  check_tensor(blocks, ScalarType::Byte, "uint8", op, "blocks", 2);
  check_contiguous(blocks, op, "blocks");
  check_float(out, op, "out", 2);
  check_contiguous(out, op, "out");
  const int64_t t = x.size(0), k = x.size(1), n = blocks.size(0);
  CHECK(k % info->weights == 0, op, ": in_features ", k, " is not a multiple of ", info->weights,
        info->weights == kBlock ? "" : " (a K-quant super-block)");
  const int64_t nb = k / info->weights;
  CHECK(blocks.size(1) == nb * info->bytes, op, ": blocks ", str(blocks.sizes()), " do not hold rows of ", nb, " ",
        info->name, " blocks of ", info->bytes, " bytes (in_features ", k, ")");
  CHECK(out.size(0) == t && out.size(1) == n, op, ": out must have shape (", t, ", ", n, "), got ",
        str(out.sizes()));
  if (t == 0 || n == 0) return;
  const uint8_t* w = blocks.const_data_ptr<uint8_t>();
  float* o = out.mutable_data_ptr<float>();
  if (!repacked && q8k_linear(kind, x.const_data_ptr<float>(), t, k, w, n, o)) return;
  QuantizedX qx;
  quantize_rows(x.const_data_ptr<float>(), t, k, qx, outliers);
  if (repacked) {     // the groups of 16 rows, then the last n % 16 as the file has them
    r16_linear(info->id, qx, w, n, o);
    if (const int64_t last = n % kCols) {
      const int64_t first = n - last;
      info->linear(qx, w, n, o, first);
      if (qx.words) {   // and the coarse blocks' outliers (zeros elsewhere) over those rows alone
        const int64_t row_bytes = nb * info->bytes;
        std::vector<float> rest(static_cast<size_t>(t * last));
        info->linear(outlier_blocks(qx), w + first * row_bytes, last, rest.data(), 0);
        for (int64_t r = 0; r < t; ++r)
          for (int64_t c = 0; c < last; ++c) o[r * n + first + c] += rest[static_cast<size_t>(r * last + c)];
      }
    }
  } else if (t >= info->amx_rows && amx_usable()) {
    amx_linear(kind, qx, w, n, o);
  } else {
    info->linear(qx, w, n, o, 0);
  }
}

// blocks (N, row bytes) of `kind` (the file's layout) repacked for gguf_linear's kind + 256; `forward` false:
// repacked blocks back to the file's layout.
Tensor gguf_repack(const Tensor& blocks, int64_t kind, bool forward) {
  const char* op = "gguf_repack";
  const KindInfo* info = kind_info(kind, false, op);
  check_tensor(blocks, ScalarType::Byte, "uint8", op, "blocks", 2);
  check_contiguous(blocks, op, "blocks");
  CHECK(blocks.size(1) % info->bytes == 0, op, ": rows of ", blocks.size(1), " bytes are not whole ", info->name,
        " blocks of ", info->bytes, " bytes");
  Tensor out = torch::stable::new_empty(blocks, {blocks.size(0), blocks.size(1)});
  if (blocks.numel())
    r16_repack(kind, blocks.const_data_ptr<uint8_t>(), blocks.size(0), blocks.size(1), out.mutable_data_ptr<uint8_t>(),
               forward);
  return out;
}

}  // namespace

namespace infermesh_cpu {
void gguf_linear(const Tensor& x, const Tensor& blocks, int64_t kind, const Tensor& out) {
  ::gguf_linear(x, blocks, kind, out);
}
}  // namespace infermesh_cpu

STABLE_TORCH_LIBRARY_FRAGMENT(infermesh, m) {
  m.def("gguf_linear(Tensor x, Tensor blocks, int kind, Tensor(a!) out) -> ()");
  m.def("gguf_repack(Tensor blocks, int kind, bool forward) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(infermesh, CPU, m) {
  m.impl("gguf_linear", TORCH_BOX(&gguf_linear));
  m.impl("gguf_repack", TORCH_BOX(&gguf_repack));
}
