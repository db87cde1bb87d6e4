// CPU kernels for the relative-offset bias. One query row per OpenMP iteration; documents in blocks of
// JB columns whose angle features are precomputed once (column-block transposed). In blocks where the clamp
// cannot bite the first layer is Q_i (hidden x 2K) times the block's features: a register-blocked GEMM
// written with GCC vector extensions (no transcendental per pair); other blocks take the exact per-pair
// path of bias_math.h. Nothing of size Bq*Bd*D or Bq*Bd*hidden exists, forward or backward.
#include <omp.h>
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>
#include "offset_bias/bias_math.h"
#include "offset_bias/offset_bias.h"

namespace tk {
namespace {
using namespace tk::bias;

template <typename A> struct VecOf;
template <> struct VecOf<float> { typedef float type __attribute__((vector_size(32))); static constexpr int W = 8; };
template <> struct VecOf<double> { typedef double type __attribute__((vector_size(32))); static constexpr int W = 4; };

template <typename A>
struct VK {
  using V = typename VecOf<A>::type;
  static constexpr int W = VecOf<A>::W;
  static constexpr int JB = 2 * W;  // columns per block: two vectors
  static inline V ld(const A* p) { V v; std::memcpy(&v, p, sizeof v); return v; }
  static inline void st(A* p, V v) { std::memcpy(p, &v, sizeof v); }
  static inline V splat(A s) { V v = V{} + s; return v; }
  // relu as torch's: NaN stays NaN (v <= 0 is false for NaN)
  static inline V relu(V v) { const V z = V{}; return v <= z ? z : v; }
  static inline A hsum(V v) { A s = 0; for (int k = 0; k < W; ++k) s += v[k]; return s; }
};

// Angle features of all documents, block-transposed: C[b][m][jj] for j = b*JB + jj (zero past Bd),
// m < K: sin(f_m u_d[j]), K <= m < 2K: cos; plus each block's u_d range for the fast-path test.
template <typename A>
struct Columns {
  int64_t nb = 0;
  int K = 0, K2 = 0;
  std::vector<A> C, dmin, dmax;
  void build(const A* ud, int64_t Bd, const A* freqs, int64_t D) {
    constexpr int JB = VK<A>::JB;
    K = bias_num_freqs(D);
    K2 = 2 * K;
    nb = (Bd + JB - 1) / JB;
    C.assign((size_t)nb * K2 * JB, A(0));
    dmin.assign(nb, A(0));
    dmax.assign(nb, A(0));
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < nb; ++b) {
      A* cb = C.data() + (size_t)b * K2 * JB;
      A lo = ud[b * JB], hi = lo;
      for (int jj = 0; jj < JB; ++jj) {
        const int64_t j = b * JB + jj;
        if (j >= Bd) break;
        const A u = ud[j];
        lo = std::min(lo, u);
        hi = std::max(hi, u);
        if (!(u == u)) lo = hi = u;  // NaN: make the block fail the fast test
        for (int k = 0; k < K; ++k) bias_sincos(freqs[k] * u, &cb[k * JB + jj], &cb[(K + k) * JB + jj]);
      }
      dmin[b] = lo;
      dmax[b] = hi;
    }
  }
  const A* block(int64_t b) const { return C.data() + (size_t)b * K2 * VK<A>::JB; }
};

// acc[r][0..1] = b + Q[n+r, :] . C[:, block] for R rows of Q starting at q (row stride K2).
template <typename A, int R>
inline void first_layer(const A* q, int K2, const A* bias, const A* C, typename VK<A>::V (&acc)[R][2]) {
  using KK = VK<A>;
  constexpr int W = KK::W, JB = KK::JB;
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = KK::splat(bias ? bias[r] : A(0));
  for (int m = 0; m < K2; ++m) {
    auto c0 = KK::ld(C + m * JB), c1 = KK::ld(C + m * JB + W);
#if defined(__GNUC__) && defined(__AVX__)
    // Keep the two column vectors in registers: otherwise GCC re-loads them as FMA memory operands
    // for every row, and the loop becomes load-bound.
    asm("" : "+x"(c0), "+x"(c1));
#endif
    for (int r = 0; r < R; ++r) {
      const A s = q[r * K2 + m];
      acc[r][0] += s * c0;
      acc[r][1] += s * c1;
    }
  }
}

constexpr int kRows = 4;  // hidden units per register block in the forward (8 accumulators cover FMA latency)

// y[0..JB) = sum_n w2[n] relu(b1[n] + Q[n, :] . C[:, block])  (fast path, one block)
template <typename A>
inline void fast_block_fwd(const A* Q, int K2, int64_t hidden, int64_t nlin, const A* b1, const A* w2, const A* C,
                           A* y) {
  using KK = VK<A>;
  using V = typename KK::V;
  V y0 = V{}, y1 = V{};
  int64_t n = 0;
  for (; n < nlin; ++n) {  // units without ReLU (merged always-active units)
    V acc[1][2];
    first_layer<A, 1>(Q + n * K2, K2, b1 + n, C, acc);
    y0 += w2[n] * acc[0][0];
    y1 += w2[n] * acc[0][1];
  }
  for (; n + kRows <= hidden; n += kRows) {
    V acc[kRows][2];
    first_layer<A, kRows>(Q + n * K2, K2, b1 + n, C, acc);
    for (int r = 0; r < kRows; ++r) {
      y0 += w2[n + r] * KK::relu(acc[r][0]);
      y1 += w2[n + r] * KK::relu(acc[r][1]);
    }
  }
  for (; n < hidden; ++n) {
    V acc[1][2];
    first_layer<A, 1>(Q + n * K2, K2, b1 + n, C, acc);
    y0 += w2[n] * KK::relu(acc[0][0]);
    y1 += w2[n] * KK::relu(acc[0][1]);
  }
  KK::st(y, y0);
  KK::st(y + KK::W, y1);
}

template <typename A>
struct Weights {
  const A *freqs, *w1, *b1, *w2;
  A b2, scale;
  int64_t ld_w1, D, hidden;
  explicit Weights(const OffsetBiasParams& p)
      : freqs(static_cast<const A*>(p.freqs)), w1(static_cast<const A*>(p.w1)), b1(static_cast<const A*>(p.b1)),
        w2(static_cast<const A*>(p.w2)), b2(*static_cast<const A*>(p.b2)), scale(*static_cast<const A*>(p.scale)),
        ld_w1(p.ld_w1), D(p.D), hidden(p.hidden) {}
};

template <typename T, typename A>
void fwd(const OffsetBiasParams& p) {
  using KK = VK<A>;
  constexpr int JB = KK::JB;
  if (p.Bq == 0 || p.Bd == 0) return;
  const Weights<A> w(p);
  const A* uq = static_cast<const A*>(p.u_q);
  const A* ud = static_cast<const A*>(p.u_d);
  Columns<A> cols;
  cols.build(ud, p.Bd, w.freqs, w.D);
  const int Kf = cols.K, K2 = cols.K2;
#pragma omp parallel
  {
    std::vector<A> sq(Kf), cq(Kf), Q((size_t)w.hidden * K2), phi(w.D), y(JB);
#pragma omp for schedule(dynamic, 8)
    for (int64_t i = 0; i < p.Bq; ++i) {
      const A u = uq[i];
      const bool row_fast = u >= A(-kBiasFastRange) && u <= A(kBiasFastRange);
      if (row_fast) {
        bias_angle_features(u, w.freqs, Kf, sq.data(), cq.data());
        bias_row_weights(w.w1, w.ld_w1, w.D, w.hidden, sq.data(), cq.data(), Q.data(), (int64_t)K2);
      }
      T* o = static_cast<T*>(p.out) + i * p.ld_out;
      for (int64_t b = 0; b < cols.nb; ++b) {
        const int64_t j0 = b * JB, nj = std::min<int64_t>(JB, p.Bd - j0);
        if (row_fast && bias_tile_fast(u, u, cols.dmin[b], cols.dmax[b])) {
          fast_block_fwd(Q.data(), K2, w.hidden, p.n_linear, w.b1, w.w2, cols.block(b), y.data());
          for (int64_t jj = 0; jj < nj; ++jj) store(o, j0 + jj, w.scale * (y[jj] + w.b2));
        } else {
          for (int64_t jj = 0; jj < nj; ++jj)
            store(o, j0 + jj, bias_pair_eval(ud[j0 + jj] - u, w.freqs, w.D, w.hidden, w.w1, w.ld_w1, w.b1, w.w2,
                                             w.b2, w.scale, phi.data(), p.n_linear));
        }
      }
    }
  }
}

// Backward, fast path, one block of row i. gv: incoming gradient (JB, zero past Bd).
// Writes M = G scale [h > 0] into Mbuf (row stride ldm), adds per-column ddelta to dd and G y' to s1v.
template <typename A>
inline void fast_block_bwd(const A* Q, const A* Qd, int K2, int64_t hidden, int64_t nlin, const A* b1, const A* w2,
                           A scale,
                           const A* C, const A* gv, A* Mbuf, int64_t ldm, typename VK<A>::V (&dd)[2],
                           typename VK<A>::V& s1v) {
  using KK = VK<A>;
  using V = typename KK::V;
  constexpr int W = KK::W, JB = KK::JB;
  const V g0 = KK::ld(gv), g1 = KK::ld(gv + W);
  const V gs0 = g0 * scale, gs1 = g1 * scale;
  const V z = V{};
  V y0 = V{}, y1 = V{};
  // pass 1: h -> relu output and mask-weighted gradient M (units < nlin: no ReLU, M = G scale)
  for (int64_t n = 0; n < hidden;) {
    if (n < nlin) {
      V acc[1][2];
      first_layer<A, 1>(Q + n * K2, K2, b1 + n, C, acc);
      y0 += w2[n] * acc[0][0];
      y1 += w2[n] * acc[0][1];
      KK::st(Mbuf + n * ldm, gs0);
      KK::st(Mbuf + n * ldm + W, gs1);
      n += 1;
    } else if (n + 4 <= hidden) {
      V acc[4][2];
      first_layer<A, 4>(Q + n * K2, K2, b1 + n, C, acc);
      for (int r = 0; r < 4; ++r) {
        y0 += w2[n + r] * KK::relu(acc[r][0]);
        y1 += w2[n + r] * KK::relu(acc[r][1]);
        KK::st(Mbuf + (n + r) * ldm, acc[r][0] <= z ? z : gs0);
        KK::st(Mbuf + (n + r) * ldm + W, acc[r][1] <= z ? z : gs1);
      }
      n += 4;
    } else {
      V acc[1][2];
      first_layer<A, 1>(Q + n * K2, K2, b1 + n, C, acc);
      y0 += w2[n] * KK::relu(acc[0][0]);
      y1 += w2[n] * KK::relu(acc[0][1]);
      KK::st(Mbuf + n * ldm, acc[0][0] <= z ? z : gs0);
      KK::st(Mbuf + n * ldm + W, acc[0][1] <= z ? z : gs1);
      n += 1;
    }
  }
  s1v += g0 * y0 + g1 * y1;
  // pass 2: dh/d(delta) -> ddelta = sum_n w2[n] M[n] h'[n]
  for (int64_t n = 0; n < hidden;) {
    const int R = n + 4 <= hidden ? 4 : 1;
    V acc[4][2];
    if (R == 4) {
      first_layer<A, 4>(Qd + n * K2, K2, nullptr, C, acc);
    } else {
      V a1[1][2];
      first_layer<A, 1>(Qd + n * K2, K2, nullptr, C, a1);
      acc[0][0] = a1[0][0];
      acc[0][1] = a1[0][1];
    }
    for (int r = 0; r < R; ++r) {
      dd[0] += w2[n + r] * KK::ld(Mbuf + (n + r) * ldm) * acc[r][0];
      dd[1] += w2[n + r] * KK::ld(Mbuf + (n + r) * ldm + W) * acc[r][1];
    }
    n += R;
  }
}

// E[n..n+R)[m] += sum_j M[n][j] c[m][j] over the fast blocks collected in a chunk (Mbuf row stride ldm,
// block bi at column bi*JB): a register-blocked GEMM, E kept per lane and reduced once per row.
template <typename A, int R>
inline void chunk_E_rows(const A* Mbuf, int64_t ldm, const A* const* Cb, int nblk, int K2, typename VK<A>::V* E,
                         typename VK<A>::V* esum) {
  using KK = VK<A>;
  using V = typename KK::V;
  constexpr int W = KK::W, JB = KK::JB;
  for (int r = 0; r < R; ++r)
    for (int bi = 0; bi < nblk; ++bi)
      esum[r] += KK::ld(Mbuf + r * ldm + bi * JB) + KK::ld(Mbuf + r * ldm + bi * JB + W);
  for (int m = 0; m < K2; m += 2) {  // K2 = 2K is even
    V acc[R][2];
    for (int r = 0; r < R; ++r) {
      acc[r][0] = E[r * K2 + m];
      acc[r][1] = E[r * K2 + m + 1];
    }
    for (int v = 0; v < 2 * nblk; ++v) {
      const A* C = Cb[v >> 1] + (v & 1) * W;
      V c0 = KK::ld(C + m * JB), c1 = KK::ld(C + (m + 1) * JB);
#if defined(__GNUC__) && defined(__AVX__)
      asm("" : "+x"(c0), "+x"(c1));  // in registers, not re-loaded per row (see first_layer)
#endif
      const A* mp = Mbuf + (v >> 1) * JB + (v & 1) * W;
      for (int r = 0; r < R; ++r) {
        const V mv = KK::ld(mp + r * ldm);
        acc[r][0] += mv * c0;
        acc[r][1] += mv * c1;
      }
    }
    for (int r = 0; r < R; ++r) {
      E[r * K2 + m] = acc[r][0];
      E[r * K2 + m + 1] = acc[r][1];
    }
  }
}

template <typename A>
inline void chunk_E(const A* Mbuf, int64_t ldm, const int64_t* blocks, int nblk, const Columns<A>& cols,
                    int64_t hidden, typename VK<A>::V* E, typename VK<A>::V* esum) {
  const A* Cb[16];
  for (int bi = 0; bi < nblk; ++bi) Cb[bi] = cols.block(blocks[bi]);
  const int K2 = cols.K2;
  int64_t n = 0;
  for (; n + 4 <= hidden; n += 4) chunk_E_rows<A, 4>(Mbuf + n * ldm, ldm, Cb, nblk, K2, E + n * K2, esum + n);
  for (; n < hidden; ++n) chunk_E_rows<A, 1>(Mbuf + n * ldm, ldm, Cb, nblk, K2, E + n * K2, esum + n);
}

constexpr int kChunk = 8;  // fast blocks per E update: M chunk and its features stay in L1

template <typename T, typename A>
void bwd(const OffsetBiasParams& p) {
  using KK = VK<A>;
  using V = typename KK::V;
  constexpr int W = KK::W, JB = KK::JB;
  const Weights<A> w(p);
  const A* uq = static_cast<const A*>(p.u_q);
  const A* ud = static_cast<const A*>(p.u_d);
  A* gq = static_cast<A*>(p.grad_uq);
  A* gd = static_cast<A*>(p.grad_ud);
  A* parts = static_cast<A*>(p.partials);
  const int64_t psz = offset_bias_part_size(p), D1 = w.D + 1;
  std::fill(parts, parts + p.nparts * psz, A(0));
  std::fill(gd, gd + p.Bd, A(0));
  std::fill(gq, gq + p.Bq, A(0));
  if (p.Bq == 0 || p.Bd == 0) return;
  Columns<A> cols;
  cols.build(ud, p.Bd, w.freqs, w.D);
  const int Kf = cols.K, K2 = cols.K2;
  const int nthreads = (int)std::max<int64_t>(1, std::min<int64_t>(omp_get_max_threads(), p.nparts));
  // Per-thread d u_d in double, reduced after the loop in a fixed order (deterministic for a fixed thread count).
  std::vector<double> gd_thread((size_t)nthreads * p.Bd, 0.0);
  int used_threads = 1;
#pragma omp parallel num_threads(nthreads)
  {
    const int t = omp_get_thread_num();
#pragma omp single
    used_threads = omp_get_num_threads();
    std::vector<A> sq(Kf), cq(Kf), Q((size_t)w.hidden * K2), Qd((size_t)w.hidden * K2), phi(w.D), dphi(w.D);
    std::vector<A> Mbuf((size_t)w.hidden * kChunk * JB), gv(JB);
    std::vector<V> E((size_t)w.hidden * K2), esum(w.hidden);
    // Hierarchical sums (float32 accuracy): E and esum hold one chunk of kChunk * JB columns
    // in A, then go into the row's double totals Ed / esd; the fold with the row's sin/cos runs in double.
    std::vector<double> Ed((size_t)w.hidden * K2), esd(w.hidden), sqd(Kf), cqd(Kf), Rfast((size_t)w.hidden * D1);
    // Per-row sums in A, added row by row into double totals: the weight and scalar gradients are sums
    // over Bq * Bd pairs, and one float accumulator over all of them loses digits that torch keeps.
    std::vector<A> Rrow(psz);
    std::vector<double> Rd(psz, 0.0);
    A* R = Rrow.data();
    double* gdt = gd_thread.data() + (size_t)t * p.Bd;
    auto flush_chunk = [&]() {
      for (size_t k = 0; k < Ed.size(); ++k) {
        Ed[k] += (double)KK::hsum(E[k]);
        E[k] = V{};
      }
      for (int64_t n = 0; n < w.hidden; ++n) {
        esd[n] += (double)KK::hsum(esum[n]);
        esum[n] = V{};
      }
    };
#pragma omp for schedule(static)
    for (int64_t i = 0; i < p.Bq; ++i) {
      const A u = uq[i];
      const bool row_fast = u >= A(-kBiasFastRange) && u <= A(kBiasFastRange);
      bool any_fast = false;
      if (row_fast) {
        bias_angle_features(u, w.freqs, Kf, sq.data(), cq.data());
        bias_row_weights(w.w1, w.ld_w1, w.D, w.hidden, sq.data(), cq.data(), Q.data(), (int64_t)K2);
        bias_row_dweights(Q.data(), (int64_t)K2, w.freqs, Kf, w.hidden, Qd.data(), (int64_t)K2);
        std::fill(E.begin(), E.end(), V{});
        std::fill(esum.begin(), esum.end(), V{});
        std::fill(Ed.begin(), Ed.end(), 0.0);
        std::fill(esd.begin(), esd.end(), 0.0);
      }
      const T* G = static_cast<const T*>(p.grad_out) + i * p.ld_grad;
      std::fill(Rrow.begin(), Rrow.end(), A(0));
      double s1 = 0.0, s0 = 0.0;  // sums of G y and G: per block in A, then double
      double gq_row = 0.0;
      int64_t chunk_blocks[kChunk];
      int nchunk = 0;
      for (int64_t b = 0; b < cols.nb; ++b) {
        const int64_t j0 = b * JB, nj = std::min<int64_t>(JB, p.Bd - j0);
        for (int jj = 0; jj < JB; ++jj) gv[jj] = jj < nj ? load(G, (j0 + jj) * p.ld_grad_col) : A(0);
        for (int64_t jj = 0; jj < nj; ++jj) s0 += (double)gv[jj];
        if (row_fast && bias_tile_fast(u, u, cols.dmin[b], cols.dmax[b])) {
          any_fast = true;
          V dd[2] = {V{}, V{}}, s1v = V{};
          fast_block_bwd(Q.data(), Qd.data(), K2, w.hidden, p.n_linear, w.b1, w.w2, w.scale, cols.block(b), gv.data(),
                         Mbuf.data() + nchunk * JB, (int64_t)kChunk * JB, dd, s1v);
          chunk_blocks[nchunk++] = b;
          if (nchunk == kChunk) {
            chunk_E(Mbuf.data(), (int64_t)kChunk * JB, chunk_blocks, nchunk, cols, w.hidden, E.data(), esum.data());
            flush_chunk();
            nchunk = 0;
          }
          s1 += (double)KK::hsum(s1v);
          gq_row -= (double)KK::hsum(dd[0] + dd[1]);
          for (int64_t jj = 0; jj < nj; ++jj) gdt[j0 + jj] += (double)(jj < W ? dd[0][jj] : dd[1][jj - W]);
        } else {
          for (int64_t jj = 0; jj < nj; ++jj) {
            A dummy0 = 0, s1p = 0;
            const A d = bias_pair_backward(ud[j0 + jj] - u, gv[jj], w.freqs, w.D, w.hidden, w.w1, w.ld_w1, w.b1,
                                           w.w2, w.scale, phi.data(), dphi.data(), R, &s1p, &dummy0, p.n_linear);
            s1 += (double)s1p;
            gq_row -= (double)d;
            gdt[j0 + jj] += (double)d;
          }
        }
      }
      if (nchunk > 0) {
        chunk_E(Mbuf.data(), (int64_t)kChunk * JB, chunk_blocks, nchunk, cols, w.hidden, E.data(), esum.data());
        flush_chunk();
        nchunk = 0;
      }
      if (any_fast) {
        for (int k = 0; k < Kf; ++k) {
          sqd[k] = (double)sq[k];
          cqd[k] = (double)cq[k];
        }
        std::fill(Rfast.begin(), Rfast.end(), 0.0);
        bias_fold_row(Ed.data(), (int64_t)K2, esd.data(), sqd.data(), cqd.data(), w.D, w.hidden, Rfast.data());
        for (int64_t k = 0; k < psz - 2; ++k) Rd[k] += Rfast[k];
      }
      gq[i] = (A)gq_row;
      for (int64_t k = 0; k < psz - 2; ++k) Rd[k] += (double)Rrow[k];
      Rd[psz - 2] += s1;
      Rd[psz - 1] += s0;
    }
    for (int64_t k = 0; k < psz; ++k) parts[t * psz + k] = (A)Rd[k];
  }
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < p.Bd; ++j) {
    double s = 0;
    for (int t = 0; t < used_threads; ++t) s += gd_thread[(size_t)t * p.Bd + j];
    gd[j] = (A)s;
  }
}

template <typename T, typename A>
void lookup(const OffsetBiasParams& p) {
  const A* uq = static_cast<const A*>(p.u_q);
  const A* ud = static_cast<const A*>(p.u_d);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < p.Bq; ++i) {
    T* o = static_cast<T*>(p.out) + i * p.ld_out;
    const A u = uq[i];
    for (int64_t j = 0; j < p.Bd; ++j) store(o, j, bias_table_lookup<A>(p.table, p.points, ud[j] - u));
  }
}

// Training table mode, forward: the lookup with the table in A (exact MLP samples, not rounded to float32).
template <typename T, typename A>
void table_fwd(const OffsetBiasParams& p) {
  const A* uq = static_cast<const A*>(p.u_q);
  const A* ud = static_cast<const A*>(p.u_d);
  const A* v = static_cast<const A*>(p.table_a);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < p.Bq; ++i) {
    T* o = static_cast<T*>(p.out) + i * p.ld_out;
    const A u = uq[i];
    for (int64_t j = 0; j < p.Bd; ++j) store(o, j, bias_table_lookup<A>(v, p.points, ud[j] - u));
  }
}

// Training table mode, backward: per pair, x = (clamp(diff) + 1) (P - 1) / 2, i0 = clamp(floor(x), 0, P - 2),
// t = x - i0; dL/dvalues[i0] += g (1 - t), dL/dvalues[i0 + 1] += g t (one double histogram per thread, Python
// sums the slots); ddelta = g slope where the clamp passes, into d u_d (+) and d u_q (-), summed in double
// (per-thread column sums reduced in a fixed order: deterministic for a fixed thread count).
template <typename T, typename A>
void table_bwd(const OffsetBiasParams& p) {
  const A* uq = static_cast<const A*>(p.u_q);
  const A* ud = static_cast<const A*>(p.u_d);
  const A* v = static_cast<const A*>(p.table_a);
  A* gq = static_cast<A*>(p.grad_uq);
  A* gd = static_cast<A*>(p.grad_ud);
  double* parts = static_cast<double*>(p.partials);
  const int64_t P = p.points;
  std::fill(parts, parts + p.nparts * P, 0.0);
  std::fill(gq, gq + p.Bq, A(0));
  std::fill(gd, gd + p.Bd, A(0));
  if (p.Bq == 0 || p.Bd == 0) return;
  const int nthreads = (int)std::max<int64_t>(1, std::min<int64_t>(omp_get_max_threads(), p.nparts));
  std::vector<double> gd_thread((size_t)nthreads * p.Bd, 0.0);
  int used_threads = 1;
  const A half = A(0.5) * A(P - 1);
  const T* G = static_cast<const T*>(p.grad_out);
#pragma omp parallel num_threads(nthreads)
  {
    const int t = omp_get_thread_num();
#pragma omp single
    used_threads = omp_get_num_threads();
    double* hist = parts + (size_t)t * P;
    double* gdt = gd_thread.data() + (size_t)t * p.Bd;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < p.Bq; ++i) {
      const A u = uq[i];
      const T* Gi = G + i * p.ld_grad;
      double row = 0.0;
      for (int64_t j = 0; j < p.Bd; ++j) {
        const A diff = ud[j] - u;
        const A g = load(Gi, j * p.ld_grad_col);
        const A x = (bias_clamp(diff) + A(1)) * half;
        if (!(x == x)) {  // NaN position: NaN gradients for u, nothing binned (the reference's index is undefined)
          row += (double)x;
          gdt[j] += (double)x;
          continue;
        }
        int64_t i0 = (int64_t)std::floor(x);
        i0 = i0 < 0 ? 0 : (i0 > P - 2 ? P - 2 : i0);
        const A tt = x - A(i0);
        hist[i0] += (double)(g * (A(1) - tt));
        hist[i0 + 1] += (double)(g * tt);
        if (bias_passes(diff)) {
          const A dd = g * ((v[i0 + 1] - v[i0]) * half);
          row -= (double)dd;
          gdt[j] += (double)dd;
        }
      }
      gq[i] = (A)row;
    }
  }
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < p.Bd; ++j) {
    double s = 0;
    for (int t = 0; t < used_threads; ++t) s += gd_thread[(size_t)t * p.Bd + j];
    gd[j] = (A)s;
  }
}

template <template <typename, typename> class Fn>
void dispatch(const OffsetBiasParams& p) {
  dispatch_float(p.dtype, [&](auto t) {
    using T = decltype(t);
    Fn<T, typename Acc<T>::type>::run(p);  // float64 calls accumulate in double, the rest in float
  });
}
template <typename T, typename A> struct FwdFn { static void run(const OffsetBiasParams& p) { fwd<T, A>(p); } };
template <typename T, typename A> struct BwdFn { static void run(const OffsetBiasParams& p) { bwd<T, A>(p); } };
template <typename T, typename A> struct LookupFn { static void run(const OffsetBiasParams& p) { lookup<T, A>(p); } };
template <typename T, typename A> struct TableFwdFn { static void run(const OffsetBiasParams& p) { table_fwd<T, A>(p); } };
template <typename T, typename A> struct TableBwdFn { static void run(const OffsetBiasParams& p) { table_bwd<T, A>(p); } };

}  // namespace

void offset_bias_fwd_cpu(const OffsetBiasParams& p) { dispatch<FwdFn>(p); }
void offset_bias_bwd_cpu(const OffsetBiasParams& p) { dispatch<BwdFn>(p); }
void offset_bias_lookup_cpu(const OffsetBiasParams& p) { dispatch<LookupFn>(p); }
void offset_bias_table_fwd_cpu(const OffsetBiasParams& p) { dispatch<TableFwdFn>(p); }
void offset_bias_table_bwd_cpu(const OffsetBiasParams& p) { dispatch<TableBwdFn>(p); }

}  // namespace tk
