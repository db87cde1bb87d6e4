// Tensor-core fused passes of the blocked Matryoshka InfoNCE (see matryoshka_tc.h for the math and layout).
//
// CUDA block: 128 threads (4 warps as 2 x 2, each 32 x 32 of a 64 x 64 tile: 2 x 2 wmma 16x16x16 accumulators;
// or, with tile_rows = 128, each 64 x 32 of a 128 x 64 tile: 4 x 2 accumulators; bf16 operands). Feature chunks (<= 32, never across a level boundary) go global -> registers (16-byte loads,
// the next chunk in flight during the current chunk's mma) -> shared memory (two stages, one barrier per chunk).
// At a level boundary the accumulators are stored to a float32 score tile in shared memory (they stay in
// registers and keep accumulating), and the epilogue threads read it:
//   forward, after each level: row pass (thread = row t/2, every other column) and column pass (thread =
//     column t/2, every other row), two sweeps each (max, then the sum of exps), running (max, sum) per
//     thread and level in shared memory;
//   backward, after the top level: element pass (thread = column t%64, rows t/64 + 2k: a warp writes 32
//     consecutive Ho elements of a row), the level's g G written back over G_l, then a row pass (dL/drho) and
//     a column pass (dL/dkap) over those products.
// Flops per pair: 2 m_K (one product at the top dim); bytes per pair: forward none, backward 2 K (Ho).
#include <cuda_runtime.h>
#include <mma.h>
#include <stdexcept>
#include <type_traits>
#include "common/cuda_math.cuh"
#include "common/cuda_utils.cuh"
#include "matryoshka_infonce/matryoshka_tc.h"

namespace tk {

bool mrl_tc_supported_cuda(int device) {
  int major = 0;
  TK_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  return major >= 8;
}

namespace {

using namespace nvcuda;
using cuda::ex2f;
using cuda::lse_of;
using cuda::ninf;

// bf16 wmma needs sm_80: for older archs (sm_75) the kernel compiles to a trap, and launch() refuses devices
// below compute capability 8.0 (mrl_tc_supported_cuda; the Python side routes them to the other paths).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define TK_MRL_TC_BF16_MMA 0
#else
#define TK_MRL_TC_BF16_MMA 1
#endif

constexpr int T = kMrlTcTile;  // 64 columns per tile (TR rows: 64 or 128, a template parameter)
constexpr int kThreads = 128;
// Feature chunk: 32 for 64-row tiles, 16 for 128-row tiles (whose operand stages would otherwise push a block past
// half an H100 SM's shared memory: 128 x 128 tiles, and 128 x 64 with the table bias's tiles), and the operand row
// stride in shared memory, chunk + 8 elements: 80 / 48 bytes, rows conflict-free for 16-byte accesses of 8
// consecutive rows.
template <int TR> constexpr int kKch = TR == 128 ? 16 : 32;
template <int TR> constexpr int kLda = kKch<TR> + 8;
template <int TC> constexpr int kLd = TC + 4;  // score tile row stride (floats) of TC-column tiles

// exp(x) as one SFU ex2 of x log2(e): 2 instructions instead of the compensated dexp's ~9; the rounding of
// x log2(e) costs |x| 2^-24 relative (1e-6 at |x| = 20), far below the bf16 operands' own 2^-8, and the
// forward still agrees with the float64 reference to 2e-6 (tests/test_matryoshka_tc.py).
__device__ __forceinline__ float fexp(float x) { return ex2f(x * 1.4426950408889634f); }

struct __align__(16) V16 {  // 8 operand values: one 16-byte load / store
  uint32_t w[4];
};
struct __align__(16) Stat {  // running (max, sum) of all columns and of the positives
  float m, s, mp, sp;
};

// TR: rows of the CUDA block's tile (64 or 128); RPT = 128 / TR threads per row in the row passes.
template <typename OT, int TR, int TC> struct Smem {
  static constexpr bool kOverlay = TR * kLd<TC> * 4 <= 2 * (TR + TC) * kLda<TR> * 2;  // mrl_tc_overlay
  OT* ops;        // [2 stages][TR + TC rows: the q chunk's TR, then the d chunk's TC][kLda<TR>]
  float* ss;      // [levels][TR][kLd<TC>]: forward 1, backward K (K - 1 when the top level's tile overlays ops)
  float* state;   // forward: Stat [K][128]; backward: float [K][128]
  float* rv;      // [3][K][TR]: rho, lse_all, lse_pos of the CUDA block's rows
  float* cv;      // [3][K][TC]: inv_temp kap, lse_all, lse_pos of the tile's columns
  int32_t* rspan;  // [2][TR]
  int32_t* cspan;  // [2][TC]
  uint8_t* rflag;  // [TR]: bit 0 row_none, bit 1 row_fb
  uint8_t* cflag;  // [TC]: col_none
  float* uq;       // table: [TR] u_q of the rows
  float* ud;       // table: [TC] u_d of the tile's columns
  float* dD;       // table, backward: [TR][kLd<TC>] g slope of the tile
  float* duq;      // table, backward: [128] the threads' row sums of g slope
  float* hs;       // table, backward, hist_smem: [P] the block's dL/dtable histogram

  __device__ Smem(unsigned char* base, int K, bool bwd, bool tab = false, int64_t P = 0) {
    ops = reinterpret_cast<OT*>(base);
    ss = reinterpret_cast<float*>(base + 2 * (TR + TC) * kLda<TR> * sizeof(OT));
    state = ss + (bwd ? (kOverlay ? K - 1 : K) : 1) * TR * kLd<TC>;
    rv = state + K * kThreads * (bwd ? 1 : 4);
    cv = rv + 3 * K * TR;
    rspan = reinterpret_cast<int32_t*>(cv + 3 * K * TC);
    cspan = rspan + 2 * TR;
    rflag = reinterpret_cast<uint8_t*>(cspan + 2 * TC);
    cflag = rflag + TR;
    uq = reinterpret_cast<float*>(cflag + TC);
    ud = uq + TR;
    dD = ud + TC;
    duq = dD + (tab && bwd ? TR * kLd<TC> : 0);
    hs = duq + (tab && bwd ? kThreads : 0);
    (void)P;
  }
  __device__ OT* stage(int s, int operand) { return ops + (s * (TR + TC) + operand * TR) * kLda<TR>; }
  // The backward's score tile of level l (the top one over the operand stages, idle by then, when it fits).
  __device__ float* level(int l, int K) const {
    return kOverlay && l == K - 1 ? reinterpret_cast<float*>(ops) : ss + l * TR * kLd<TC>;
  }
};

// n rows of a chunk (nv 16-byte vectors of 8 features per row) of src (row stride ld), global -> registers: vector
// tid + u * 128 in v[u]; rows at or past rows_left (the matrix's end) are zero.
template <int NV, typename OT>
__device__ __forceinline__ void load_chunk_rows(V16 (&v)[NV], const OT* src, int64_t ld, int64_t rows_left, int n,
                                                int nv) {
#pragma unroll
  for (int u = 0; u < NV; ++u) {
    const int i = threadIdx.x + u * kThreads;
    v[u] = V16{{0u, 0u, 0u, 0u}};
    if (i < n * nv && i / nv < rows_left) v[u] = *reinterpret_cast<const V16*>(src + (i / nv) * ld + (i % nv) * 8);
  }
}
template <int NV, typename OT, int TR>
__device__ __forceinline__ void store_chunk_rows(OT* dst, const V16 (&v)[NV], int n, int nv) {
#pragma unroll
  for (int u = 0; u < NV; ++u) {
    const int i = threadIdx.x + u * kThreads;
    if (i < n * nv) *reinterpret_cast<V16*>(dst + (i / nv) * kLda<TR> + (i % nv) * 8) = v[u];
  }
}

// One chunk of both operands, global -> registers: TR q rows and TC d rows x kc (16 or 32) features.
template <typename OT, int TR, int TC> struct Chunk {
  static constexpr int NA = TR * 4 / kThreads, NB = TC * 4 / kThreads;
  V16 a[NA], b[NB];
  __device__ __forceinline__ void load(const MrlTcParams& p, int64_t row0, int64_t c0, int k0, int kc) {
    load_chunk_rows(a, static_cast<const OT*>(p.q) + (p.i0 + row0) * p.ldq + k0, p.ldq, p.R - row0, TR, kc / 8);
    load_chunk_rows(b, static_cast<const OT*>(p.d) + c0 * p.ldd + k0, p.ldd, p.C - c0, TC, kc / 8);
  }
  __device__ __forceinline__ void store(Smem<OT, TR, TC>& sm, int s, int kc) const {
    store_chunk_rows<NA, OT, TR>(sm.stage(s, 0), a, TR, kc / 8);
    store_chunk_rows<NB, OT, TR>(sm.stage(s, 1), b, TC, kc / 8);
  }
};

// The 4 warps as 2 x 2, each (TR / 2) x (TC / 2) of the tile: FX x FY accumulators of 16 x 16 (2 or 4 each).
template <typename OT, int TR, int TC> struct Acc {
  static constexpr int FX = TR / 32, WR = TR / 2, FY = TC / 32, WC = TC / 2;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> f[FX][FY];
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int x = 0; x < FX; ++x)
#pragma unroll
      for (int y = 0; y < FY; ++y) wmma::fill_fragment(f[x][y], 0.0f);
  }
  __device__ __forceinline__ void mma(Smem<OT, TR, TC>& sm, int s, int kc) {
    const int w = threadIdx.x >> 5, wr = w >> 1, wc = w & 1;
    for (int kk = 0; kk < kc; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, OT, wmma::row_major> a[FX];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, OT, wmma::col_major> b[FY];
#pragma unroll
      for (int x = 0; x < FX; ++x) wmma::load_matrix_sync(a[x], sm.stage(s, 0) + (wr * WR + x * 16) * kLda<TR> + kk, kLda<TR>);
#pragma unroll
      for (int y = 0; y < FY; ++y) wmma::load_matrix_sync(b[y], sm.stage(s, 1) + (wc * WC + y * 16) * kLda<TR> + kk, kLda<TR>);
#pragma unroll
      for (int x = 0; x < FX; ++x)
#pragma unroll
        for (int y = 0; y < FY; ++y) wmma::mma_sync(f[x][y], a[x], b[y], f[x][y]);
    }
  }
  __device__ __forceinline__ void store(float* tile) const {
    const int w = threadIdx.x >> 5, wr = w >> 1, wc = w & 1;
#pragma unroll
    for (int x = 0; x < FX; ++x)
#pragma unroll
      for (int y = 0; y < FY; ++y)
        wmma::store_matrix_sync(tile + (wr * WR + x * 16) * kLd<TC> + wc * WC + y * 16, f[x][y], kLd<TC>, wmma::mem_row_major);
  }
};

// Positives of (row r, column c) of the tile: span overlap, or the diagonal fallback of rows (pr) and of
// columns (pc) without an overlap (matryoshka_block.h).
template <typename OT, int TR, int TC>
__device__ __forceinline__ void positives(const Smem<OT, TR, TC>& sm, int r, int c, int64_t dg0, bool& pr, bool& pc) {
  const bool ov = max(sm.rspan[r], sm.cspan[c]) <= min(sm.rspan[TR + r], sm.cspan[TC + c]);
  const bool dg = dg0 + c - r == 0;  // column index == row index + diag_offset
  const uint8_t rf = sm.rflag[r];
  pr = ov || ((rf & 1) && dg);
  pc = ov || (dg && ((rf & 2) || sm.cflag[c]));
}

// The table bias at delta = u_d - u_q (common/cuda_math.cuh's table_bias, the multipos kernels' arithmetic):
// value, slope = d bias / d delta (0 where the clamp bites), the left bin idx and the right bin's weight t.
__device__ __forceinline__ float tab_bias(const MrlTcParams& p, float delta, float& slope, int64_t& idx, float& t) {
  return cuda::table_bias<float>(p.table, p.P, 0.5f * (float)(p.P - 1), delta, slope, idx, t);
}
template <typename OT, int TR, int TC>
__device__ __forceinline__ float tab_value(const MrlTcParams& p, const Smem<OT, TR, TC>& sm, int r, int c) {
  float slope, t;
  int64_t idx;
  return tab_bias(p, sm.ud[c] - sm.uq[r], slope, idx, t);
}

__device__ __forceinline__ void merge(float& m, float& s, float m2, float s2) {
  if (m2 == ninf<float>() && s2 == s2) return;
  if (m == ninf<float>() && s == s) {
    m = m2;
    s = s2;
    return;
  }
  const float nm = fmaxf(m, m2);
  s = s * fexp(m - nm) + s2 * fexp(m2 - nm);
  m = nm;
}

// (max, sum of exp(z - max)) of up to 32 values, and the same of the positives among them.
struct Sweep {
  float m = ninf<float>(), s = 0.f, mp = ninf<float>(), sp = 0.f;
};

// The Sweep of the elements h, h + STEP, ... (< n <= N) of a tile row or column: at(index, z, positive) gives each
// element's logit and whether it is a positive. Two passes: the maxima, then the sums of exponentials.
template <int STEP, int N, typename At> __device__ __forceinline__ Sweep sweep(int h, int n, At&& at) {
  Sweep w;
  for (int k = 0; k < N / STEP; ++k) {
    const int e = h + STEP * k;
    if (e >= n) break;
    float z;
    bool in;
    at(e, z, in);
    w.m = fmaxf(w.m, z);
    if (in) w.mp = fmaxf(w.mp, z);
  }
  for (int k = 0; k < N / STEP; ++k) {
    const int e = h + STEP * k;
    if (e >= n) break;
    float z;
    bool in;
    at(e, z, in);
    if (w.m != ninf<float>()) w.s += fexp(z - w.m);
    if (in && w.mp != ninf<float>()) w.sp += fexp(z - w.mp);
  }
  return w;
}

template <typename OT, int TR, int TC>
__device__ void load_rows(const MrlTcParams& p, Smem<OT, TR, TC>& sm, int64_t row0, bool bwd) {
  const int tid = threadIdx.x;
  for (int idx = tid; idx < p.K * TR; idx += kThreads) {
    const int l = idx / TR, r = idx % TR;
    const bool ok = row0 + r < p.R;
    const int64_t i = p.i0 + row0 + r;
    sm.rv[l * TR + r] = ok ? p.rho[l * p.ldr + i] : 0.f;
    if (bwd) {
      sm.rv[(p.K + l) * TR + r] = ok ? p.row_lse[(int64_t)l * 3 * p.Bq + i] : 0.f;
      sm.rv[(2 * p.K + l) * TR + r] = ok ? p.row_lse[(int64_t)l * 3 * p.Bq + p.Bq + i] : 0.f;
    }
  }
  if (tid < TR) {
    const bool ok = row0 + tid < p.R;
    const int64_t i = p.i0 + row0 + tid;
    sm.rspan[tid] = ok ? p.q_lo[i] : 0;
    sm.rspan[TR + tid] = ok ? p.q_hi[i] : -1;
    const uint8_t none = ok ? p.row_none[i] != 0 : 0;
    const uint8_t fb = ok ? (p.row_fb ? p.row_fb[i] != 0 : none) : 0;
    sm.rflag[tid] = (uint8_t)(none | (fb << 1));
    if (p.table) sm.uq[tid] = ok ? p.u_q[i] : 0.f;
  }
}

template <typename OT, int TR, int TC>
__device__ void load_cols(const MrlTcParams& p, Smem<OT, TR, TC>& sm, int64_t c0, bool bwd) {
  const int tid = threadIdx.x;
  const float it = (float)p.inv_temp;
  for (int idx = tid; idx < p.K * TC; idx += kThreads) {
    const int l = idx / TC, c = idx % TC;
    const int64_t j = c0 + c;
    const bool ok = j < p.C;
    sm.cv[l * TC + c] = ok ? it * p.kap[l * p.ldk + j] : 0.f;
    if (bwd) {
      const bool st = ok && p.cols;
      sm.cv[(p.K + l) * TC + c] = st ? p.col_lse[(int64_t)l * 3 * p.C + j] : 0.f;
      sm.cv[(2 * p.K + l) * TC + c] = st ? p.col_lse[(int64_t)l * 3 * p.C + p.C + j] : 0.f;
    }
  }
  if (tid < TC) {
    const int64_t j = c0 + tid;
    const bool ok = j < p.C;
    sm.cspan[tid] = ok ? p.d_lo[j] : 0;
    sm.cspan[TC + tid] = ok ? p.d_hi[j] : -1;
    sm.cflag[tid] = ok ? (uint8_t)(p.col_none[j] != 0) : (uint8_t)0;
    if (p.table) sm.ud[tid] = ok ? p.u_d[j] : 0.f;
  }
}

// Forward epilogue of level l on the score tile: the rows' running statistics, the columns' partials.
template <typename OT, bool TAB, int TR, int TC>
__device__ void fwd_epilogue(const MrlTcParams& p, Smem<OT, TR, TC>& sm, int l, int64_t row0, int64_t c0, int64_t nrb) {
  constexpr int RPT = kThreads / TR;  // threads per row
  constexpr int CPT = kThreads / TC;  // threads per column (and rows per element-pass step)
  const int tid = threadIdx.x, h = tid % CPT, me = tid / CPT;
  const int64_t dg0 = c0 - (p.i0 + row0 + p.diag_offset);
  float* tile = sm.ss;
  const int ncol = (int)min((int64_t)TC, p.C - c0);
  if (TAB) {  // the logits z = G rho kap + bias into the tile once (the four sweeps below would look the table up
    // four times per element): column tid % TC, rows tid / TC + CPT k; the same arithmetic as the sweeps' own
    const int c = tid % TC;
    const float ks = sm.cv[l * TC + c];
    for (int k = 0; k < TR / CPT; ++k) {
      const int r = tid / TC + CPT * k;
      float* e = tile + r * kLd<TC> + c;
      *e = *e * sm.rv[l * TR + r] * ks + tab_value(p, sm, r, c);
    }
    __syncthreads();
  }
  {  // row pass: row tid / RPT, columns tid % RPT + RPT k
    const int r = tid / RPT;
    const float rs = sm.rv[l * TR + r];
    const float* ks = sm.cv + l * TC;
    const Sweep w = sweep<RPT, TC>(tid % RPT, ncol, [&](int c, float& z, bool& in) {
      bool pr, pc;
      positives(sm, r, c, dg0, pr, pc);
      z = TAB ? tile[r * kLd<TC> + c] : tile[r * kLd<TC> + c] * rs * ks[c];
      in = pr;
    });
    Stat* st = reinterpret_cast<Stat*>(sm.state) + l * kThreads + tid;
    Stat v = *st;
    merge(v.m, v.s, w.m, w.s);
    merge(v.mp, v.sp, w.mp, w.sp);
    *st = v;
  }
  if (p.cols) {  // column pass: column me, rows h, h + CPT, ...
    const int c = me;
    const float ks = sm.cv[l * TC + c];
    const float* rs = sm.rv + l * TR;
    const int nrow = (int)min((int64_t)TR, p.R - row0);
    Sweep w = sweep<CPT, TR>(h, nrow, [&](int r, float& z, bool& in) {
      bool pr, pc;
      positives(sm, r, c, dg0, pr, pc);
      z = TAB ? tile[r * kLd<TC> + c] : tile[r * kLd<TC> + c] * rs[r] * ks;
      in = pc;
    });
    if (CPT == 2) {
      merge(w.m, w.s, __shfl_xor_sync(0xffffffffu, w.m, 1), __shfl_xor_sync(0xffffffffu, w.s, 1));
      merge(w.mp, w.sp, __shfl_xor_sync(0xffffffffu, w.mp, 1), __shfl_xor_sync(0xffffffffu, w.sp, 1));
    }
    if (h == 0 && c < ncol) {
      float* out = p.col_part + (((int64_t)l * nrb + blockIdx.y) * p.C + c0 + c) * 2;
      out[0] = lse_of(w.m, w.s);
      out[1] = lse_of(w.mp, w.sp);
    }
  }
}

// Backward epilogue on the K score tiles: Ho for every level, the tiles overwritten by g G, then the dL/drho
// sums (added to the thread's state) and the dL/dkap partials of the tile's columns.
template <typename OT, bool TAB, int TR, int TC>
__device__ void bwd_epilogue(const MrlTcParams& p, Smem<OT, TR, TC>& sm, int64_t row0, int64_t c0, int64_t nrb) {
  constexpr int RPT = kThreads / TR;  // threads per row in the row sums
  const int tid = threadIdx.x, K = p.K;
  const int64_t dg0 = c0 - (p.i0 + row0 + p.diag_offset);
  const int ncol = (int)min((int64_t)TC, p.C - c0);
  const int nrow = (int)min((int64_t)TR, p.R - row0);
  OT* Ho = static_cast<OT*>(p.Ho);
  constexpr int CPT = kThreads / TC;  // threads per column (and rows per element-pass step)
  {  // element pass: column tid % TC, rows tid / TC + CPT k
    const int c = tid % TC;
    for (int k = 0; k < TR / CPT; ++k) {
      const int r = tid / TC + CPT * k;
      if (c >= ncol || r >= nrow) {
        for (int l = 0; l < K; ++l) sm.level(l, K)[r * kLd<TC> + c] = 0.f;
        if (TAB) sm.dD[r * kLd<TC> + c] = 0.f;
        continue;
      }
      bool pr, pc;
      positives(sm, r, c, dg0, pr, pc);
      float hacc = 0.f, b = 0.f, slope = 0.f, tw = 0.f, gsum = 0.f;
      int64_t bin = 0;
      if (TAB) b = tab_bias(p, sm.ud[c] - sm.uq[r], slope, bin, tw);
      for (int l = K - 1; l >= 0; --l) {
        float* gp = sm.level(l, K) + r * kLd<TC> + c;
        const float G = *gp, rs = sm.rv[l * TR + r], ks = sm.cv[l * TC + c];
        const float x = G * rs * ks + b;
        const float gr = __ldg(p.coef + 2 * l), gc = p.cols ? __ldg(p.coef + 2 * l + 1) : 0.f;
        float g = 0.f;
        if (gr != 0.f)
          g = gr * (fexp(x - sm.rv[(K + l) * TR + r]) - (pr ? fexp(x - sm.rv[(2 * K + l) * TR + r]) : 0.f));
        if (gc != 0.f)
          g += gc * (fexp(x - sm.cv[(K + l) * TC + c]) - (pc ? fexp(x - sm.cv[(2 * K + l) * TC + c]) : 0.f));
        *gp = g * G;
        hacc += g * rs * ks;
        gsum += g;
        Ho[l * p.lsh + (row0 + r) * p.C + c0 + c] = cuda::from_acc<OT>(hacc);
      }
      if (TAB) {  // dL/dbias = the levels' g: into the two bins, and g slope for dL/du
        sm.dD[r * kLd<TC> + c] = gsum * slope;
        if (p.hist_smem) {
          atomicAdd(sm.hs + bin, gsum - gsum * tw);
          atomicAdd(sm.hs + bin + 1, gsum * tw);
        } else {
          atomicAdd(p.hist + bin, (double)(gsum - gsum * tw));
          atomicAdd(p.hist + bin + 1, (double)(gsum * tw));
        }
      }
    }
  }
  __syncthreads();
  const int h = tid % CPT, me = tid / CPT;      // column passes: column me, rows h + CPT k
  const int hr = tid % RPT, mr = tid / RPT;      // row passes: row mr, columns hr + RPT k
  for (int l = 0; l < K; ++l) {  // dL/drho: row mr
    const float* row = sm.level(l, K) + mr * kLd<TC>;
    const float* ks = sm.cv + l * TC;
    float s = 0.f;
    for (int k = 0; k < TC / RPT; ++k) s += row[hr + RPT * k] * ks[hr + RPT * k];
    if (RPT == 2) s += __shfl_xor_sync(0xffffffffu, s, 1);
    sm.state[l * kThreads + tid] += s;
  }
  for (int l = 0; l < K; ++l) {  // dL/dkap: column me
    const float* col = sm.level(l, K) + me;
    const float* rs = sm.rv + l * TR;
    float s = 0.f;
    for (int k = 0; k < TR / CPT; ++k) s += col[(h + CPT * k) * kLd<TC>] * rs[h + CPT * k];
    if (CPT == 2) s += __shfl_xor_sync(0xffffffffu, s, 1);
    if (h == 0 && me < ncol) p.dkap_part[((int64_t)l * nrb + blockIdx.y) * p.C + c0 + me] = s * (float)p.inv_temp;
  }
  if (TAB) {  // dL/du_q (row sums of g slope, negated at the end) and dL/du_d (column sums)
    float s = 0.f;
    for (int k = 0; k < TC / RPT; ++k) s += sm.dD[mr * kLd<TC> + hr + RPT * k];
    if (RPT == 2) s += __shfl_xor_sync(0xffffffffu, s, 1);
    sm.duq[tid] += s;
    float t = 0.f;
    for (int k = 0; k < TR / CPT; ++k) t += sm.dD[(h + CPT * k) * kLd<TC> + me];
    if (CPT == 2) t += __shfl_xor_sync(0xffffffffu, t, 1);
    if (h == 0 && me < ncol) p.dud_part[(int64_t)blockIdx.y * p.C + c0 + me] = t;
  }
}

template <typename OT, bool BWD, bool TAB, int TR, int TC>
__global__ void __launch_bounds__(kThreads) mrl_tc_kernel(const MrlTcParams p) {
#if !TK_MRL_TC_BF16_MMA
  __trap();
#else
  constexpr int RPT = kThreads / TR;  // threads per row in the row passes
  extern __shared__ __align__(128) unsigned char mrl_tc_smem[];
  Smem<OT, TR, TC> sm(mrl_tc_smem, p.K, BWD, TAB, p.P);
  const int tid = threadIdx.x, K = p.K;
  const int64_t row0 = (int64_t)blockIdx.y * TR;
  const int64_t nrb = (p.R + TR - 1) / TR;
  const int64_t ntiles = (p.C + TC - 1) / TC;
  const int64_t t0 = (int64_t)blockIdx.x * p.tiles_per_split;
  const int64_t t1 = min(ntiles, t0 + p.tiles_per_split);
  load_rows(p, sm, row0, BWD);
  for (int l = 0; l < K; ++l) {
    if (BWD) sm.state[l * kThreads + tid] = 0.f;
    else reinterpret_cast<Stat*>(sm.state)[l * kThreads + tid] = Stat{ninf<float>(), 0.f, ninf<float>(), 0.f};
  }
  if (TAB && BWD) {
    sm.duq[tid] = 0.f;
    if (p.hist_smem)
      for (int64_t k = tid; k < p.P; k += kThreads) sm.hs[k] = 0.f;
  }
  Acc<OT, TR, TC> acc;
  Chunk<OT, TR, TC> ch;
  for (int64_t tile = t0; tile < t1; ++tile) {
    const int64_t c0 = tile * TC;
    load_cols(p, sm, c0, BWD);
    acc.zero();
    int k0 = 0, l = 0, kc = min(kKch<TR>, p.seg[1]), s = 0;
    ch.load(p, row0, c0, k0, kc);
    ch.store(sm, 0, kc);
    __syncthreads();
    while (true) {
      const int kn = k0 + kc;
      const bool lend = kn == p.seg[l + 1];
      const int ln = lend ? l + 1 : l;
      const bool more = ln < K;
      const int kcn = more ? min(kKch<TR>, p.seg[ln + 1] - kn) : 0;
      if (more) ch.load(p, row0, c0, kn, kcn);
      acc.mma(sm, s, kc);
      if (lend) {
        if (BWD && Smem<OT, TR, TC>::kOverlay && l == K - 1)
          __syncthreads();  // every warp is done with the operand stages the tile overlays
        acc.store(BWD ? sm.level(l, K) : sm.ss);
        __syncthreads();
        if (!BWD) fwd_epilogue<OT, TAB, TR, TC>(p, sm, l, row0, c0, nrb);
        else if (l == K - 1) bwd_epilogue<OT, TAB, TR, TC>(p, sm, row0, c0, nrb);
      }
      if (more) ch.store(sm, s ^ 1, kcn);
      __syncthreads();
      if (!more) break;
      k0 = kn;
      kc = kcn;
      l = ln;
      s ^= 1;
    }
  }
  // the per-row results (of the thread pair when RPT = 2)
  const int h = tid % RPT, r = tid / RPT;
  const bool ok = row0 + r < p.R;
  for (int l = 0; l < K; ++l) {
    if (BWD) {
      if (h == 0 && ok) p.drho_part[((int64_t)l * p.R + row0 + r) * p.nsplit + blockIdx.x] = sm.state[l * kThreads + tid];
    } else {
      Stat v = reinterpret_cast<const Stat*>(sm.state)[l * kThreads + tid];
      if (RPT == 2) {
        merge(v.m, v.s, __shfl_xor_sync(0xffffffffu, v.m, 1), __shfl_xor_sync(0xffffffffu, v.s, 1));
        merge(v.mp, v.sp, __shfl_xor_sync(0xffffffffu, v.mp, 1), __shfl_xor_sync(0xffffffffu, v.sp, 1));
      }
      if (h == 0 && ok) {
        float* out = p.row_part + (((int64_t)l * p.R + row0 + r) * p.nsplit + blockIdx.x) * 2;
        out[0] = lse_of(v.m, v.s);
        out[1] = lse_of(v.mp, v.sp);
      }
    }
  }
  if (TAB && BWD) {  // (after the last tile's barrier) dL/du_q partial and the block's histogram slot
    if (h == 0 && ok) p.duq_part[(row0 + r) * p.nsplit + blockIdx.x] = -sm.duq[tid];
    if (p.hist_smem) {
      double* slot = p.hist + ((int64_t)blockIdx.y * p.nsplit + blockIdx.x) * p.P;
      for (int64_t k = tid; k < p.P; k += kThreads) slot[k] = (double)sm.hs[k];
    }
  }
#endif  // TK_MRL_TC_BF16_MMA
}

void check(const MrlTcParams& p, bool bwd) {
  if (p.R < 0 || p.C < 0 || p.K < 1 || p.K > kMrlTcMaxLevels) throw std::runtime_error("mrl_tc: bad sizes or levels");
  // bf16 only: float16 coefficients Ho would fall into float16's subnormals at large B (the driver's rule)
  if (p.dtype != DType::BF16) throw std::runtime_error("mrl_tc: operands must be bf16");
  if (p.seg[0] != 0) throw std::runtime_error("mrl_tc: seg[0] must be 0");
  for (int l = 0; l < p.K; ++l)
    if (p.seg[l + 1] <= p.seg[l] || p.seg[l + 1] % 16 != 0)
      throw std::runtime_error("mrl_tc: level boundaries must increase in multiples of 16");
  if (p.ldq % 8 || p.ldd % 8 || p.ldq < p.seg[p.K] || p.ldd < p.seg[p.K])
    throw std::runtime_error("mrl_tc: row strides must be multiples of 8 and cover the top level");
  if (reinterpret_cast<uintptr_t>(p.q) % 16 || reinterpret_cast<uintptr_t>(p.d) % 16)
    throw std::runtime_error("mrl_tc: q and d must be 16-byte aligned");
  if (p.tile_cols != 64 && p.tile_cols != 128) throw std::runtime_error("mrl_tc: tile_cols must be 64 or 128");
  if (p.tile_cols == 128 && p.tile_rows != 128) throw std::runtime_error("mrl_tc: 128 tile_cols need 128 tile_rows");
  const int64_t ntiles = (p.C + p.tile_cols - 1) / p.tile_cols;
  if (p.nsplit < 1 || p.tiles_per_split < 1 || p.nsplit * p.tiles_per_split < ntiles ||
      (p.nsplit - 1) * p.tiles_per_split >= ntiles)
    throw std::runtime_error("mrl_tc: inconsistent column splits");
  if (p.tile_rows != 64 && p.tile_rows != 128) throw std::runtime_error("mrl_tc: tile_rows must be 64 or 128");
  if ((p.R + p.tile_rows - 1) / p.tile_rows > 65535)
    throw std::runtime_error("mrl_tc: too many row blocks for one launch");
  if (!p.q || !p.d || !p.rho || !p.kap || !p.q_lo || !p.q_hi || !p.d_lo || !p.d_hi || !p.row_none || !p.col_none)
    throw std::runtime_error("mrl_tc: missing inputs");
  if (!bwd && (!p.row_part || (p.cols && !p.col_part))) throw std::runtime_error("mrl_tc: missing forward outputs");
  if (bwd && (!p.row_lse || (p.cols && !p.col_lse) || !p.coef || !p.Ho || !p.drho_part || !p.dkap_part))
    throw std::runtime_error("mrl_tc: missing backward inputs or outputs");
  if (p.table && (p.P < 2 || p.P > (1 << 30) || !p.u_q || !p.u_d))
    throw std::runtime_error("mrl_tc: a table bias needs 2 or more points and u_q, u_d");
  if (p.table && bwd && (!p.hist || !p.duq_part || !p.dud_part))
    throw std::runtime_error("mrl_tc: a table bias's backward needs hist, duq_part and dud_part");
}

template <bool BWD> void launch(const MrlTcParams& p, int device, uintptr_t stream) {
  check(p, BWD);
  if (p.R == 0 || p.C == 0) return;
  cuda::set_device(device);
  if (!mrl_tc_supported_cuda(device))
    throw std::runtime_error("mrl_tc: the bf16 tensor-core kernels need a GPU of compute capability 8.0 or newer");
  const size_t smem =
      mrl_tc_smem_bytes(p.K, BWD, p.table != nullptr, p.table && p.hist_smem ? p.P : 0, p.tile_rows, p.tile_cols);
  int optin = 0;
  TK_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  if (smem > (size_t)optin)
    throw std::runtime_error("mrl_tc: too many levels (or table points in shared memory) for this GPU");
  const dim3 grid((unsigned)p.nsplit, (unsigned)((p.R + p.tile_rows - 1) / p.tile_rows));
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  auto run = [&](auto tr, auto tc) {
    auto go = [&](auto tab) {
      auto kern = mrl_tc_kernel<__nv_bfloat16, BWD, decltype(tab)::value, decltype(tr)::value, decltype(tc)::value>;
      TK_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
      kern<<<grid, kThreads, smem, st>>>(p);
    };
    if (p.table) go(std::true_type{}); else go(std::false_type{});
  };
  using N64 = std::integral_constant<int, 64>;
  using N128 = std::integral_constant<int, 128>;
  if (p.tile_cols == 128) run(N128{}, N128{});
  else if (p.tile_rows == 128) run(N128{}, N64{});
  else run(N64{}, N64{});
  cuda::check_launch();
}

}  // namespace

void mrl_tc_fwd_cuda(const MrlTcParams& p, int device, uintptr_t stream) { launch<false>(p, device, stream); }
void mrl_tc_bwd_cuda(const MrlTcParams& p, int device, uintptr_t stream) { launch<true>(p, device, stream); }

int mrl_tc_smem_optin_cuda(int device) {
  int optin = 0;
  TK_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return optin;
}

int mrl_tc_max_levels_cuda(int device) {
  const int optin = mrl_tc_smem_optin_cuda(device);
  int K = 0;
  while (K < kMrlTcMaxLevels && mrl_tc_smem_bytes(K + 1, true) <= (size_t)optin) ++K;
  return K;
}

}  // namespace tk
