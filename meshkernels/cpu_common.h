// Shared by the CPU op sources (cpu_ops.cpp, cpu_gemm.cpp): argument checks that raise a precise
// RuntimeError, and the parallel grain.  Each source includes it inside its own anonymous namespace.
#pragma once

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

// Below this many float elements of work an op runs on the calling thread: a parallel region costs
// a few microseconds, more than a 16-row decode step's norm or RoPE takes.
constexpr int64_t kParallelElements = 65536;

int64_t grain_rows(int64_t row_elements) {
  return std::max<int64_t>(1, kParallelElements / std::max<int64_t>(1, row_elements));
}

// ------------------------------------------------------------------------------ IEEE half floats

// One binary16 value (its bits) as float: exact.
inline float half_bits_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {                                    // subnormal half: normalize
    exp = 113;
    while (!(man & 0x400)) { man <<= 1; --exp; }
    bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// float -> binary16 bits, rounded to nearest even (as torch's .half() rounds); overflow gives inf.
inline uint16_t float_to_half_bits(float f) {
#if defined(__F16C__)
  return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000);
  const uint32_t abs = x & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return sign | 0x7E00;                 // NaN
  if (abs >= 0x477FF000u) return sign | 0x7C00;               // rounds to 65520 or more: inf
  if (abs < 0x38800000u) {                                     // below 2^-14: a subnormal half (or 0)
    float v;
    std::memcpy(&v, &abs, 4);
    return sign | static_cast<uint16_t>(std::nearbyint(v * 16777216.0f));   // units of 2^-24
  }
  const uint32_t rounded = abs + 0xFFFu + ((abs >> 13) & 1u);  // nearest even on the 13 dropped bits
  return sign | static_cast<uint16_t>((rounded - 0x38000000u) >> 13);
#endif
}

// ---------------------------------------------------------------------------------------- checks

// Raised as RuntimeError in Python, with just this message.
template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  std::ostringstream message;
  message << "infermesh::";
  (message << ... << args);
  throw std::runtime_error(message.str());
}

#define CHECK(cond, ...)         \
  do {                           \
    if (!(cond)) fail(__VA_ARGS__); \
  } while (false)

std::string str(torch::headeronly::IntHeaderOnlyArrayRef dims) {
  std::ostringstream out;
  out << "(";
  for (size_t i = 0; i < dims.size(); ++i) out << (i ? ", " : "") << dims[i];
  out << (dims.size() == 1 ? ",)" : ")");
  return out.str();
}

void check_tensor(const Tensor& t, ScalarType dtype, const char* dtype_name, const char* op, const char* name,
                  int64_t dim) {
  CHECK(t.is_cpu(), op, ": ", name, " must be a CPU tensor");
  CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype_name, ", got ", t.scalar_type());
  CHECK(t.dim() == dim, op, ": ", name, " must have ", dim, " dims, got shape ", str(t.sizes()));
}

void check_contiguous(const Tensor& t, const char* op, const char* name) {
  CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous, got strides ", str(t.strides()));
}

void check_float(const Tensor& t, const char* op, const char* name, int64_t dim) {
  check_tensor(t, ScalarType::Float, "float32", op, name, dim);
}

// The KV cache's element type: float32, or float16 (binary16 bits, read and written as uint16_t).
bool check_kv_cache(const Tensor& t, const char* op, const char* name) {
  CHECK(t.is_cpu(), op, ": ", name, " must be a CPU tensor");
  CHECK(t.scalar_type() == ScalarType::Float || t.scalar_type() == ScalarType::Half, op, ": ", name,
        " must be float32 or float16, got ", t.scalar_type());
  CHECK(t.dim() == 4, op, ": ", name, " must have 4 dims, got shape ", str(t.sizes()));
  check_contiguous(t, op, name);
  return t.scalar_type() == ScalarType::Half;
}

void check_index(const Tensor& t, const char* op, const char* name, int64_t dim) {
  check_tensor(t, ScalarType::Long, "int64", op, name, dim);
  check_contiguous(t, op, name);
}

// ------------------------------------------------------------------------------------ vector math

#ifdef __AVX2__
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// exp(x), Cephes' expf range reduction and polynomial (within 2 ulp); 0 below exp's normal range,
// +inf above it.
inline __m256 exp8(__m256 x) {
  const __m256 max_x = _mm256_set1_ps(88.3762626647949f);
  const __m256 min_x = _mm256_set1_ps(-87.3365447505531f);   // log(FLT_MIN): 2^n stays a normal number
  const __m256 underflow = _mm256_cmp_ps(x, min_x, _CMP_LT_OQ);
  const __m256 overflow = _mm256_cmp_ps(x, max_x, _CMP_GT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, min_x), max_x);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n));
  y = _mm256_andnot_ps(underflow, y);
  return _mm256_blendv_ps(y, _mm256_set1_ps(std::numeric_limits<float>::infinity()), overflow);
}
#endif
