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
