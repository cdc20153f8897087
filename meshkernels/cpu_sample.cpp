// Sampling's passes over the vocabulary, for services/engine/runtime/sampler.py; built and loaded by meshkernels/cpu_ops.py.
//
// A sampled row of a 151,936-token vocabulary is 600 KB of logits: torch's topk, logsumexp, division and
// softmax each read it again (and topk sorts its candidates), ~2-3 ms a row on 2 cores.  These ops read a
// row two or three times in vectors and keep only what sampling needs.
//
// - sample_candidates(logits (R, V), temps (R,), values (R, K)!, ids (R, K)!, lse (R,)!, counts (R,)!):
//   per row, logsumexp(logits / T) over the whole vocabulary, and the `counts` most likely tokens, most
//   likely first (values = logit / T; the rest of the K slots are -inf and id -1).  The candidates are
//   exactly the top `counts`: every token left out is less likely than every one kept.  Their torch
//   reference: topk + logsumexp (services/engine/runtime/sampler.py: candidates_reference).
// - sample_whole(logits (R, V), temps (R,), draws (R,), out (R,)!): per row, the token at the inverse CDF
//   of softmax(logits / T) in token-id order at draws[r] x total (temperature alone, no filter).

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

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Candidates are gathered above max - kWindow x T (in logits): a token below is e^-kWindow as likely as the
// most likely one (2e-9), so a nucleus reaches it only on a nearly flat row, where the caller goes on to
// the sort anyway.  A window cut short by K keeps the exact top K instead.
constexpr float kWindow = 20.0f;

float row_max(const float* x, int64_t n) {
  int64_t i = 0;
  float m = kNegInf;
#ifdef __AVX2__
  __m256 acc = _mm256_set1_ps(kNegInf);
  for (; i + 8 <= n; i += 8) acc = _mm256_max_ps(acc, _mm256_loadu_ps(x + i));
  float lanes[8];
  _mm256_storeu_ps(lanes, acc);
  for (float v : lanes) m = std::max(m, v);
#endif
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

// sum over i of exp((x[i] - m) * inv_t)
double row_exp_sum(const float* x, int64_t n, float m, float inv_t) {
  int64_t i = 0;
  double s = 0.0;
#ifdef __AVX2__
  const __m256 mv = _mm256_set1_ps(m), tv = _mm256_set1_ps(inv_t);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    acc = _mm256_add_ps(acc, exp8(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv), tv)));
    if ((i & 4095) == 4088) {              // keep float partial sums short: fold into the double every 4k
      s += hsum(acc);
      acc = _mm256_setzero_ps();
    }
  }
  s += hsum(acc);
#endif
  for (; i < n; ++i) s += std::exp((x[i] - m) * inv_t);
  return s;
}

void check_temperatures(const float* t, int64_t rows, const char* op) {
  for (int64_t r = 0; r < rows; ++r) CHECK(t[r] > 0.0f, op, ": temperature must be positive, got ", t[r]);
}

void sample_candidates(const Tensor& logits, const Tensor& temps, const Tensor& values, const Tensor& ids,
                       const Tensor& lse, const Tensor& counts) {
  const char* op = "sample_candidates";
  check_float(logits, op, "logits", 2);
  check_contiguous(logits, op, "logits");
  check_float(temps, op, "temps", 1);
  check_float(values, op, "values", 2);
  check_contiguous(values, op, "values");
  check_index(ids, op, "ids", 2);
  check_float(lse, op, "lse", 1);
  check_index(counts, op, "counts", 1);
  const int64_t rows = logits.size(0), vocab = logits.size(1), k = values.size(1);
  CHECK(temps.size(0) == rows && values.size(0) == rows && ids.size(0) == rows && ids.size(1) == k &&
            lse.size(0) == rows && counts.size(0) == rows,
        op, ": every output needs one row per logits row");
  CHECK(k >= 1 && k <= vocab, op, ": K must be within 1 and the vocabulary, got ", k);
  const float* x = logits.const_data_ptr<float>();
  const float* t = temps.const_data_ptr<float>();
  float* vout = values.mutable_data_ptr<float>();
  int64_t* iout = ids.mutable_data_ptr<int64_t>();
  float* lout = lse.mutable_data_ptr<float>();
  int64_t* cout = counts.mutable_data_ptr<int64_t>();
  check_temperatures(t, rows, op);
  torch::stable::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<std::pair<float, int64_t>> found;
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * vocab;
      const float inv_t = 1.0f / t[r];
      const float m = row_max(row, vocab);
      lout[r] = static_cast<float>(m * inv_t + std::log(row_exp_sum(row, vocab, m, inv_t)));
      // Most likely first; ties by token id, as a stable order (torch's topk does not promise one).
      auto before = [](const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
        return a.first > b.first || (a.first == b.first && a.second < b.second);
      };
      // Everything at or above `floor`, which rises to the k-th largest seen whenever 2k are held: the
      // buffer stays small on a flat row, and what it drops is below k kept ones.
      float floor = m - kWindow * t[r];
      found.clear();
      for (int64_t i = 0; i < vocab; ++i) {
        if (row[i] < floor) continue;
        found.emplace_back(row[i], i);
        if (static_cast<int64_t>(found.size()) >= 2 * k) {
          std::nth_element(found.begin(), found.begin() + (k - 1), found.end(), before);
          found.resize(k);
          floor = found[k - 1].first;
        }
      }
      const int64_t n = std::min<int64_t>(static_cast<int64_t>(found.size()), k);
      std::partial_sort(found.begin(), found.begin() + n, found.end(), before);
      for (int64_t j = 0; j < k; ++j) {
        vout[r * k + j] = j < n ? found[j].first * inv_t : kNegInf;
        iout[r * k + j] = j < n ? found[j].second : -1;
      }
      cout[r] = n;
    }
  });
}

// The first i whose running sum of exp((x - m) * inv_t) passes `target`, or -1 (rounding: the sum fell short).
// Blocks of 8 are summed in vectors and only the block that passes is walked one by one.
int64_t inverse_cdf(const float* x, int64_t n, float m, float inv_t, double target, int64_t* last) {
  double s = 0.0;
  int64_t i = 0;
#ifdef __AVX2__
  const __m256 mv = _mm256_set1_ps(m), tv = _mm256_set1_ps(inv_t);
  for (; i + 8 <= n; i += 8) {
    const float block = hsum(exp8(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv), tv)));
    if (s + block > target) break;
    if (block > 0.0f) *last = i + 7;
    s += block;
  }
#endif
  for (; i < n; ++i) {
    const double e = std::exp(static_cast<double>((x[i] - m) * inv_t));
    if (e <= 0.0) continue;
    *last = i;
    s += e;
    if (s > target) return i;
  }
  return -1;
}

void sample_whole(const Tensor& logits, const Tensor& temps, const Tensor& draws, const Tensor& out) {
  const char* op = "sample_whole";
  check_float(logits, op, "logits", 2);
  check_contiguous(logits, op, "logits");
  check_float(temps, op, "temps", 1);
  check_float(draws, op, "draws", 1);
  check_index(out, op, "out", 1);
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  CHECK(temps.size(0) == rows && draws.size(0) == rows && out.size(0) == rows, op,
        ": temps, draws and out need one entry per logits row");
  const float* x = logits.const_data_ptr<float>();
  const float* t = temps.const_data_ptr<float>();
  const float* u = draws.const_data_ptr<float>();
  int64_t* o = out.mutable_data_ptr<int64_t>();
  check_temperatures(t, rows, op);
  torch::stable::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * vocab;
      const float inv_t = 1.0f / t[r];
      const float m = row_max(row, vocab);
      const double target = static_cast<double>(u[r]) * row_exp_sum(row, vocab, m, inv_t);
      int64_t last = 0;
      const int64_t chosen = inverse_cdf(row, vocab, m, inv_t, target, &last);
      o[r] = chosen >= 0 ? chosen : last;      // a draw rounded up to the total: the last possible token
    }
  });
}

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(infermesh, m) {
  m.def("sample_candidates(Tensor logits, Tensor temps, Tensor(a!) values, Tensor(b!) ids, Tensor(c!) lse, "
        "Tensor(d!) counts) -> ()");
  m.def("sample_whole(Tensor logits, Tensor temps, Tensor draws, Tensor(a!) out) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(infermesh, CPU, m) {
  m.impl("sample_candidates", TORCH_BOX(&sample_candidates));
  m.impl("sample_whole", TORCH_BOX(&sample_whole));
}
