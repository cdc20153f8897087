// LoRA updates of a mixed batch's rows in one call per projection (services/engine/runtime/lora.py's `apply`, whose
// torch loop is the reference): for each adapter's rows, t = h[row] A (A: in x rank, the modules' stacked)
// then out[row] += t B over B's nonzero blocks only (B: rank x width, each module's block at its ranks and
// columns; q, k and v share one projection, so two thirds of its merged B are zeros the torch GEMM multiplies).
// A decode step of 16 rows over 4 adapters makes 120 such calls instead of ~1,400 small torch ops.  Reading
// the factors is most of the work (a step reads every adapter's), so they may be float16 (half the bytes;
// the engine keeps them so when its GEMMs are reduced-precision ones): widened to float32 as they are loaded.
// The sums run in another order than the GEMMs', so results agree with the reference to rounding.
//
// `table` (n, 19) int64, one row per adapter of the step: row_start, row_end (into `rows`, the step's rows
// sorted by adapter), A's and B's data pointers (contiguous; 0: the adapter has no factors for this
// projection), rank, blocks, float16 (1) or float32 (0), then up to 3 blocks (rank_start, rank_end, col_start,
// col_end).  The caller keeps the factors alive for the call (a request holds its adapter).

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

#include "cpu_common.h"

constexpr int64_t kColumns = 128;    // the columns of `out` one task updates
constexpr int64_t kTable = 19;
constexpr int64_t kMaxBlocks = 3;
constexpr int64_t kRowGroup = 4;     // rows of one adapter multiplied by each row of A at once
constexpr int kRankChunk = 32;       // ranks one task accumulates (kRowGroup x kRankChunk floats in registers)

// Vectors of floats, loaded from float32 or float16 (binary16 bits) factors.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
using Vec = __m512;
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vload(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline Vec vset(float x) { return _mm512_set1_ps(x); }
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
#elif defined(__AVX2__)
constexpr int kLanes = 8;
using Vec = __m256;
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vload(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline Vec vset(float x) { return _mm256_set1_ps(x); }
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
#else
constexpr int kLanes = 1;
using Vec = float;
inline Vec vload(const float* p) { return *p; }
inline Vec vload(const uint16_t* p) { return half_bits_to_float(*p); }
inline Vec vset(float x) { return x; }
inline Vec vzero() { return 0.0f; }
inline Vec vfma(Vec a, Vec b, Vec c) { return a * b + c; }
inline void vstore(float* p, Vec v) { *p = v; }
inline Vec vadd(Vec a, Vec b) { return a + b; }
#endif

inline float scalar(const float* p) { return *p; }
inline float scalar(const uint16_t* p) { return half_bits_to_float(*p); }

// dst[q, 0..NV*kLanes) = x[q] . a[:, 0..NV*kLanes) for NR rows (a: in x rank, row stride `rank`; dst row stride
// `ld`): each of A's rows is loaded once for all NR rows, the sums held in registers.
template <int NR, int NV, typename W>
void rows_times_a(const float* const* x, const W* a, int64_t in, int64_t rank, float* dst, int64_t ld) {
  Vec acc[NR][NV];
  for (int q = 0; q < NR; ++q)
    for (int v = 0; v < NV; ++v) acc[q][v] = vzero();
  for (int64_t i = 0; i < in; ++i) {
    const W* ai = a + i * rank;
    Vec av[NV];
    for (int v = 0; v < NV; ++v) av[v] = vload(ai + v * kLanes);
    for (int q = 0; q < NR; ++q) {
      const Vec xi = vset(x[q][i]);
      for (int v = 0; v < NV; ++v) acc[q][v] = vfma(xi, av[v], acc[q][v]);
    }
  }
  for (int q = 0; q < NR; ++q)
    for (int v = 0; v < NV; ++v) vstore(dst + q * ld + v * kLanes, acc[q][v]);
}

// f(std::integral_constant<int, nr>{}) for nr rows (1..kRowGroup): the register blocks' row count as a constant.
template <typename F>
void with_rows(int nr, F f) {
  switch (nr) {
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 1>{});
  }
}

template <int NV, typename W>
void rows_times_a(int nr, const float* const* x, const W* a, int64_t in, int64_t rank, float* dst, int64_t ld) {
  with_rows(nr, [&](auto rows) { rows_times_a<decltype(rows)::value, NV>(x, a, in, rank, dst, ld); });
}

// Stage 1 for one task: rows r0..r0+nr of one adapter, ranks j0..j0+nj.
template <typename W>
void task_a(const float* const* x, int nr, const W* a, int64_t in, int64_t rank, int64_t j0, int64_t nj, float* dst,
            int64_t ld) {
  a += j0;
  dst += j0;
  if (nj == kRankChunk) {
    rows_times_a<kRankChunk / kLanes>(nr, x, a, in, rank, dst, ld);
  } else if (nj == 16 && 16 % kLanes == 0) {
    rows_times_a<16 / kLanes>(nr, x, a, in, rank, dst, ld);
  } else {
    for (int q = 0; q < nr; ++q) {
      for (int64_t j = 0; j < nj; ++j) dst[q * ld + j] = 0.0f;
      for (int64_t i = 0; i < in; ++i)
        for (int64_t j = 0; j < nj; ++j) dst[q * ld + j] += x[q][i] * scalar(a + i * rank + j);
    }
  }
}

// Stage 2's register block: o[q][c..c+NV*kLanes) += sum over j in j0..j1 of t[q][j] B[j, c..) for NR rows (B's
// rows `width` apart): NR x NV independent sums, so the multiply-adds overlap instead of waiting on each other.
template <int NR, int NV, typename W>
void block_times_b(float* const* o, const float* const* t, const W* b, int64_t width, int64_t j0, int64_t j1,
                   int64_t c) {
  Vec acc[NR][NV];
  for (int q = 0; q < NR; ++q)
    for (int v = 0; v < NV; ++v) acc[q][v] = vzero();
  for (int64_t j = j0; j < j1; ++j) {
    const W* bj = b + j * width + c;
    Vec bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = vload(bj + v * kLanes);
    for (int q = 0; q < NR; ++q) {
      const Vec tq = vset(t[q][j]);
      for (int v = 0; v < NV; ++v) acc[q][v] = vfma(tq, bv[v], acc[q][v]);
    }
  }
  for (int q = 0; q < NR; ++q)
    for (int v = 0; v < NV; ++v) {
      float* p = o[q] + c + v * kLanes;
      vstore(p, vadd(vload(p), acc[q][v]));
    }
}

template <int NR, typename W>
void rows_times_b(float* const* o, const float* const* t, const W* b, int64_t width, int64_t j0, int64_t j1,
                  int64_t lo, int64_t hi) {
  constexpr int kWide = 4;
  int64_t c = lo;
  for (; c + kWide * kLanes <= hi; c += kWide * kLanes) block_times_b<NR, kWide>(o, t, b, width, j0, j1, c);
  for (; c + kLanes <= hi; c += kLanes) block_times_b<NR, 1>(o, t, b, width, j0, j1, c);
  for (; c < hi; ++c)
    for (int q = 0; q < NR; ++q) {
      float acc = 0.0f;
      for (int64_t j = j0; j < j1; ++j) acc += t[q][j] * scalar(b + j * width + c);
      o[q][c] += acc;
    }
}

// Stage 2 for up to kRowGroup rows of one adapter over columns lo..hi of one block (ranks j0..j1).
template <typename W>
void rows_times_b(float* const* o, const float* const* t, int nr, const W* b, int64_t width, int64_t j0, int64_t j1,
                  int64_t lo, int64_t hi) {
  with_rows(nr, [&](auto rows) { rows_times_b<decltype(rows)::value>(o, t, b, width, j0, j1, lo, hi); });
}

void lora_apply(const Tensor& out, const Tensor& h, const Tensor& rows, const Tensor& table) {
  const char* op = "lora_apply";
  check_float(out, op, "out", 2);
  check_contiguous(out, op, "out");
  check_float(h, op, "h", 2);
  check_contiguous(h, op, "h");
  check_index(rows, op, "rows", 1);
  check_index(table, op, "table", 2);
  CHECK(table.size(1) == kTable, op, ": table must have ", kTable, " columns, got ", table.size(1));
  CHECK(h.size(0) == out.size(0), op, ": h has ", h.size(0), " rows, out ", out.size(0));
  const int64_t in = h.size(1), width = out.size(1), n = table.size(0), count = rows.size(0);
  const int64_t* tab = table.const_data_ptr<int64_t>();
  const int64_t* idx = rows.const_data_ptr<int64_t>();
  int64_t max_rank = 0;
  for (int64_t s = 0; s < n; ++s) {
    const int64_t* e = tab + s * kTable;
    CHECK(0 <= e[0] && e[0] <= e[1] && e[1] <= count, op, ": adapter ", s, "'s rows ", e[0], "..", e[1],
          " are outside rows (", count, ")");
    CHECK(e[5] >= 0 && e[5] <= kMaxBlocks, op, ": adapter ", s, " has ", e[5], " blocks (at most 3)");
    CHECK(e[6] == 0 || e[6] == 1, op, ": adapter ", s, "'s factors are float32 (0) or float16 (1), got ", e[6]);
    for (int64_t b = 0; b < e[5]; ++b) {
      const int64_t* k = e + 7 + 4 * b;
      CHECK(0 <= k[0] && k[0] <= k[1] && k[1] <= e[4] && 0 <= k[2] && k[2] <= k[3] && k[3] <= width, op,
            ": adapter ", s, "'s block ", b, " is outside its rank ", e[4], " or the ", width, " columns");
    }
    max_rank = std::max(max_rank, e[4]);
  }
  for (int64_t r = 0; r < count; ++r) {
    CHECK(0 <= idx[r] && idx[r] < out.size(0), op, ": row ", idx[r], " is outside out's ", out.size(0), " rows");
  }
  const float* hp = h.const_data_ptr<float>();
  float* outp = out.mutable_data_ptr<float>();
  // Stage 1: t = h[row] A for every row that has an adapter (count x max_rank), in tasks of up to kRowGroup
  // rows of one adapter by kRankChunk ranks.
  std::vector<float> t(static_cast<size_t>(std::max<int64_t>(1, count * max_rank)), 0.0f);
  std::vector<std::array<int64_t, 4>> first;           // (adapter, first row, rows, first rank)
  for (int64_t s = 0; s < n; ++s) {
    const int64_t* e = tab + s * kTable;
    if (e[2] == 0) continue;
    for (int64_t r = e[0]; r < e[1]; r += kRowGroup)
      for (int64_t j = 0; j < e[4]; j += kRankChunk) first.push_back({s, r, std::min(kRowGroup, e[1] - r), j});
  }
  torch::stable::parallel_for(0, static_cast<int64_t>(first.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const auto [s, r0, nr, j0] = first[k];
      const int64_t* e = tab + s * kTable;
      const float* x[kRowGroup];
      for (int64_t q = 0; q < nr; ++q) x[q] = hp + idx[r0 + q] * in;
      const int64_t nj = std::min<int64_t>(kRankChunk, e[4] - j0);
      float* dst = t.data() + r0 * max_rank;
      if (e[6])
        task_a(x, static_cast<int>(nr), reinterpret_cast<const uint16_t*>(e[2]), in, e[4], j0, nj, dst, max_rank);
      else
        task_a(x, static_cast<int>(nr), reinterpret_cast<const float*>(e[2]), in, e[4], j0, nj, dst, max_rank);
    }
  });
  // Stage 2: out[row, cols] += t[row, ranks] B[ranks, cols] over each block, in tasks of kColumns columns.
  const int64_t tasks = (width + kColumns - 1) / kColumns;
  torch::stable::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t c0 = task * kColumns, c1 = std::min(width, c0 + kColumns);
      for (int64_t s = 0; s < n; ++s) {
        const int64_t* e = tab + s * kTable;
        if (e[2] == 0) continue;
        for (int64_t b = 0; b < e[5]; ++b) {
          const int64_t* k = e + 7 + 4 * b;
          const int64_t lo = std::max(c0, k[2]), hi = std::min(c1, k[3]);
          if (lo >= hi) continue;
          for (int64_t r0 = e[0]; r0 < e[1]; r0 += kRowGroup) {
            const int nr = static_cast<int>(std::min(kRowGroup, e[1] - r0));
            float* o[kRowGroup];
            const float* tr[kRowGroup];
            for (int q = 0; q < nr; ++q) {
              o[q] = outp + idx[r0 + q] * width;
              tr[q] = t.data() + (r0 + q) * max_rank;
            }
            if (e[6])
              rows_times_b(o, tr, nr, reinterpret_cast<const uint16_t*>(e[3]), width, k[0], k[1], lo, hi);
            else
              rows_times_b(o, tr, nr, reinterpret_cast<const float*>(e[3]), width, k[0], k[1], lo, hi);
          }
        }
      }
    }
  });
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(infermesh, m) {
  m.def("lora_apply(Tensor(a!) out, Tensor h, Tensor rows, Tensor table) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(infermesh, CPU, m) {
  m.impl("lora_apply", TORCH_BOX(&lora_apply));
}
