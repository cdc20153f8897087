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

void check_index(const Tensor& t, const char* op, const char* name, int64_t dim) {
  check_tensor(t, ScalarType::Long, "int64", op, name, dim);
  check_contiguous(t, op, name);
}
