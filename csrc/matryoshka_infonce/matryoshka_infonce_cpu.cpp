// CPU kernels for the single-pass fused Matryoshka InfoNCE (matryoshka_infonce.h). OpenMP over row blocks
// of IT anchors, each walking all JT-wide candidate panels (staggered start, per-panel locks for column
// state, as csrc/multipos_infonce/multipos_infonce_cpu.cpp). Per tile the raw dot products are accumulated
// segment by segment with the acc_nn micro-kernel (csrc/common/cpu_gemm.h) and snapshot after each
// segment: K level logit tiles for the price of one full-width product. Forward keeps an online
// log-sum-exp per level for rows (and columns); backward recomputes, builds the K coefficient tiles,
// suffix-sums them over levels and runs one acc_nn per segment for dq and dd.
// Scratch per thread: O(K * IT * JT + JT * H); shared: one transposed copy of d (and extra_neg),
// O(K * (Bq + Bd + N)) statistics.
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#include "common/cpu_gemm.h"
#include "common/cpu_math.h"
#include "matryoshka_infonce/matryoshka_infonce.h"

namespace tk {
namespace {

constexpr int64_t IT = 64;  // anchor rows per task
constexpr int64_t JT = 96;  // candidate columns per tile

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

class Locks {
 public:
  explicit Locks(int64_t n) : l_(std::max<int64_t>(n, 1)) { for (auto& x : l_) omp_init_lock(&x); }
  ~Locks() { for (auto& x : l_) omp_destroy_lock(&x); }
  void lock(int64_t i) { omp_set_lock(&l_[i]); }
  bool try_lock(int64_t i) { return omp_test_lock(&l_[i]) != 0; }
  void unlock(int64_t i) { omp_unset_lock(&l_[i]); }
 private:
  std::vector<omp_lock_t> l_;
};

inline int64_t stagger(int64_t ib, int64_t nJB) {
  const int64_t nth = omp_get_num_threads(), tid = omp_get_thread_num();
  return (tid * nJB / std::max<int64_t>(nth, 1) + ib) % std::max<int64_t>(nJB, 1);
}

inline float mexp(float x) { return fast_exp(x); }
inline double mexp(double x) { return std::exp(x); }

inline void vexp_inplace(float* x, int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    vf8 v;
    std::memcpy(&v, x + j, sizeof v);
    v = fast_exp(v);
    std::memcpy(x + j, &v, sizeof v);
  }
  for (; j < n; ++j) x[j] = mexp(x[j]);
}
inline void vexp_inplace(double* x, int64_t n) {
  for (int64_t j = 0; j < n; ++j) x[j] = std::exp(x[j]);
}

// (m, s) represents log(s) + m; merges (m2, s2), s2 == 0 meaning empty.
template <typename A> inline void lse_merge(A& m, A& s, A m2, A s2) {
  if (s2 == A(0)) return;
  if (m2 > m) { s = s * mexp(m - m2) + s2; m = m2; }
  else s += s2 * mexp(m2 - m);
}

inline bool overlap(int64_t alo, int64_t ahi, int64_t blo, int64_t bhi) { return std::max(alo, blo) <= std::min(ahi, bhi); }

template <typename A> inline void row_update(const A* z, int64_t n, A& m, A& s, A* e) {
  if (n <= 0) return;
  A mx = z[0];
#pragma omp simd reduction(max : mx)
  for (int64_t j = 1; j < n; ++j) mx = std::max(mx, z[j]);
  for (int64_t j = 0; j < n; ++j) e[j] = z[j] - mx;
  vexp_inplace(e, n);
  A sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) sum += e[j];
  lse_merge(m, s, mx, sum);
}

// Positive part of a row: exps only for the positives (usually one or a few per row).
template <typename A>
inline void pos_update(const A* z, int64_t n, int64_t qlo, int64_t qhi, const int64_t* dlo, const int64_t* dhi,
                       A& m, A& s, int64_t& cnt) {
  A mx = -std::numeric_limits<A>::infinity();
  int64_t c = 0;
  for (int64_t j = 0; j < n; ++j)
    if (overlap(qlo, qhi, dlo[j], dhi[j])) { ++c; mx = std::max(mx, z[j]); }
  if (!c) return;
  A sum = 0;
  for (int64_t j = 0; j < n; ++j)
    if (overlap(qlo, qhi, dlo[j], dhi[j])) sum += mexp(z[j] - mx);
  lse_merge(m, s, mx, sum);
  cnt += c;
}

// Pack panel b of X (rows [b*JT, b*JT + w)) transposed to (H x w) at out + b*JT*H.
template <typename A>
void pack_panels(const A* X, int64_t ld, int64_t n, int64_t H, A* out) {
  const int64_t nb = ceil_div(n, JT);
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t j0 = b * JT, w = std::min(JT, n - j0);
    gemm::transpose_pack(w, H, X + j0 * ld, ld, out + j0 * H, w);
  }
}

template <typename A>
class Pass {
 public:
  explicit Pass(const MatryoshkaParams& params)
      : p(params), q(static_cast<const A*>(p.q)), d(static_cast<const A*>(p.d)), neg(static_cast<const A*>(p.neg)),
        rho(static_cast<const A*>(p.rho)), kap(static_cast<const A*>(p.kap)), kneg(static_cast<const A*>(p.kneg)),
        Bq(p.Bq), Bd(p.Bd), N(neg ? p.N : 0), H(p.H), K(p.K), it((A)p.inv_temp), cols(p.col_weight != 0.0),
        dpan((size_t)(Bd * H)), npan((size_t)(N * H)), nIB(ceil_div(Bq, IT)), nJB(ceil_div(Bd, JT)),
        nNB(ceil_div(N, JT)) {
    pack_panels(d, p.ldd, Bd, H, dpan.data());
    if (N) pack_panels(neg, p.ldn, N, H, npan.data());
  }
  void fwd();
  void bwd();

 private:
  // G (mi x nj, ld JT) += q[i0 + r, a:b] . panel rows a..b (panel: H x nj, packed)
  void seg_acc(int64_t i0, int64_t mi, const A* panel, int64_t nj, int64_t a, int64_t b, A* G) const {
    gemm::acc_nn(mi, nj, b - a, q + i0 * p.ldq + a, p.ldq, 1, panel + a * nj, nj, G, JT, A(1));
  }
  // Z = inv_temp * G * rho_r * kc_j
  void scale(const A* G, int64_t mi, int64_t nj, const A* rr, const A* kc, A* Z) const {
    for (int64_t r = 0; r < mi; ++r) {
      const A f = it * rr[r];
      const A* g = G + r * JT;
      A* z = Z + r * JT;
#pragma omp simd
      for (int64_t j = 0; j < nj; ++j) z[j] = g[j] * f * kc[j];
    }
  }
  int64_t col_of(int64_t i) const { return i + p.diag_offset; }
  int64_t row_of(int64_t j) const { return j - p.diag_offset; }

  const MatryoshkaParams& p;
  const A *q, *d, *neg, *rho, *kap, *kneg;
  const int64_t Bq, Bd, N, H, K;
  const A it;
  const bool cols;
  std::vector<A> dpan, npan;
  const int64_t nIB, nJB, nNB;
};

template <typename A>
void Pass<A>::fwd() {
  const A ninf = -std::numeric_limits<A>::infinity();
  const A nan = std::numeric_limits<A>::quiet_NaN();
  const size_t nc = cols ? (size_t)(K * Bd) : 0;
  std::vector<A> cm(nc, ninf), cs(nc, A(0)), cpm(nc, ninf), cps(nc, A(0)), cdiag(nc, nan);
  std::vector<int64_t> ccnt(nc, 0);
  Locks locks(nJB);
  A* rs = static_cast<A*>(p.row_stats);
  const std::vector<int64_t>& seg = p.seg;

#pragma omp parallel
  {
    std::vector<A> G(IT * JT), Z(IT * JT), e(JT);
    std::vector<A> rm(K * IT), rsum(K * IT), rpm(K * IT), rps(K * IT), rdiag(K * IT);
    std::vector<int64_t> rcnt(K * IT);
    std::vector<A> tm(K * JT), ts(K * JT), tpm(K * JT), tps(K * JT), tdg(K * JT);
    std::vector<int64_t> tc(K * JT);
#pragma omp for schedule(dynamic, 1)
    for (int64_t ib = 0; ib < nIB; ++ib) {
      const int64_t i0 = ib * IT, mi = std::min(IT, Bq - i0);
      std::fill(rm.begin(), rm.end(), ninf);
      std::fill(rsum.begin(), rsum.end(), A(0));
      std::fill(rpm.begin(), rpm.end(), ninf);
      std::fill(rps.begin(), rps.end(), A(0));
      std::fill(rdiag.begin(), rdiag.end(), nan);
      std::fill(rcnt.begin(), rcnt.end(), 0);
      const int64_t jstart = stagger(ib, nJB);
      for (int64_t t = 0; t < nJB; ++t) {
        const int64_t jb = (jstart + t) % nJB, j0 = jb * JT, nj = std::min(JT, Bd - j0);
        for (int64_t r = 0; r < mi; ++r) std::fill(G.data() + r * JT, G.data() + r * JT + nj, A(0));
        if (cols) {
          std::fill(tm.begin(), tm.end(), ninf);
          std::fill(tpm.begin(), tpm.end(), ninf);
          std::fill(ts.begin(), ts.end(), A(0));
          std::fill(tps.begin(), tps.end(), A(0));
          std::fill(tdg.begin(), tdg.end(), nan);
          std::fill(tc.begin(), tc.end(), 0);
        }
        for (int64_t l = 0; l < K; ++l) {
          seg_acc(i0, mi, dpan.data() + j0 * H, nj, seg[l], seg[l + 1], G.data());
          scale(G.data(), mi, nj, rho + l * Bq + i0, kap + l * Bd + j0, Z.data());
          for (int64_t r = 0; r < mi; ++r) {
            const int64_t i = i0 + r, x = l * IT + r;
            const A* z = Z.data() + r * JT;
            row_update(z, nj, rm[x], rsum[x], e.data());
            pos_update(z, nj, p.q_lo[i], p.q_hi[i], p.d_lo + j0, p.d_hi + j0, rpm[x], rps[x], rcnt[x]);
            const int64_t jd = col_of(i);
            if (jd >= j0 && jd < j0 + nj) rdiag[x] = z[jd - j0];
          }
          if (!cols) continue;
          A* m1 = tm.data() + l * JT;
          A* s1 = ts.data() + l * JT;
          A* m2 = tpm.data() + l * JT;
          A* s2 = tps.data() + l * JT;
          int64_t* c2 = tc.data() + l * JT;
          for (int64_t r = 0; r < mi; ++r) {
            const A* z = Z.data() + r * JT;
#pragma omp simd
            for (int64_t j = 0; j < nj; ++j) m1[j] = std::max(m1[j], z[j]);
            const int64_t lo = p.q_lo[i0 + r], hi = p.q_hi[i0 + r];
            for (int64_t j = 0; j < nj; ++j)
              if (overlap(lo, hi, p.d_lo[j0 + j], p.d_hi[j0 + j])) { m2[j] = std::max(m2[j], z[j]); ++c2[j]; }
          }
          for (int64_t r = 0; r < mi; ++r) {
            const A* z = Z.data() + r * JT;
            for (int64_t j = 0; j < nj; ++j) e[j] = z[j] - m1[j];
            vexp_inplace(e.data(), nj);
#pragma omp simd
            for (int64_t j = 0; j < nj; ++j) s1[j] += e[j];
            const int64_t lo = p.q_lo[i0 + r], hi = p.q_hi[i0 + r];
            for (int64_t j = 0; j < nj; ++j)
              if (overlap(lo, hi, p.d_lo[j0 + j], p.d_hi[j0 + j])) s2[j] += mexp(z[j] - m2[j]);
          }
          for (int64_t j = 0; j < nj; ++j) {
            const int64_t id = row_of(j0 + j);
            if (id >= i0 && id < i0 + mi) tdg[l * JT + j] = Z[(id - i0) * JT + j];
          }
        }
        if (cols) {
          locks.lock(jb);
          for (int64_t l = 0; l < K; ++l)
            for (int64_t j = 0; j < nj; ++j) {
              const size_t g = (size_t)(l * Bd + j0 + j), x = (size_t)(l * JT + j);
              lse_merge(cm[g], cs[g], tm[x], ts[x]);
              lse_merge(cpm[g], cps[g], tpm[x], tps[x]);
              ccnt[g] += tc[x];
              if (row_of(j0 + j) >= i0 && row_of(j0 + j) < i0 + mi) cdiag[g] = tdg[x];
            }
          locks.unlock(jb);
        }
      }
      for (int64_t nb = 0; nb < nNB; ++nb) {
        const int64_t k0 = nb * JT, nk = std::min(JT, N - k0);
        for (int64_t r = 0; r < mi; ++r) std::fill(G.data() + r * JT, G.data() + r * JT + nk, A(0));
        for (int64_t l = 0; l < K; ++l) {
          seg_acc(i0, mi, npan.data() + k0 * H, nk, seg[l], seg[l + 1], G.data());
          scale(G.data(), mi, nk, rho + l * Bq + i0, kneg + l * N + k0, Z.data());
          for (int64_t r = 0; r < mi; ++r) row_update(Z.data() + r * JT, nk, rm[l * IT + r], rsum[l * IT + r], e.data());
        }
      }
      for (int64_t l = 0; l < K; ++l)
        for (int64_t r = 0; r < mi; ++r) {
          const int64_t i = i0 + r, x = l * IT + r;
          A* st = rs + l * 3 * Bq;
          st[i] = rm[x] + std::log(rsum[x]);
          const bool fb = rcnt[x] == 0;
          st[Bq + i] = fb ? rdiag[x] : rpm[x] + std::log(rps[x]);
          st[2 * Bq + i] = fb ? A(1) : A(0);
        }
    }
  }

  A* cst = static_cast<A*>(p.col_stats);
  A* lv = static_cast<A*>(p.levels);
  double loss = 0.0;
  for (int64_t l = 0; l < K; ++l) {
    const A* st = rs + l * 3 * Bq;
    double lr = 0.0, lc = 0.0;
    for (int64_t i = 0; i < Bq; ++i) lr += (double)st[i] - (double)st[Bq + i];
    if (cols) {
      A* ct = cst + l * 3 * Bd;
      for (int64_t j = 0; j < Bd; ++j) {
        const size_t g = (size_t)(l * Bd + j);
        ct[j] = cm[g] + std::log(cs[g]);
        const int64_t id = row_of(j);
        const bool rfb = id >= 0 && id < Bq && (p.row_none ? p.row_none[id] != 0 : st[2 * Bq + id] != A(0));
        const bool fb = ccnt[g] == 0;
        A lpos = fb ? cdiag[g] : cpm[g] + std::log(cps[g]);
        if (!fb && rfb) {
          const A hi = std::max(lpos, cdiag[g]), lo = std::min(lpos, cdiag[g]);
          lpos = hi + std::log1p(std::exp(lo - hi));
        }
        ct[Bd + j] = lpos;
        ct[2 * Bd + j] = (fb || rfb) ? A(1) : A(0);
        lc += (double)ct[j] - (double)ct[Bd + j];
      }
    }
    double level = 0.0;
    if (p.row_weight != 0.0 && Bq) level += p.row_weight * lr / (double)Bq;
    if (cols && Bd) level += p.col_weight * lc / (double)Bd;
    lv[l] = (A)level;
    if (p.coef[l] != 0.0) loss += p.coef[l] * level;
  }
  *static_cast<A*>(p.loss) = (A)loss;
}

template <typename A>
void Pass<A>::bwd() {
  const A* rs = static_cast<const A*>(p.row_stats);
  const A* cst = static_cast<const A*>(p.col_stats);
  A* dq = static_cast<A*>(p.dq);
  A* dd = static_cast<A*>(p.dd);
  A* dneg = static_cast<A*>(p.dneg);
  A* drho = static_cast<A*>(p.drho);
  A* dkap = static_cast<A*>(p.dkap);
  A* dkneg = static_cast<A*>(p.dkneg);
  const std::vector<int64_t>& seg = p.seg;
  std::vector<A> rw(K), cw(K);
  std::vector<char> nz(K);
  for (int64_t l = 0; l < K; ++l) {
    rw[l] = Bq ? (A)(p.coef[l] * p.row_weight / (double)Bq) : A(0);
    cw[l] = (cols && Bd) ? (A)(p.coef[l] * p.col_weight / (double)Bd) : A(0);
    nz[l] = rw[l] != A(0) || cw[l] != A(0);
  }
  bool any = false;
  for (int64_t l = 0; l < K; ++l) any = any || nz[l];
  if (!any) return;
  const bool rows_on = p.row_weight != 0.0;
  Locks jlocks(nJB), nlocks(nNB);
  // column sums of g * z (-> dkap, dkneg), merged under the panel locks
  std::vector<A> csum((size_t)(K * Bd), A(0)), nsum((size_t)(K * N), A(0));

#pragma omp parallel
  {
    std::vector<A> G(IT * JT), Hs(K * IT * JT), ea(JT), ca(JT), ddl(JT * H), usum(K * IT), tcol(K * JT);
    std::vector<char> act(K);
    // h tiles of the active levels -> suffix sums over levels (in place); act[l]: H_l is nonzero
    auto suffix = [&](int64_t mi, int64_t nj) {
      bool have = false;
      for (int64_t l = K - 1; l >= 0; --l) {
        A* h = Hs.data() + l * IT * JT;
        if (have) {
          const A* h1 = h + IT * JT;
          for (int64_t r = 0; r < mi; ++r) {
            if (nz[l]) {
#pragma omp simd
              for (int64_t j = 0; j < nj; ++j) h[r * JT + j] += h1[r * JT + j];
            } else {
              std::copy(h1 + r * JT, h1 + r * JT + nj, h + r * JT);
            }
          }
        }
        have = have || nz[l];
        act[l] = have;
      }
    };
#pragma omp for schedule(dynamic, 1)
    for (int64_t ib = 0; ib < nIB; ++ib) {
      const int64_t i0 = ib * IT, mi = std::min(IT, Bq - i0);
      std::fill(usum.begin(), usum.end(), A(0));
      const int64_t jstart = stagger(ib, nJB);
      for (int64_t t = 0; t < nJB; ++t) {
        const int64_t jb = (jstart + t) % nJB, j0 = jb * JT, nj = std::min(JT, Bd - j0);
        for (int64_t r = 0; r < mi; ++r) std::fill(G.data() + r * JT, G.data() + r * JT + nj, A(0));
        std::fill(tcol.begin(), tcol.end(), A(0));
        for (int64_t l = 0; l < K; ++l) {
          seg_acc(i0, mi, dpan.data() + j0 * H, nj, seg[l], seg[l + 1], G.data());
          if (!nz[l]) continue;
          A* h = Hs.data() + l * IT * JT;
          const A* kc = kap + l * Bd + j0;
          scale(G.data(), mi, nj, rho + l * Bq + i0, kc, h);
          const A* st = rs + l * 3 * Bq;
          const A* ct = cols ? cst + l * 3 * Bd : nullptr;
          A* tcl = tcol.data() + l * JT;
          const A rwl = rw[l], cwl = cw[l];
          for (int64_t r = 0; r < mi; ++r) {
            const int64_t i = i0 + r;
            A* z = h + r * JT;
            const A lse = st[i], lsep = st[Bq + i];
            const bool fb = st[2 * Bq + i] != A(0);
            const int64_t jd = col_of(i);
            const int64_t qlo = p.q_lo[i], qhi = p.q_hi[i];
            if (rows_on) {
              for (int64_t j = 0; j < nj; ++j) ea[j] = z[j] - lse;
              vexp_inplace(ea.data(), nj);
            } else {
              std::fill(ea.begin(), ea.begin() + nj, A(0));
            }
            if (ct) {
              for (int64_t j = 0; j < nj; ++j) ca[j] = z[j] - ct[j0 + j];
              vexp_inplace(ca.data(), nj);
            }
            for (int64_t j = 0; j < nj; ++j) {
              const int64_t jj = j0 + j;
              const bool pos = overlap(qlo, qhi, p.d_lo[jj], p.d_hi[jj]);
              const bool dg = jj == jd;
              A g = rwl * ea[j];
              if (rows_on && (pos || (fb && dg))) g -= rwl * mexp(z[j] - lsep);
              if (ct) {
                g += cwl * ca[j];
                if (pos || (dg && ct[2 * Bd + jj] != A(0))) g -= cwl * mexp(z[j] - ct[Bd + jj]);
              }
              ea[j] = g;
            }
            const A f = it * rho[l * Bq + i];
            A su = 0;
#pragma omp simd reduction(+ : su)
            for (int64_t j = 0; j < nj; ++j) {
              const A u = ea[j] * z[j];
              su += u;
              tcl[j] += u;
              z[j] = ea[j] * f * kc[j];
            }
            usum[l * IT + r] += su;
          }
        }
        suffix(mi, nj);
        for (int64_t l = 0; l < K; ++l)
          if (act[l])
            gemm::acc_nn(mi, seg[l + 1] - seg[l], nj, Hs.data() + l * IT * JT, JT, 1, d + j0 * p.ldd + seg[l], p.ldd,
                         dq + i0 * H + seg[l], H, A(1));
        A* ddj = dd + j0 * H;
        const bool direct = jlocks.try_lock(jb);
        A* dst = direct ? ddj : ddl.data();
        if (!direct) std::fill(ddl.begin(), ddl.begin() + nj * H, A(0));
        for (int64_t l = 0; l < K; ++l)
          if (act[l])
            gemm::acc_nn(nj, seg[l + 1] - seg[l], mi, Hs.data() + l * IT * JT, 1, JT, q + i0 * p.ldq + seg[l], p.ldq,
                         dst + seg[l], H, A(1));
        if (!direct) {
          jlocks.lock(jb);
          for (int64_t x = 0; x < nj * H; ++x) ddj[x] += ddl[x];
        }
        for (int64_t l = 0; l < K; ++l)
          if (nz[l])
            for (int64_t j = 0; j < nj; ++j) csum[l * Bd + j0 + j] += tcol[l * JT + j];
        jlocks.unlock(jb);
      }
      for (int64_t nb = 0; rows_on && nb < nNB; ++nb) {
        const int64_t k0 = nb * JT, nk = std::min(JT, N - k0);
        for (int64_t r = 0; r < mi; ++r) std::fill(G.data() + r * JT, G.data() + r * JT + nk, A(0));
        std::fill(tcol.begin(), tcol.end(), A(0));
        for (int64_t l = 0; l < K; ++l) {
          seg_acc(i0, mi, npan.data() + k0 * H, nk, seg[l], seg[l + 1], G.data());
          if (!nz[l]) continue;
          A* h = Hs.data() + l * IT * JT;
          const A* kc = kneg + l * N + k0;
          scale(G.data(), mi, nk, rho + l * Bq + i0, kc, h);
          const A* st = rs + l * 3 * Bq;
          A* tcl = tcol.data() + l * JT;
          for (int64_t r = 0; r < mi; ++r) {
            const int64_t i = i0 + r;
            A* z = h + r * JT;
            for (int64_t j = 0; j < nk; ++j) ea[j] = z[j] - st[i];
            vexp_inplace(ea.data(), nk);
            const A f = it * rho[l * Bq + i], rwl = rw[l];
            A su = 0;
#pragma omp simd reduction(+ : su)
            for (int64_t j = 0; j < nk; ++j) {
              const A g = rwl * ea[j];
              const A u = g * z[j];
              su += u;
              tcl[j] += u;
              z[j] = g * f * kc[j];
            }
            usum[l * IT + r] += su;
          }
        }
        suffix(mi, nk);
        std::fill(ddl.begin(), ddl.begin() + nk * H, A(0));
        for (int64_t l = 0; l < K; ++l)
          if (act[l]) {
            const A* hl = Hs.data() + l * IT * JT;
            const int64_t a = seg[l], w = seg[l + 1] - seg[l];
            gemm::acc_nn(mi, w, nk, hl, JT, 1, neg + k0 * p.ldn + a, p.ldn, dq + i0 * H + a, H, A(1));
            gemm::acc_nn(nk, w, mi, hl, 1, JT, q + i0 * p.ldq + a, p.ldq, ddl.data() + a, H, A(1));
          }
        nlocks.lock(nb);
        A* dn = dneg + k0 * H;
        for (int64_t x = 0; x < nk * H; ++x) dn[x] += ddl[x];
        for (int64_t l = 0; l < K; ++l)
          if (nz[l])
            for (int64_t j = 0; j < nk; ++j) nsum[l * N + k0 + j] += tcol[l * JT + j];
        nlocks.unlock(nb);
      }
      for (int64_t l = 0; l < K; ++l)
        for (int64_t r = 0; r < mi; ++r) drho[l * Bq + i0 + r] = usum[l * IT + r] / rho[l * Bq + i0 + r];
    }
  }
  for (int64_t x = 0; x < K * Bd; ++x) dkap[x] = csum[x] / kap[x];
  for (int64_t x = 0; x < K * N; ++x) dkneg[x] = nsum[x] / kneg[x];
}

}  // namespace

void matryoshka_infonce_fwd_cpu(const MatryoshkaParams& p) {
  if (p.dtype == DType::F32) Pass<float>(p).fwd();
  else if (p.dtype == DType::F64) Pass<double>(p).fwd();
  else fail("matryoshka_infonce CPU kernels take float32 or float64 (the wrapper upcasts halves)");
}

void matryoshka_infonce_bwd_cpu(const MatryoshkaParams& p) {
  if (p.dtype == DType::F32) Pass<float>(p).bwd();
  else if (p.dtype == DType::F64) Pass<double>(p).bwd();
  else fail("matryoshka_infonce CPU kernels take float32 or float64 (the wrapper upcasts halves)");
}

}  // namespace tk
