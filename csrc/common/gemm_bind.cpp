// Direct entry to the CPU micro-kernels of common/cpu_gemm.h, for tests/test_cpu_gemm.py (the fused ops
// call the kernels from C++; this binding only lets a test check them against torch on awkward shapes).
#include <cstdint>
#include "common/bind_utils.h"
#include "common/cpu_gemm.h"
#include "common/registry.h"

namespace tk {
namespace {
template <typename T>
void run_acc_nn(int64_t M, int64_t N, int64_t K, uintptr_t A, int64_t sam, int64_t sak, uintptr_t B, int64_t ldb,
                uintptr_t C, int64_t ldc, double alpha) {
  gemm::acc_nn(M, N, K, as_ptr<const T>(A), sam, sak, as_ptr<const T>(B), ldb, as_ptr<T>(C), ldc, (T)alpha);
}
template <typename T>
void run_dot_nt(int64_t M, int64_t N, int64_t K, uintptr_t A, int64_t lda, uintptr_t B, int64_t ldb, uintptr_t C,
                int64_t ldc, double alpha, double beta) {
  gemm::dot_nt(M, N, K, as_ptr<const T>(A), lda, as_ptr<const T>(B), ldb, as_ptr<T>(C), ldc, (T)alpha, (T)beta);
}
}  // namespace

TK_BIND(cpu_gemm) {
  m.def("cpu_gemm_simd", []() { return std::string(gemm::simd_name()); },
        "vector ISA the CPU micro-kernels were compiled for: avx512 | avx2 | scalar");
  // C[i*ldc + j] += alpha * sum_k A[i*sam + k*sak] * B[k*ldb + j]; is_double picks float64 over float32.
  m.def("cpu_gemm_acc_nn", [](bool is_double, int64_t M, int64_t N, int64_t K, uintptr_t A, int64_t sam, int64_t sak,
                              uintptr_t B, int64_t ldb, uintptr_t C, int64_t ldc, double alpha) {
    pybind11::gil_scoped_release nogil;
    if (is_double) run_acc_nn<double>(M, N, K, A, sam, sak, B, ldb, C, ldc, alpha);
    else run_acc_nn<float>(M, N, K, A, sam, sak, B, ldb, C, ldc, alpha);
  });
  // C[i*ldc + j] = alpha * sum_k A[i*lda + k] * B[j*ldb + k] + beta * C[i*ldc + j]
  m.def("cpu_gemm_dot_nt", [](bool is_double, int64_t M, int64_t N, int64_t K, uintptr_t A, int64_t lda, uintptr_t B,
                              int64_t ldb, uintptr_t C, int64_t ldc, double alpha, double beta) {
    pybind11::gil_scoped_release nogil;
    if (is_double) run_dot_nt<double>(M, N, K, A, lda, B, ldb, C, ldc, alpha, beta);
    else run_dot_nt<float>(M, N, K, A, lda, B, ldb, C, ldc, alpha, beta);
  });
}
}  // namespace tk
