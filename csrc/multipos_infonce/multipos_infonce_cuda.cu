// CUDA kernels for the fused multi-positive InfoNCE. Never run on a GPU yet: written without one, compiled,
// and tested on the CPU emulator (tools/cuda_emu).
//
// One kernel template, five launches. A CTA owns BM anchors and walks all candidates in BN-wide tiles:
//   FWD_ROW  anchors = queries,   candidates = documents (+ extra negatives)  -> row stats
//   FWD_COL  anchors = documents, candidates = queries                        -> column stats
//   BWD_ROW  recompute tiles, dL/ds in shared memory, dq += G d (+ negatives), dA, bias scalars
//   BWD_COL  recompute transposed tiles, dd += G^T q, dCt
//   BWD_NEG  anchors = extra negatives, candidates = queries: dneg += G^T q
// Ownership makes every gradient row private to one CTA (no atomics except the bias scalars), at the
// price of computing each score tile twice per pass. Score tiles use tensor cores (wmma m16n16k16,
// float32 accumulation) for fp16/bf16, TF32 wmma for float32 when allowed, else CUDA-core FMA. The bias runs on CUDA cores:
// one warp per anchor, one lane per hidden unit, first layer in angle-difference form (A_i . Ct[:, j]).
// Nothing of size Bq x Bd is allocated.
#include <cuda_runtime.h>
#include <mma.h>
#include <cstdint>
#include <string>
#include <type_traits>
#include "common/cuda_utils.cuh"
#include "multipos_infonce/multipos_infonce.h"

namespace tk {
namespace {

constexpr int BM = 64, BN = 64, BK = 32, NT = 256, SLD = BN + 4, KPAD = 8;
constexpr int kMaxK2 = 64;  // wrapper enforces K2 <= 64 on CUDA

enum Mode { FWD_ROW = 0, FWD_COL = 1, BWD_ROW = 2, BWD_COL = 3, BWD_NEG = 4 };

template <typename S> struct IsHalf { static constexpr bool value = false; };
template <> struct IsHalf<__half> { static constexpr bool value = true; };
template <> struct IsHalf<__nv_bfloat16> { static constexpr bool value = true; };

template <typename A> __device__ __forceinline__ A dexp(A x) { return exp(x); }
// 0 below -87 (incl. -inf) like the CPU's fast_exp; NaN must propagate (fmaxf would turn it into 0 and a
// diverged batch would give a finite loss that AMP's GradScaler cannot see).
template <> __device__ __forceinline__ float dexp<float>(float x) { return x > -87.0f ? __expf(x) : (x != x ? x : 0.0f); }
template <typename A> __device__ __forceinline__ A dlog(A x) { return log(x); }
template <> __device__ __forceinline__ float dlog<float>(float x) { return logf(x); }
template <typename A> __device__ __forceinline__ A ninf() { return -INFINITY; }

template <typename A> __device__ __forceinline__ void lse_merge(A& m, A& s, A m2, A s2) {
  if (s2 == A(0)) return;
  if (m2 > m) { s = s * dexp(m - m2) + s2; m = m2; }
  else s += s2 * dexp(m2 - m);
}

template <typename S, typename A>
struct Smem {
  // xs/ys live only inside score_tile; ctp is loaded after it and read until the tile's closing
  // __syncthreads, so they share storage: float64 is 77 KB instead of 109 KB, within the 99 KB a block
  // may opt into on sm_86/sm_89 (a default build arch).
  union {
    struct {
      S xs[BM][BK + KPAD];
      S ys[BN][BK + KPAD];
    };
    A ctp[kMaxK2][BN];    // bias column features of the candidate (ROW) or anchor (COL) tile
  };
  A ss[BM][SLD];          // scores, then dL/ds
  A st[6][BM];            // running stats per anchor: m, s, pm, ps, cnt, diag
};
static_assert(sizeof(Smem<double, double>) <= 99 * 1024, "float64 tiles must fit sm_86/sm_89's 99 KB opt-in limit");
static_assert(sizeof(Smem<float, float>) <= 48 * 1024 && sizeof(Smem<__half, float>) <= 48 * 1024,
              "float32/half tiles stay within the default 48 KB");

// S tile = inv_temp * X[a0:a0+na] . Y[c0:c0+nc]^T into sm.ss (rows >= na / cols >= nc are zero).
template <typename S, typename A>
__device__ void score_tile(Smem<S, A>& sm, const S* X, int64_t ldx, int64_t a0, int na, const S* Y, int64_t ldy,
                           int64_t c0, int nc, int64_t H, A it, bool tf32) {
  const int tid = threadIdx.x;
  if constexpr (IsHalf<S>::value) {
    using namespace nvcuda;
    const int warp = tid >> 5, wr = (warp >> 1) * 16, wc = (warp & 1) * 32;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2];
    wmma::fill_fragment(acc[0], 0.f);
    wmma::fill_fragment(acc[1], 0.f);
    for (int64_t k0 = 0; k0 < H; k0 += BK) {
      for (int e = tid; e < BM * BK; e += NT) {
        const int r = e / BK, k = e % BK;
        const bool okx = r < na && k0 + k < H, oky = r < nc && k0 + k < H;
        sm.xs[r][k] = okx ? X[(a0 + r) * ldx + k0 + k] : S(0.f);
        sm.ys[r][k] = oky ? Y[(c0 + r) * ldy + k0 + k] : S(0.f);
      }
      __syncthreads();
      for (int kk = 0; kk < BK; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, S, wmma::row_major> fa;
        wmma::load_matrix_sync(fa, &sm.xs[wr][kk], BK + KPAD);
        for (int t = 0; t < 2; ++t) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, S, wmma::col_major> fb;
          wmma::load_matrix_sync(fb, &sm.ys[wc + 16 * t][kk], BK + KPAD);
          wmma::mma_sync(acc[t], fa, fb, acc[t]);
        }
      }
      __syncthreads();
    }
    for (int t = 0; t < 2; ++t) {
      for (int e = 0; e < acc[t].num_elements; ++e) acc[t].x[e] *= (float)it;
      wmma::store_matrix_sync(&sm.ss[wr][wc + 16 * t], acc[t], SLD, wmma::mem_row_major);
    }
    __syncthreads();
  } else {
    if constexpr (std::is_same<S, float>::value) {
      if (tf32) {  // float32 on tensor cores, as torch does with allow_tf32
        using namespace nvcuda;
        const int warp = tid >> 5, wr = (warp >> 1) * 16, wc = (warp & 1) * 32;
        wmma::fragment<wmma::accumulator, 16, 16, 8, float> acc[2];
        wmma::fill_fragment(acc[0], 0.f);
        wmma::fill_fragment(acc[1], 0.f);
        for (int64_t k0 = 0; k0 < H; k0 += BK) {
          for (int e = tid; e < BM * BK; e += NT) {
            const int r = e / BK, k = e % BK;
            sm.xs[r][k] = (r < na && k0 + k < H) ? X[(a0 + r) * ldx + k0 + k] : 0.f;
            sm.ys[r][k] = (r < nc && k0 + k < H) ? Y[(c0 + r) * ldy + k0 + k] : 0.f;
          }
          __syncthreads();
          for (int kk = 0; kk < BK; kk += 8) {
            wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major> fa;
            wmma::load_matrix_sync(fa, &sm.xs[wr][kk], BK + KPAD);
            for (int e = 0; e < fa.num_elements; ++e) fa.x[e] = wmma::__float_to_tf32(fa.x[e]);
            for (int t = 0; t < 2; ++t) {
              wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::col_major> fb;
              wmma::load_matrix_sync(fb, &sm.ys[wc + 16 * t][kk], BK + KPAD);
              for (int e = 0; e < fb.num_elements; ++e) fb.x[e] = wmma::__float_to_tf32(fb.x[e]);
              wmma::mma_sync(acc[t], fa, fb, acc[t]);
            }
          }
          __syncthreads();
        }
        for (int t = 0; t < 2; ++t) {
          for (int e = 0; e < acc[t].num_elements; ++e) acc[t].x[e] *= (float)it;
          wmma::store_matrix_sync(&sm.ss[wr][wc + 16 * t], acc[t], SLD, wmma::mem_row_major);
        }
        __syncthreads();
        return;
      }
    }
    const int ty = tid / 16, tx = tid % 16;
    A acc[4][4] = {};
    for (int64_t k0 = 0; k0 < H; k0 += BK) {
      for (int e = tid; e < BM * BK; e += NT) {
        const int r = e / BK, k = e % BK;
        sm.xs[r][k] = (r < na && k0 + k < H) ? X[(a0 + r) * ldx + k0 + k] : S(0);
        sm.ys[r][k] = (r < nc && k0 + k < H) ? Y[(c0 + r) * ldy + k0 + k] : S(0);
      }
      __syncthreads();
#pragma unroll 4
      for (int k = 0; k < BK; ++k) {
        A xa[4], yb[4];
        for (int r = 0; r < 4; ++r) xa[r] = (A)sm.xs[ty + 16 * r][k];
        for (int c = 0; c < 4; ++c) yb[c] = (A)sm.ys[tx + 16 * c][k];
        for (int r = 0; r < 4; ++r)
          for (int c = 0; c < 4; ++c) acc[r][c] += xa[r] * yb[c];
      }
      __syncthreads();
    }
    for (int r = 0; r < 4; ++r)
      for (int c = 0; c < 4; ++c) sm.ss[ty + 16 * r][tx + 16 * c] = it * acc[r][c];
    __syncthreads();
  }
}

template <typename A>
struct BiasArgs {
  bool on;
  int hidden, K2;
  int64_t Bd;
  const A *Am, *Ct, *b1, *w2, *zc, *uq, *ud, *b2p, *scalep;
};

__host__ __device__ __forceinline__ int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ bool overlap(int64_t alo, int64_t ahi, int64_t blo, int64_t bhi) {
  return (alo > blo ? alo : blo) <= imin(ahi, bhi);
}

// w2 . relu(z) at delta = +1 (s = 0) or -1 (s = 1): warp-wide, all lanes get the value.
template <typename A> __device__ A clamp_y(const BiasArgs<A>& b, int s) {
  A y = 0;
  for (int n = threadIdx.x & 31; n < b.hidden; n += 32) y += b.w2[n] * fmax(b.zc[s * b.hidden + n], A(0));
  return cuda::warp_sum(y);
}

// w2 . relu(z_ij) for one pair, warp-wide (i, j uniform across the warp): the clamped constants, or the
// angle-difference first layer with the pair's column features in ctp[:, jl].
template <typename A>
__device__ A pair_y(const BiasArgs<A>& b, const A (*ctp)[BN], int64_t i, int64_t j, int jl, A yc0, A yc1) {
  const A diff = b.ud[j] - b.uq[i];
  if (diff > A(1)) return yc0;
  if (diff < A(-1)) return yc1;
  A part = 0;
  for (int n = threadIdx.x & 31; n < b.hidden; n += 32) {
    const A* ar = b.Am + (i * b.hidden + n) * b.K2;
    A z = b.b1[n];
    for (int m = 0; m < b.K2; ++m) z += ar[m] * ctp[m][jl];
    part += b.w2[n] * fmax(z, A(0));
  }
  return cuda::warp_sum(part);
}

template <typename S, typename A, int MODE>
__global__ void __launch_bounds__(NT) multipos_kernel(MultiposParams p) {
  // wmma load/store pointers must be 256-bit aligned: the base is, the Smem offsets keep it.
  extern __shared__ __align__(128) unsigned char smem_raw[];
  Smem<S, A>& sm = *reinterpret_cast<Smem<S, A>*>(smem_raw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const bool rowdir = MODE == FWD_ROW || MODE == BWD_ROW;
  const bool negdir = MODE == BWD_NEG;
  const S* q = static_cast<const S*>(p.q);
  const S* d = static_cast<const S*>(p.d);
  const S* neg = static_cast<const S*>(p.neg);
  const int64_t Bq = p.Bq, Bd = p.Bd, N = neg ? p.N : 0, H = p.H, off = p.diag_offset;
  const A it = (A)p.inv_temp;
  const S* X = negdir ? neg : (rowdir ? q : d);
  const int64_t ldx = negdir ? p.ldn : (rowdir ? p.ldq : p.ldd);
  const int64_t nA = negdir ? N : (rowdir ? Bq : Bd);
  const S* Y = rowdir ? d : q;
  const int64_t ldy = rowdir ? p.ldd : p.ldq;
  const int64_t nCand = rowdir ? Bd : Bq;
  const int64_t a0 = (int64_t)blockIdx.x * BM;
  if (a0 >= nA) return;
  const int na = (int)imin(BM, nA - a0);

  BiasArgs<A> b;
  b.on = p.has_bias && !negdir;
  b.hidden = (int)p.hidden; b.K2 = (int)p.K2; b.Bd = Bd;
  b.Am = static_cast<const A*>(p.A); b.Ct = static_cast<const A*>(p.Ct); b.b1 = static_cast<const A*>(p.b1);
  b.w2 = static_cast<const A*>(p.w2); b.zc = static_cast<const A*>(p.zc);
  b.uq = static_cast<const A*>(p.u_q); b.ud = static_cast<const A*>(p.u_d);
  b.b2p = static_cast<const A*>(p.b2); b.scalep = static_cast<const A*>(p.scale);
  const A b2 = b.on ? *b.b2p : A(0), scale = b.on ? *b.scalep : A(0);
  const A yc0 = b.on ? clamp_y(b, 0) : A(0), yc1 = b.on ? clamp_y(b, 1) : A(0);

  const A* rs = static_cast<const A*>(p.row_stats);
  const A* cs = static_cast<const A*>(p.col_stats);
  const bool cols = p.col_weight != 0.0;
  const A gl = (MODE >= BWD_ROW) ? *static_cast<const A*>(p.grad_loss) : A(0);
  const A rw = Bq ? (A)(p.row_weight / (double)Bq) * gl : A(0);
  const A cw = (cols && Bd) ? (A)(p.col_weight / (double)Bd) * gl : A(0);

  // Bias scalar-gradient partials (BWD_ROW): per lane for hidden units lane, lane + 32, ...
  A g_b2 = 0, g_scale = 0;

  if (MODE == FWD_ROW || MODE == FWD_COL)
    for (int a = tid; a < BM; a += NT) {
      sm.st[0][a] = ninf<A>(); sm.st[1][a] = 0; sm.st[2][a] = ninf<A>(); sm.st[3][a] = 0; sm.st[4][a] = 0;
      sm.st[5][a] = NAN;
    }
  __syncthreads();

  const int64_t nTiles = (nCand + BN - 1) / BN;
  const int64_t nNegTiles = (MODE == FWD_ROW || MODE == BWD_ROW) ? (N + BN - 1) / BN : 0;
  for (int64_t t = 0; t < nTiles + nNegTiles; ++t) {
    const bool negtile = t >= nTiles;
    const int64_t c0 = (negtile ? t - nTiles : t) * BN;
    const int nc = (int)imin(BN, (negtile ? N : nCand) - c0);
    const S* Yt = negtile ? neg : Y;
    const int64_t ldyt = negtile ? p.ldn : ldy;
    score_tile<S, A>(sm, X, ldx, a0, na, Yt, ldyt, c0, nc, H, it, p.allow_tf32);

    // ---- bias: warp per anchor, lane per hidden unit ----
    const bool tile_bias = b.on && !negtile;
    if (tile_bias) {
      // column features of the tile's documents: candidates (ROW) or the anchors (COL)
      const int64_t j0 = rowdir ? c0 : a0;
      const int nj = rowdir ? nc : na;
      for (int e = tid; e < b.K2 * BN; e += NT) {
        const int m = e / BN, j = e % BN;
        sm.ctp[m][j] = j < nj ? b.Ct[m * Bd + j0 + j] : A(0);
      }
      __syncthreads();
      for (int a = warp; a < na; a += NT / 32) {
        for (int c = 0; c < nc; ++c) {
          const int64_t i = rowdir ? a0 + a : c0 + c, j = rowdir ? c0 + c : a0 + a;
          const A y = pair_y(b, sm.ctp, i, j, rowdir ? c : a, yc0, yc1);
          if (lane == 0) sm.ss[a][c] += scale * (y + b2);
        }
      }
      __syncthreads();
    }

    if constexpr (MODE == FWD_ROW || MODE == FWD_COL) {
      // ---- online stats: warp per anchor ----
      for (int a = warp; a < na; a += NT / 32) {
        const int64_t ag = a0 + a;
        A mx = ninf<A>(), pmx = ninf<A>();
        int cnt = 0;
        for (int c = lane; c < nc; c += 32) {
          const A s = sm.ss[a][c];
          mx = fmax(mx, s);
          if (!negtile) {
            const int64_t i = rowdir ? ag : c0 + c, j = rowdir ? c0 + c : ag;
            if (overlap(p.q_lo[i], p.q_hi[i], p.d_lo[j], p.d_hi[j])) { pmx = fmax(pmx, s); ++cnt; }
            const int64_t dj = rowdir ? ag + off : ag - off;  // candidate index of the anchor's diagonal
            if (c0 + c == dj) sm.st[5][a] = s;
          }
        }
        for (int o = 16; o > 0; o >>= 1) {
          mx = fmax(mx, __shfl_xor_sync(0xffffffffu, mx, o));
          pmx = fmax(pmx, __shfl_xor_sync(0xffffffffu, pmx, o));
          cnt += __shfl_xor_sync(0xffffffffu, cnt, o);
        }
        A sum = 0, psum = 0;
        for (int c = lane; c < nc; c += 32) {
          const A s = sm.ss[a][c];
          sum += dexp(s - mx);
          if (!negtile && cnt) {
            const int64_t i = rowdir ? ag : c0 + c, j = rowdir ? c0 + c : ag;
            if (overlap(p.q_lo[i], p.q_hi[i], p.d_lo[j], p.d_hi[j])) psum += dexp(s - pmx);
          }
        }
        sum = cuda::warp_sum(sum);
        psum = cuda::warp_sum(psum);
        if (lane == 0) {
          lse_merge(sm.st[0][a], sm.st[1][a], mx, sum);
          if (cnt) lse_merge(sm.st[2][a], sm.st[3][a], pmx, psum);
          sm.st[4][a] += (A)cnt;
        }
      }
      __syncthreads();
    } else {
    // ---- backward: dL/ds in place ----
    for (int e = tid; e < BM * BN; e += NT) {
      const int a = e / BN, c = e % BN;
      if (a >= na || c >= nc) { sm.ss[a][c] = 0; continue; }
      const A s = sm.ss[a][c];
      A g = 0;
      if (negtile || negdir) {
        const int64_t i = negdir ? c0 + c : a0 + a;
        g = rw * dexp(s - rs[i]);
      } else {
        const int64_t i = rowdir ? a0 + a : c0 + c, j = rowdir ? c0 + c : a0 + a;
        const bool pos = overlap(p.q_lo[i], p.q_hi[i], p.d_lo[j], p.d_hi[j]);
        const bool diag = j == i + off;
        if (rw != A(0)) {
          const bool pr = pos || (diag && rs[2 * Bq + i] != A(0));
          g = rw * (dexp(s - rs[i]) - (pr ? dexp(s - rs[Bq + i]) : A(0)));
        }
        if (cols) {
          const bool pc = pos || (diag && cs[2 * Bd + j] != A(0));
          g += cw * (dexp(s - cs[j]) - (pc ? dexp(s - cs[Bd + j]) : A(0)));
        }
      }
      sm.ss[a][c] = g;
    }
    __syncthreads();

    // anchor gradient rows: grad[a0 + a, h] += it * sum_c G[a][c] Y[c0 + c, h]
    {
      A* grad = static_cast<A*>(negdir ? p.dneg : (rowdir ? p.dq : p.dd));
      for (int64_t e = tid; e < (int64_t)na * H; e += NT) {
        const int a = (int)(e / H);
        const int64_t h = e % H;
        A acc = 0;
        for (int c = 0; c < nc; ++c) acc += sm.ss[a][c] * (A)Yt[(c0 + c) * ldyt + h];
        grad[(a0 + a) * H + h] += it * acc;
      }
    }

    if (tile_bias) {
      // per pair: dy = G * scale; dz_n = dy w2_n [z_n > 0] for unclamped pairs.
      A* dA = static_cast<A*>(p.dA);
      A* dCt = static_cast<A*>(p.dCt);
      A* dzc = static_cast<A*>(p.dzc);
      A* db1 = static_cast<A*>(p.db1);
      A* dw2 = static_cast<A*>(p.dw2);
      for (int a = warp; a < na; a += NT / 32) {
        for (int nb = 0; nb * 32 < b.hidden; ++nb) {
          const int n = nb * 32 + lane;
          const bool nok = n < b.hidden;
          A acc[kMaxK2];
          for (int m = 0; m < kMaxK2; ++m) acc[m] = 0;
          A s_db1 = 0, s_dw2 = 0, s_dzc0 = 0, s_dzc1 = 0;
          for (int c = 0; c < nc; ++c) {
            const int64_t i = rowdir ? a0 + a : c0 + c, j = rowdir ? c0 + c : a0 + a;
            const int jl = rowdir ? c : a;
            const A g = sm.ss[a][c];
            const A dy = g * scale;
            if (nb == 0 && lane == 0 && rowdir) {
              g_b2 += dy;
              // dscale needs y: recompute below via warp reduction (rare extra cost only in ROW)
            }
            const A diff = b.ud[j] - b.uq[i];
            if (diff > A(1) || diff < A(-1)) {
              if (nok && rowdir) {
                const A zz = b.zc[(diff > A(1) ? 0 : 1) * b.hidden + n];
                if (zz > A(0)) {
                  s_dw2 += dy * zz;
                  if (diff > A(1)) s_dzc0 += dy * b.w2[n]; else s_dzc1 += dy * b.w2[n];
                }
              }
              continue;
            }
            if (!nok) continue;
            const A* ar = b.Am + (i * b.hidden + n) * b.K2;
            A z = b.b1[n];
            for (int m = 0; m < b.K2; ++m) z += ar[m] * sm.ctp[m][jl];
            if (!(z > A(0))) continue;
            const A dz = dy * b.w2[n];
            s_dw2 += dy * z;
            s_db1 += dz;
            if (rowdir) {
              for (int m = 0; m < b.K2 && m < kMaxK2; ++m) acc[m] += dz * sm.ctp[m][jl];
            } else {
              for (int m = 0; m < b.K2 && m < kMaxK2; ++m) acc[m] += dz * ar[m];
            }
          }
          if (rowdir) {
            if (nok) {
              A* o = dA + ((a0 + a) * b.hidden + n) * b.K2;
              for (int m = 0; m < b.K2; ++m) o[m] += acc[m];
              atomicAdd(db1 + n, s_db1);
              atomicAdd(dw2 + n, s_dw2);
              if (s_dzc0 != A(0)) atomicAdd(dzc + n, s_dzc0);
              if (s_dzc1 != A(0)) atomicAdd(dzc + b.hidden + n, s_dzc1);
            }
          } else {
            // dCt[m, anchor] += sum over hidden units (lanes) of acc[m]
            for (int m = 0; m < b.K2; ++m) {
              const A v = cuda::warp_sum(nok ? acc[m] : A(0));
              if (lane == 0) dCt[m * Bd + a0 + a] += v;
            }
          }
        }
        if (rowdir) {
          // dscale = sum_c G (y + b2): y recomputed per pair with a warp reduction.
          for (int c = 0; c < nc; ++c) {
            const A y = pair_y(b, sm.ctp, a0 + a, c0 + c, c, yc0, yc1);
            if (lane == 0) g_scale += sm.ss[a][c] * (y + b2);
          }
        }
      }
    }
    __syncthreads();
    }  // backward
  }

  if (MODE == FWD_ROW || MODE == FWD_COL) {
    A* out = static_cast<A*>(rowdir ? p.row_stats : p.col_stats);
    const int64_t n = rowdir ? Bq : Bd;
    for (int a = tid; a < na; a += NT) {
      const int64_t ag = a0 + a;
      out[ag] = sm.st[0][a] + dlog(sm.st[1][a]);
      const bool fb = sm.st[4][a] == A(0);
      out[n + ag] = fb ? sm.st[5][a] : sm.st[2][a] + dlog(sm.st[3][a]);
      out[2 * n + ag] = fb ? A(1) : A(0);
    }
  }
  if (MODE == BWD_ROW && b.on && lane == 0) {
    if (g_b2 != A(0)) atomicAdd(static_cast<A*>(p.db2), g_b2);
    if (g_scale != A(0)) atomicAdd(static_cast<A*>(p.dscale), g_scale);
  }
}

// loss = row_weight * mean(lse - lsep) + col_weight * mean(...), one block.
template <typename A>
__global__ void loss_kernel(MultiposParams p) {
  __shared__ A red[32];
  const A* rs = static_cast<const A*>(p.row_stats);
  const A* cs = static_cast<const A*>(p.col_stats);
  A acc = 0;
  for (int64_t i = threadIdx.x; i < p.Bq; i += blockDim.x)
    if (p.row_weight != 0.0) acc += (rs[i] - rs[p.Bq + i]) * (A)(p.row_weight / (double)p.Bq);
  if (p.col_weight != 0.0)
    for (int64_t j = threadIdx.x; j < p.Bd; j += blockDim.x) acc += (cs[j] - cs[p.Bd + j]) * (A)(p.col_weight / (double)p.Bd);
  acc = cuda::warp_sum(acc);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x < 32) {
    A v = threadIdx.x < blockDim.x / 32 ? red[threadIdx.x] : A(0);
    v = cuda::warp_sum(v);
    if (threadIdx.x == 0) *static_cast<A*>(p.loss) = v;
  }
}

template <typename S, typename A, int MODE>
void launch(const MultiposParams& p, cudaStream_t st, int64_t n_anchor) {
  if (n_anchor <= 0) return;
  const size_t smem = sizeof(Smem<S, A>);
  int device = 0, limit = 0;
  TK_CUDA_CHECK(cudaGetDevice(&device));
  TK_CUDA_CHECK(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  if (smem > (size_t)limit)  // a clear error instead of cudaFuncSetAttribute's "invalid argument"
    fail("multipos_infonce CUDA kernel needs " + std::to_string(smem) + " bytes of shared memory per block, this GPU allows " +
         std::to_string(limit) + "; use float32 or the CPU");
  auto k = multipos_kernel<S, A, MODE>;
  TK_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  const int64_t blocks = (n_anchor + BM - 1) / BM;
  k<<<(unsigned)blocks, NT, smem, st>>>(p);
  cuda::check_launch();
}

template <typename S>
void run_fwd(const MultiposParams& p, cudaStream_t st) {
  using A = typename std::conditional<std::is_same<S, double>::value, double, float>::type;
  launch<S, A, FWD_ROW>(p, st, p.Bq);
  if (p.col_weight != 0.0) launch<S, A, FWD_COL>(p, st, p.Bd);
  loss_kernel<A><<<1, 256, 0, st>>>(p);
  cuda::check_launch();
}

template <typename S>
void run_bwd(const MultiposParams& p, cudaStream_t st) {
  using A = typename std::conditional<std::is_same<S, double>::value, double, float>::type;
  launch<S, A, BWD_ROW>(p, st, p.Bq);
  launch<S, A, BWD_COL>(p, st, p.Bd);
  if (p.neg && p.N > 0) launch<S, A, BWD_NEG>(p, st, p.N);
}

void check_k2(const MultiposParams& p) {
  if (p.has_bias && p.K2 > kMaxK2) fail("multipos_infonce CUDA kernels support bias feature sizes D <= 65 (at most 64 sin/cos features)");
}

}  // namespace

int64_t multipos_infonce_cuda_workspace(const MultiposParams&, bool) { return 0; }

void multipos_infonce_fwd_cuda(const MultiposParams& p, int device, uintptr_t stream, void*, int64_t) {
  check_k2(p);
  cuda::set_device(device);
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  cuda::dispatch_device_float(p.dtype, [&](auto s) { run_fwd<decltype(s)>(p, st); });
}

void multipos_infonce_bwd_cuda(const MultiposParams& p, int device, uintptr_t stream, void*, int64_t) {
  check_k2(p);
  cuda::set_device(device);
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  cuda::dispatch_device_float(p.dtype, [&](auto s) { run_bwd<decltype(s)>(p, st); });
}

}  // namespace tk
