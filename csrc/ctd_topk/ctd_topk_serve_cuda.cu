// CUDA entry point of the fused CTD top-k's serve pass (Q <= 16: serve_prep, serve_scan, merge_lists); the
// kernels: ctd_topk_kernels.cuh.
#include "ctd_topk/ctd_topk_kernels.cuh"

namespace tk {
namespace {
constexpr int64_t SERVE_SMEM_MAX = 96 * 1024;  // dynamic shared memory of serve_scan, at most (sm_86: 99 KB)

template <typename S, typename A, int QM, int M>
void launch_serve_scan(const CtdCudaParams& p, cudaStream_t st) {
  constexpr int VW = vec_width<S>();
  const int64_t Hs = (p.H + VW - 1) / VW * VW;
  const size_t smem = (size_t)QM * Hs * sizeof(S) + (size_t)SRV_WARPS * 32 * (QM + 1) * sizeof(A);
  if ((int64_t)smem > SERVE_SMEM_MAX) fail("ctd_topk (CUDA): Q * H too large for the serve pass");
  auto kern = serve_scan<S, A, QM, M>;
  if (smem > 48 * 1024) TK_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  const int64_t blocks = (p.nslices + SRV_WARPS - 1) / SRV_WARPS;
  serve_scan<S, A, QM, M><<<(unsigned)blocks, SRV_WARPS * 32, smem, st>>>(p);
}

template <typename A>
void launch_merge(const MergeArgs& a, int64_t ctas, int64_t Q, cudaStream_t st) {
  const size_t smem = (size_t)a.M * (sizeof(A) + sizeof(int64_t));
  merge_lists<A><<<dim3((unsigned)ctas, (unsigned)Q), MRG_THREADS, smem, st>>>(a);
}
}  // namespace

void ctd_topk_cuda_serve(const CtdCudaParams& p0, int device, uintptr_t stream) {
  cuda::set_device(device);
  CtdCudaParams p = p0;
  p.amat = p.amat_out;
  if (p.Q < 1 || p.Q > 16 || !p.q || !p.g || p.H < 1) fail("ctd_topk (CUDA): the serve pass takes 1 to 16 queries");
  if (p.N < 1 || p.k < 1 || p.nslices < 1 || p.per_slice < 1 || p.cap < p.k + 32 || p.cap > (1 << 20) ||
      (p.cap & (p.cap - 1)) != 0 || !p.ws_values || !p.ws_indices || !p.out_values || !p.out_indices)
    fail("ctd_topk (CUDA): bad workspace geometry");
  if (p.nslices * p.per_slice < p.N || (p.nslices - 1) * p.per_slice >= p.N)
    fail("ctd_topk (CUDA): slices must cover the rows, none empty");
  if (p.lists_per_cta < 1 || p.groups != (p.nslices + p.lists_per_cta - 1) / p.lists_per_cta ||
      (p.groups > 1 && (!p.mid_values || !p.mid_indices)))
    fail("ctd_topk (CUDA): bad merge geometry");
  if (p.bias == CtdBias::Exact && (p.K < 1 || 2 * p.K > MAX_K2 || p.hidden < 1 || p.D < 1 || !p.w1 || !p.b1 ||
                                   !p.w2 || !p.freqs || !p.aux || !p.amat_out || !p.u_q || !p.u_g))
    fail("ctd_topk (CUDA): bad exact-bias arguments (2K <= 64)");
  if (p.bias == CtdBias::Table && (p.P < 2 || !p.table || !p.u_q || !p.u_g)) fail("ctd_topk (CUDA): bad bias table");
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  cuda::dispatch_device_float(p.dtype, [&](auto t) {
    using S = decltype(t);
    using A = typename AccOf<S>::type;
    if (p.bias == CtdBias::Exact) {
      const int64_t work = std::max<int64_t>(std::max<int64_t>(BOUND_S, p.hidden), p.Q * p.hidden * p.K);
      const int64_t blocks = std::min<int64_t>((work + PREP_THREADS - 1) / PREP_THREADS, 1024);
      serve_prep<A><<<(unsigned)blocks, PREP_THREADS, 0, st>>>(p);
      cuda::check_launch();
    }
    with_mode(p.bias, [&](auto mode) {
      constexpr int M = decltype(mode)::value;
      if (p.Q == 1) launch_serve_scan<S, A, 1, M>(p, st);
      else if (p.Q <= 4) launch_serve_scan<S, A, 4, M>(p, st);
      else launch_serve_scan<S, A, 16, M>(p, st);
    });
    cuda::check_launch();
    MergeArgs a;
    a.in_v = p.ws_values;
    a.in_i = p.ws_indices;
    a.nl = p.nslices;
    a.stride = p.cap;
    a.k = p.k;
    a.lpc = p.lists_per_cta;
    int64_t M = 1;
    while (M < p.k + MRG_THREADS) M <<= 1;
    a.M = M;
    if (p.groups > 1) {
      a.out_v = p.mid_values;
      a.out_i = p.mid_indices;
      launch_merge<A>(a, p.groups, p.Q, st);
      cuda::check_launch();
      a.in_v = p.mid_values;
      a.in_i = p.mid_indices;
      a.nl = p.groups;
      a.stride = p.k;
      a.lpc = p.groups;
    }
    a.out_v = p.out_values;
    a.out_i = p.out_indices;
    a.final_ = true;
    launch_merge<A>(a, 1, p.Q, st);
    cuda::check_launch();
  });
}

}  // namespace tk
