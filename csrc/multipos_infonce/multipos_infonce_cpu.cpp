// CPU kernels for the fused multi-positive InfoNCE: OpenMP over row blocks of up to IT queries, each walking
// all JT-wide document panels (staggered start so threads rarely meet on a column lock). Forward keeps
// online log-sum-exp per row (thread-owned) and per column (merged under a per-panel lock); backward
// recomputes each score tile, turns it into dL/ds in place and feeds the two gradient products.
// Scratch is O(IT * JT + JT * H) per thread plus one transposed copy of d (and extra_neg).
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>
#include "common/cpu_gemm.h"
#include "multipos_infonce/multipos_infonce.h"
#include "multipos_infonce/multipos_math.h"

namespace tk {
namespace {

constexpr int64_t IT = 256;  // most query rows per task (scratch size); a call uses rows_per_task() <= IT

inline int64_t ceil_div(int64_t a, int64_t b);
// Query rows per task: as many as IT (each document panel, read from L3 for large Bd, then feeds IT rows
// of products; measured single core, B = 4,096, H = 384: backward 0.39 s with 64 rows, 0.30 s with 256),
// fewer when that would leave under 4 tasks per thread (at least 64), then evened out so that the task
// count is a multiple of the thread count.
inline int64_t rows_per_task(int64_t Bq) {
  const int64_t nth = std::max(omp_get_max_threads(), 1);
  const int64_t per = ceil_div(std::max<int64_t>(Bq, 1), 4 * nth);
  const int64_t r = std::min<int64_t>(IT, std::max<int64_t>(64, ceil_div(per, 16) * 16));
  // then as many tasks as a multiple of the thread count, equal sizes (an even OpenMP split), unless that
  // would cut blocks below 64 rows (small batches stay one task per 64 rows, as before: a single task
  // also keeps tiny float64 problems bit-reproducible for gradcheck)
  const int64_t n = ceil_div(ceil_div(std::max<int64_t>(Bq, 1), r), nth) * nth;
  const int64_t re = ceil_div(std::max<int64_t>(Bq, 1), n);
  return re >= 64 ? re : r;
}
constexpr int64_t JT = 96;  // document columns per tile
static_assert(JT <= mp::kTile, "tile rows must fit the batched-exp scratch");

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

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// First column panel of a row-block task: threads start evenly spread over the panels and, moving at
// similar speeds, stay apart, so the per-panel locks are rarely contended.
inline int64_t stagger(int64_t ib, int64_t nJB) {
  const int64_t nth = omp_get_num_threads(), tid = omp_get_thread_num();
  return (tid * nJB / std::max<int64_t>(nth, 1) + ib) % std::max<int64_t>(nJB, 1);
}

// Panel b of X (rows [b*JT, b*JT + w)) transposed to (H x w), stored at out + b*JT*H.
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
struct Bias {
  bool on = false;
  int64_t hidden = 0, K2 = 0, Bd = 0, ncell = 0;
  const A *Am = nullptr, *Ct = nullptr, *b1 = nullptr, *w2 = nullptr, *zc = nullptr, *uq = nullptr, *ud = nullptr;
  const double *zlo = nullptr, *zhi = nullptr;
  A b2 = 0, scale = 0, yc[2] = {0, 0};

  explicit Bias(const MultiposParams& p) {
    on = p.has_bias;
    if (!on) return;
    hidden = p.hidden; K2 = p.K2; Bd = p.Bd;
    Am = static_cast<const A*>(p.A); Ct = static_cast<const A*>(p.Ct);
    b1 = static_cast<const A*>(p.b1); w2 = static_cast<const A*>(p.w2); zc = static_cast<const A*>(p.zc);
    uq = static_cast<const A*>(p.u_q); ud = static_cast<const A*>(p.u_d);
    b2 = *static_cast<const A*>(p.b2); scale = *static_cast<const A*>(p.scale);
    zlo = p.z_lo; zhi = p.z_hi; ncell = p.ncell;
    for (int s = 0; s < 2; ++s) {
      A y = 0;
      for (int64_t n = 0; n < hidden; ++n) y += w2[n] * std::max(zc[s * hidden + n], A(0));
      yc[s] = y;
    }
  }

  // Columns [j0, j0 + nj) of Ct copied to a (K2 x nj, ld JT) panel: Ct's row stride is Bd, often a
  // multiple of 4 KiB, which would put all K2 rows in one L1 set.
  // cp (optional) gets the same panel transposed (nj x K2), the B operand of dA += dz . C_J.
  void pack(int64_t j0, int64_t nj, A* ctp, A* cp = nullptr) const {
    for (int64_t m = 0; m < K2; ++m) std::copy(Ct + m * Bd + j0, Ct + m * Bd + j0 + nj, ctp + m * JT);
    if (cp) gemm::transpose_pack(K2, nj, ctp, JT, cp, K2);
  }
};

template <typename A>
inline void minmax(const A* x, int64_t n, double& lo, double& hi) {
  lo = std::numeric_limits<double>::infinity();
  hi = -lo;
  for (int64_t k = 0; k < n; ++k) { lo = std::min(lo, (double)x[k]); hi = std::max(hi, (double)x[k]); }
}

// The bias's hidden units as one tile (rows I x columns J) sees them. Over the tile's delta range,
// units proven always on (z > 0 for every delta there) are summed into one linear unit (compact unit 0
// when there is any), units proven always off are skipped, the rest stay ReLU units. Exact: relu is
// the identity or zero on the proven units. With rows and columns sorted by u (the wrapper does that),
// a tile spans a narrow delta range and nearly every unit is proven one way or the other.
template <typename A>
struct TileUnits {
  int64_t nu = 0;        // compact units
  bool lin = false;      // compact unit 0 is the linear sum of the on units
  std::vector<int64_t> onu, mix;  // original ids: on units, ReLU units (compact 0/1 + m)
  std::vector<A> At, bt, wt;      // (IT, nu, K2) compact row weights, (nu) b1 and w2

  explicit TileUnits(const Bias<A>& b) : At(b.on ? IT * b.hidden * b.K2 : 0), bt(b.hidden), wt(b.hidden) {
    onu.reserve(b.hidden);
    mix.reserve(b.hidden);
  }

  // Plan for rows [i0, i0 + mi) against columns whose u lies in [udlo, udhi].
  void plan(const Bias<A>& b, int64_t i0, int64_t mi, double udlo, double udhi) {
    double uqlo, uqhi;
    minmax(b.uq + i0, mi, uqlo, uqhi);
    const double a = udlo - uqhi, c = udhi - uqlo;
    onu.clear();
    mix.clear();
    if (a > 1.0 || c < -1.0) { nu = 0; lin = false; return; }  // every pair clamped: only the constants
    const int64_t last = b.ncell - 1;
    const auto cell = [&](double x) {
      return std::min<int64_t>(last, std::max<int64_t>(0, (int64_t)std::floor((x + 1.0) * 0.5 * (double)b.ncell)));
    };
    const int64_t ca = cell(std::max(a, -1.0) - 1e-9), cb = cell(std::min(c, 1.0) + 1e-9);
    for (int64_t n = 0; n < b.hidden; ++n) {
      if (!b.zlo) { mix.push_back(n); continue; }
      const double* lo = b.zlo + n * b.ncell;
      const double* hi = b.zhi + n * b.ncell;
      double mn = lo[ca], mx = hi[ca];
      for (int64_t k = ca + 1; k <= cb; ++k) { mn = std::min(mn, lo[k]); mx = std::max(mx, hi[k]); }
      if (mn > 0.0) onu.push_back(n);
      else if (!(mx < 0.0)) mix.push_back(n);
    }
    lin = !onu.empty();
    nu = (int64_t)lin + (int64_t)mix.size();
    int64_t u = 0;
    if (lin) {
      A s = 0;
      for (int64_t n : onu) s += b.w2[n] * b.b1[n];
      bt[0] = s;
      wt[0] = A(1);
      u = 1;
    }
    for (int64_t n : mix) { bt[u] = b.b1[n]; wt[u] = b.w2[n]; ++u; }
    for (int64_t r = 0; r < mi; ++r) {
      const A* src = b.Am + (i0 + r) * b.hidden * b.K2;
      A* dst = At.data() + r * nu * b.K2;
      if (lin) {
        std::fill(dst, dst + b.K2, A(0));
        for (int64_t n : onu) {
          const A w = b.w2[n];
          const A* x = src + n * b.K2;
          for (int64_t k = 0; k < b.K2; ++k) dst[k] += w * x[k];
        }
      }
      for (size_t m = 0; m < mix.size(); ++m) std::copy(src + mix[m] * b.K2, src + (mix[m] + 1) * b.K2, dst + (lin + m) * b.K2);
    }
  }

  // Tile row r (query i) against columns [j0, j0 + nj): z (nu x nj, ld JT) compact pre-activations,
  // y = sum_u wt_u z_u (linear unit) or wt_u relu(z_u), cl = 0 inside the clamp, 1 for delta > 1, 2 for delta < -1; adds
  // scale * (y + b2) to srow. Returns the number of clamped columns.
  int64_t row(const Bias<A>& b, int64_t r, int64_t i, int64_t j0, int64_t nj, const A* ctp, A* z, A* y,
              uint8_t* cl, A* srow) const {
    std::fill(y, y + nj, A(0));
    if (nu) {
      for (int64_t u = 0; u < nu; ++u) std::fill(z + u * JT, z + u * JT + nj, bt[u]);
      gemm::acc_nn(nu, nj, b.K2, At.data() + r * nu * b.K2, b.K2, 1, ctp, JT, z, JT, A(1));
      for (int64_t u = 0; u < nu; ++u) {
        const A w = wt[u];
        const A* zr = z + u * JT;
        if (lin && u == 0)
          for (int64_t j = 0; j < nj; ++j) y[j] += w * zr[j];
        else
          for (int64_t j = 0; j < nj; ++j) y[j] += w * std::max(zr[j], A(0));
      }
    }
    const A uqi = b.uq[i];
    int64_t nclamp = 0;
#pragma omp simd reduction(+ : nclamp)
    for (int64_t j = 0; j < nj; ++j) {
      const A diff = b.ud[j0 + j] - uqi;
      const uint8_t c = diff > A(1) ? 1 : (diff < A(-1) ? 2 : 0);
      cl[j] = c;
      nclamp += c != 0;
      y[j] = c ? b.yc[c == 1 ? 0 : 1] : y[j];
      srow[j] += b.scale * (y[j] + b.b2);
    }
    return nclamp;
  }
};

// Per column panel: the range of u_d over its columns (the tile plans' column side).
template <typename A>
std::vector<double> panel_u_ranges(const Bias<A>& b, int64_t Bd) {
  const int64_t nJB = ceil_div(Bd, JT);
  std::vector<double> out(b.on ? 2 * nJB : 0);
  if (b.on)
    for (int64_t jb = 0; jb < nJB; ++jb) minmax(b.ud + jb * JT, std::min(JT, Bd - jb * JT), out[2 * jb], out[2 * jb + 1]);
  return out;
}

// Hardest negative of one row within one tile: over columns j0 + j that do not overlap the row and are not
// its diagonal partner jd (added at the end of the row when the row turns out to have overlaps), the largest
// x and, among exact ties, the lowest caller index map(j). (bv, bm) is the running best, bm = INT64_MAX none.
template <typename A>
inline void hard_update(const A* srow, int64_t nj, int64_t j0, int64_t jd, int64_t qlo, int64_t qhi,
                        const int64_t* dlo, const int64_t* dhi, const int64_t* col_map, A& bv, int64_t& bm) {
  A mx = -std::numeric_limits<A>::infinity();
  bool any = false;
  for (int64_t j = 0; j < nj; ++j) {
    const bool neg = !(std::max(qlo, dlo[j]) <= std::min(qhi, dhi[j])) && j0 + j != jd;
    if (neg && (!any || srow[j] > mx)) { mx = srow[j]; any = true; }
  }
  if (!any || mx < bv || mx != mx) return;
  int64_t m = std::numeric_limits<int64_t>::max();
  for (int64_t j = 0; j < nj; ++j) {
    const bool neg = !(std::max(qlo, dlo[j]) <= std::min(qhi, dhi[j])) && j0 + j != jd;
    if (neg && srow[j] == mx) m = std::min(m, col_map ? col_map[j0 + j] : j0 + j);
  }
  if (mx > bv || m < bm) { bv = mx; bm = m; }
}

// hard_update for a row segment with no positive and not holding the diagonal partner: every column is a
// negative; mx = the segment's max (NaN-free rows only reach the index search).
template <typename A>
inline void hard_update_all(const A* srow, int64_t nj, int64_t j0, A mx, const int64_t* col_map, A& bv, int64_t& bm) {
  if (nj <= 0 || mx < bv || mx != mx) return;
  int64_t m = std::numeric_limits<int64_t>::max();
  for (int64_t j = 0; j < nj; ++j)
    if (srow[j] == mx) m = std::min(m, col_map ? col_map[j0 + j] : j0 + j);
  if (mx > bv || m < bm) { bv = mx; bm = m; }
}

// Row i's fallback column and column j's fallback row: explicit arrays (rows/columns permuted by the
// wrapper) or the diagonal offset.
struct Diag {
  const int64_t *col = nullptr, *row = nullptr;
  int64_t off = 0;
  explicit Diag(const MultiposParams& p) : col(p.diag_col), row(p.diag_row), off(p.diag_offset) {}
  int64_t col_of(int64_t i) const { return col ? col[i] : i + off; }
  int64_t row_of(int64_t j) const { return row ? row[j] : j - off; }
};

// What forward and backward share: the inputs, the bias, the diagonal partners and the transposed
// document (and extra-negative) panels, packed once per pass.
template <typename A>
class Pass {
 public:
  explicit Pass(const MultiposParams& params)
      : p(params), q(static_cast<const A*>(p.q)), d(static_cast<const A*>(p.d)), neg(static_cast<const A*>(p.neg)),
        Bq(p.Bq), Bd(p.Bd), N(neg ? p.N : 0), H(p.H), it((A)p.inv_temp), cols(p.col_weight != 0.0), bias(p),
        dg(p), pu(panel_u_ranges(bias, Bd)), dpan((size_t)(Bd * H)), npan((size_t)(N * H)),
        itr(rows_per_task(Bq)), nIB(ceil_div(Bq, itr)), nJB(ceil_div(Bd, JT)), nNB(ceil_div(N, JT)) {
    pack_panels(d, p.ldd, Bd, H, dpan.data());
    if (N) pack_panels(neg, p.ldn, N, H, npan.data());
  }
  void fwd();
  void bwd();

  // S (mi x nj, row stride JT) = inv_temp * q[i0, i0 + mi) . panel (H x nj, a packed panel)
  void score_tile(int64_t i0, int64_t mi, const A* panel, int64_t nj, A* S) const {
    for (int64_t r = 0; r < mi; ++r) std::fill(S + r * JT, S + r * JT + nj, A(0));
    gemm::acc_nn(mi, nj, H, q + i0 * p.ldq, p.ldq, 1, panel, nj, S, JT, it);
  }

 private:
  const MultiposParams& p;
  const A *q, *d, *neg;
  const int64_t Bq, Bd, N, H;
  const A it;
  const bool cols;
  const Bias<A> bias;
  const Diag dg;
  const std::vector<double> pu;
  std::vector<A> dpan, npan;
  const int64_t itr, nIB, nJB, nNB;  // itr: query rows per task
};

template <typename A>
void Pass<A>::fwd() {
  const A ninf = -std::numeric_limits<A>::infinity();
  std::vector<A> cm(cols ? Bd : 0, ninf), cs(cols ? Bd : 0, A(0)), cpm(cols ? Bd : 0, ninf), cps(cols ? Bd : 0, A(0));
  std::vector<A> cdiag(cols ? Bd : 0, std::numeric_limits<A>::quiet_NaN());
  std::vector<int64_t> ccnt(cols ? Bd : 0, 0);
  Locks locks(nJB);
  A* rs = static_cast<A*>(p.row_stats);

#pragma omp parallel
  {
    std::vector<A> S(IT * JT), z(bias.on ? bias.hidden * JT : 0), y(JT), ctp(bias.on ? bias.K2 * JT : 0);
    std::vector<uint8_t> cl(JT);
    std::vector<A> rm(IT), rsum(IT), rpm(IT), rps(IT), rdiag(IT);
    std::vector<int64_t> rcnt(IT);
    const bool hard = p.hardest != nullptr;
    std::vector<A> hv(hard ? IT : 0);
    std::vector<int64_t> hm(hard ? IT : 0);
    std::vector<A> tm(JT), ts(JT), tpm(JT), tps(JT);
    std::vector<int64_t> tc(JT);
    TileUnits<A> tu(bias);
#pragma omp for schedule(dynamic, 1)
    for (int64_t ib = 0; ib < nIB; ++ib) {
      const int64_t i0 = ib * itr, mi = std::min(itr, Bq - i0);
      std::fill(rm.begin(), rm.end(), ninf);
      std::fill(rsum.begin(), rsum.end(), A(0));
      std::fill(rpm.begin(), rpm.end(), ninf);
      std::fill(rps.begin(), rps.end(), A(0));
      std::fill(rdiag.begin(), rdiag.end(), std::numeric_limits<A>::quiet_NaN());
      std::fill(rcnt.begin(), rcnt.end(), 0);
      std::fill(hv.begin(), hv.end(), ninf);
      std::fill(hm.begin(), hm.end(), std::numeric_limits<int64_t>::max());
      const int64_t jstart = stagger(ib, nJB);
      for (int64_t t = 0; t < nJB; ++t) {
        const int64_t jb = (jstart + t) % nJB, j0 = jb * JT, nj = std::min(JT, Bd - j0);
        score_tile(i0, mi, dpan.data() + j0 * H, nj, S.data());
        if (bias.on) {
          tu.plan(bias, i0, mi, pu[2 * jb], pu[2 * jb + 1]);
          if (tu.nu) bias.pack(j0, nj, ctp.data());
          for (int64_t r = 0; r < mi; ++r)
            tu.row(bias, r, i0 + r, j0, nj, ctp.data(), z.data(), y.data(), cl.data(), S.data() + r * JT);
        }
        int64_t tile_pos = 0;
        for (int64_t r = 0; r < mi; ++r) {
          const int64_t i = i0 + r;
          const A* srow = S.data() + r * JT;
          // positives are sparse: a row with none in this tile skips every span test below
          const int64_t npos = mp::count_pos(nj, p.q_lo[i], p.q_hi[i], p.d_lo + j0, p.d_hi + j0);
          tile_pos += npos;
          const A mx = mp::row_max(srow, nj);
          mp::row_update_max(srow, nj, mx, rm[r], rsum[r]);
          if (npos) mp::pos_row_update(srow, nj, p.q_lo[i], p.q_hi[i], p.d_lo + j0, p.d_hi + j0, rpm[r], rps[r], rcnt[r]);
          const int64_t jd = dg.col_of(i);
          const bool diag_in = jd >= j0 && jd < j0 + nj;
          if (diag_in) rdiag[r] = srow[jd - j0];
          if (!hard) continue;
          if (npos || diag_in) hard_update(srow, nj, j0, jd, p.q_lo[i], p.q_hi[i], p.d_lo + j0, p.d_hi + j0, p.col_map, hv[r], hm[r]);
          else hard_update_all(srow, nj, j0, mx, p.col_map, hv[r], hm[r]);
        }
        if (cols) {
          mp::col_tile_stats(S.data(), JT, mi, nj, p.q_lo + i0, p.q_hi + i0, p.d_lo + j0, p.d_hi + j0, tm.data(),
                             ts.data(), tpm.data(), tps.data(), tc.data(), tile_pos != 0);
          for (int64_t j = 0; j < nj; ++j) {
            const int64_t id = dg.row_of(j0 + j);
            if (id >= i0 && id < i0 + mi) cdiag[j0 + j] = S[(id - i0) * JT + j];
          }
          locks.lock(jb);
          for (int64_t j = 0; j < nj; ++j) {
            mp::lse_merge(cm[j0 + j], cs[j0 + j], tm[j], ts[j]);
            mp::lse_merge(cpm[j0 + j], cps[j0 + j], tpm[j], tps[j]);
            ccnt[j0 + j] += tc[j];
          }
          locks.unlock(jb);
        }
      }
      for (int64_t nb = 0; nb < nNB; ++nb) {
        const int64_t k0 = nb * JT, nk = std::min(JT, N - k0);
        score_tile(i0, mi, npan.data() + k0 * H, nk, S.data());
        for (int64_t r = 0; r < mi; ++r) mp::row_update(S.data() + r * JT, nk, rm[r], rsum[r]);
      }
      for (int64_t r = 0; r < mi; ++r) {
        const int64_t i = i0 + r;
        rs[i] = rm[r] + std::log(rsum[r]);
        // positives: the overlaps, else the diagonal partner alone; a row flagged in row_none (group-scoped
        // positives: every row) also has its partner as a positive next to overlaps that exclude it
        const bool alone = rcnt[r] == 0;
        const int64_t jd = dg.col_of(i);
        const bool jd_in = jd >= 0 && jd < Bd;
        const bool dov = jd_in && std::max(p.q_lo[i], p.d_lo[jd]) <= std::min(p.q_hi[i], p.d_hi[jd]);
        const bool rn = p.row_none && p.row_none[i] != 0;
        const bool fb = alone || (rn && jd_in);
        A lpos = alone ? rdiag[r] : rpm[r] + std::log(rps[r]);
        if (!alone && fb && !dov) {
          const A hi = std::max(lpos, rdiag[r]), lo = std::min(lpos, rdiag[r]);
          lpos = hi + std::log1p(std::exp(lo - hi));
        }
        rs[Bq + i] = lpos;
        rs[2 * Bq + i] = fb ? A(1) : A(0);
        if (hard) {
          // the diagonal partner is a negative when it is not a positive (overlap or fallback)
          if (!fb && jd_in && !dov) {
            const int64_t m = p.col_map ? p.col_map[jd] : jd;
            if (rdiag[r] > hv[r] || (rdiag[r] == hv[r] && m < hm[r])) { hv[r] = rdiag[r]; hm[r] = m; }
          }
          p.hardest[i] = hm[r] == std::numeric_limits<int64_t>::max() ? -1 : hm[r];
        }
      }
    }
  }

  A* cst = static_cast<A*>(p.col_stats);
  double lr = 0.0, lc = 0.0;
  for (int64_t i = 0; i < Bq; ++i) lr += (double)rs[i] - (double)rs[Bq + i];
  if (cols) {
    for (int64_t j = 0; j < Bd; ++j) {
      cst[j] = cm[j] + std::log(cs[j]);
      // ChunQiuTR's d->q positives: the row-fallback mask transposed (so the diagonal when its row had no
      // overlap), then the diagonal for columns still without a positive.
      const int64_t id = dg.row_of(j);
      const bool rfb = id >= 0 && id < Bq && (p.row_none ? p.row_none[id] != 0 : rs[2 * Bq + id] != A(0));
      const bool fb = ccnt[j] == 0;
      A lpos = fb ? cdiag[j] : cpm[j] + std::log(cps[j]);
      // overlaps plus the diagonal, unless the diagonal is one of them (group-scoped positives)
      const bool dov = rfb && std::max(p.q_lo[id], p.d_lo[j]) <= std::min(p.q_hi[id], p.d_hi[j]);
      if (!fb && rfb && !dov) {
        const A hi = std::max(lpos, cdiag[j]), lo = std::min(lpos, cdiag[j]);
        lpos = hi + std::log1p(std::exp(lo - hi));
      }
      cst[Bd + j] = lpos;
      cst[2 * Bd + j] = (fb || rfb) ? A(1) : A(0);
      lc += (double)cst[j] - (double)cst[Bd + j];
    }
  }
  double loss = 0.0;
  if (p.row_weight != 0.0 && Bq) loss += p.row_weight * lr / (double)Bq;
  if (cols && Bd) loss += p.col_weight * lc / (double)Bd;
  *static_cast<A*>(p.loss) = (A)loss;
}

template <typename A>
void Pass<A>::bwd() {
  const A gl = *static_cast<const A*>(p.grad_loss);
  const A rw = Bq ? (A)(p.row_weight / (double)Bq) * gl : A(0);
  const A cw = Bd ? (A)(p.col_weight / (double)Bd) * gl : A(0);
  const A* rs = static_cast<const A*>(p.row_stats);
  const A* cst = static_cast<const A*>(p.col_stats);
  A* dq = static_cast<A*>(p.dq);
  A* dd = static_cast<A*>(p.dd);
  A* dneg = static_cast<A*>(p.dneg);
  Locks jlocks(nJB), nlocks(nNB);
  const int64_t hid = bias.on ? bias.hidden : 0, K2 = bias.on ? bias.K2 : 0;
  A* dA = static_cast<A*>(p.dA);
  A* dCt = static_cast<A*>(p.dCt);
  // db1, dw2, dzc (2 x hid), db2, dscale: sums over all B^2 pairs, kept in double (per-tile partials in A)
  std::vector<double> sums(bias.on ? 4 * hid + 2 : 0, 0.0);

#pragma omp parallel
  {
    std::vector<A> S(IT * JT), z(hid * JT), dz(hid * JT), y(JT), gs(JT), ddl(JT * H), dctl(K2 * JT), ctp(K2 * JT), cp(JT * K2);
    std::vector<A> dat(hid * K2), sb1(hid), sw2(hid);
    std::vector<uint8_t> cl(JT);
    TileUnits<A> tu(bias);
    std::vector<double> loc(sums.size(), 0.0);
    double* ldb1 = loc.data();
    double* ldw2 = ldb1 + hid;
    double* ldzc = ldw2 + hid;
#pragma omp for schedule(dynamic, 1)
    for (int64_t ib = 0; ib < nIB; ++ib) {
      const int64_t i0 = ib * itr, mi = std::min(itr, Bq - i0);
      const int64_t jstart = stagger(ib, nJB);
      for (int64_t t = 0; t < nJB; ++t) {
        const int64_t jb = (jstart + t) % nJB, j0 = jb * JT, nj = std::min(JT, Bd - j0);
        score_tile(i0, mi, dpan.data() + j0 * H, nj, S.data());
        if (bias.on) {
          tu.plan(bias, i0, mi, pu[2 * jb], pu[2 * jb + 1]);
          if (tu.nu) bias.pack(j0, nj, ctp.data(), cp.data());
          for (int64_t m = 0; m < K2; ++m) std::fill(dctl.data() + m * JT, dctl.data() + m * JT + nj, A(0));
        }
        for (int64_t r = 0; r < mi; ++r) {
          const int64_t i = i0 + r;
          A* srow = S.data() + r * JT;
          const int64_t nclamp = bias.on ? tu.row(bias, r, i, j0, nj, ctp.data(), z.data(), y.data(), cl.data(), srow) : 0;
          mp::grad_row(srow, nj, dg.col_of(i), j0, p.q_lo[i], p.q_hi[i], p.d_lo, p.d_hi, rw, rs[i], rs[Bq + i],
                       rs[2 * Bq + i] != A(0), cols ? cw : A(0), cols ? cst : nullptr, Bd);
          if (!bias.on) continue;
          // srow now holds dL/ds_ij = dL/dbias_ij; clamped pairs go to dzc, the rest through z.
          A sdb2 = 0, sdsc = 0;
#pragma omp simd reduction(+ : sdb2, sdsc)
          for (int64_t j = 0; j < nj; ++j) {
            const A g = srow[j];
            sdsc += g * (y[j] + bias.b2);
            sdb2 += g * bias.scale;
            gs[j] = cl[j] ? A(0) : g * bias.scale;
          }
          loc[4 * hid] += sdb2;
          loc[4 * hid + 1] += sdsc;
          const int64_t nu = tu.nu;
          for (int64_t u = 0; u < nu; ++u) {  // two loops, not one with a branch: both vectorise
            const A w = tu.wt[u];
            const A* zr = z.data() + u * JT;
            A* dzr = dz.data() + u * JT;
            A s1 = 0, s2 = 0;
            if (tu.lin && u == 0) {
#pragma omp simd reduction(+ : s1, s2)
              for (int64_t j = 0; j < nj; ++j) {
                s2 += gs[j] * zr[j];
                dzr[j] = gs[j] * w;
                s1 += gs[j] * w;
              }
            } else {
#pragma omp simd reduction(+ : s1, s2)
              for (int64_t j = 0; j < nj; ++j) {
                const A zz = zr[j];
                const A on = zz > A(0) ? gs[j] : A(0);
                s2 += on * zz;
                dzr[j] = on * w;
                s1 += on * w;
              }
            }
            sb1[u] = s1;
            sw2[u] = s2;
          }
          if (nclamp)
            for (int64_t j = 0; j < nj; ++j) {
              if (!cl[j]) continue;
              const A g = srow[j] * bias.scale;
              const A* zcr = bias.zc + (cl[j] - 1) * hid;
              double* dzcr = ldzc + (cl[j] - 1) * hid;
              for (int64_t n = 0; n < hid; ++n)
                if (zcr[n] > A(0)) {
                  ldw2[n] += g * zcr[n];
                  dzcr[n] += g * bias.w2[n];
                }
            }
          if (!nu) continue;
          // dL/d(compact row weights), then back to the original units: a ReLU unit's part is its own;
          // the linear unit's R = sum_j dz_j c_j gives on-unit n dA = w2_n R, db1 = w2_n sum dz,
          // dw2 = A_i[n] . R + b1_n sum dz (its pre-activation summed against dz).
          std::fill(dat.begin(), dat.begin() + nu * K2, A(0));
          gemm::acc_nn(nu, K2, nj, dz.data(), JT, 1, cp.data(), K2, dat.data(), K2, A(1));
          gemm::acc_nn(K2, nj, nu, tu.At.data() + r * nu * K2, 1, K2, dz.data(), JT, dctl.data(), JT, A(1));
          A* dAi = dA + i * hid * K2;
          const A* Ai = bias.Am + i * hid * K2;
          int64_t u = 0;
          if (tu.lin) {
            const A* R = dat.data();
            for (int64_t n : tu.onu) {
              const A w = bias.w2[n];
              A* o = dAi + n * K2;
              const A* an = Ai + n * K2;
              A dot = 0;
#pragma omp simd reduction(+ : dot)
              for (int64_t k = 0; k < K2; ++k) { o[k] += w * R[k]; dot += an[k] * R[k]; }
              ldb1[n] += w * sb1[0];
              ldw2[n] += dot + bias.b1[n] * sb1[0];
            }
            u = 1;
          }
          for (int64_t n : tu.mix) {
            const A* g = dat.data() + u * K2;
            A* o = dAi + n * K2;
            for (int64_t k = 0; k < K2; ++k) o[k] += g[k];
            ldb1[n] += sb1[u];
            ldw2[n] += sw2[u];
            ++u;
          }
        }
        gemm::acc_nn(mi, H, nj, S.data(), JT, 1, d + j0 * p.ldd, p.ldd, dq + i0 * H, H, it);
        A* ddj = dd + j0 * H;
        if (jlocks.try_lock(jb)) {  // usual case: accumulate straight into dd
          gemm::acc_nn(nj, H, mi, S.data(), 1, JT, q + i0 * p.ldq, p.ldq, ddj, H, it);
        } else {  // panel busy: compute aside, then add
          std::fill(ddl.begin(), ddl.begin() + nj * H, A(0));
          gemm::acc_nn(nj, H, mi, S.data(), 1, JT, q + i0 * p.ldq, p.ldq, ddl.data(), H, it);
          jlocks.lock(jb);
          for (int64_t x = 0; x < nj * H; ++x) ddj[x] += ddl[x];
        }
        if (bias.on)
          for (int64_t m = 0; m < K2; ++m) {
            A* o = dCt + m * Bd + j0;
            const A* s = dctl.data() + m * JT;
            for (int64_t j = 0; j < nj; ++j) o[j] += s[j];
          }
        jlocks.unlock(jb);
      }
      for (int64_t nb = 0; nb < nNB; ++nb) {
        const int64_t k0 = nb * JT, nk = std::min(JT, N - k0);
        score_tile(i0, mi, npan.data() + k0 * H, nk, S.data());
        for (int64_t r = 0; r < mi; ++r) mp::grad_neg_row(S.data() + r * JT, nk, rw, rs[i0 + r]);
        gemm::acc_nn(mi, H, nk, S.data(), JT, 1, neg + k0 * p.ldn, p.ldn, dq + i0 * H, H, it);
        std::fill(ddl.begin(), ddl.begin() + nk * H, A(0));
        gemm::acc_nn(nk, H, mi, S.data(), 1, JT, q + i0 * p.ldq, p.ldq, ddl.data(), H, it);
        nlocks.lock(nb);
        A* dn = dneg + k0 * H;
        for (int64_t x = 0; x < nk * H; ++x) dn[x] += ddl[x];
        nlocks.unlock(nb);
      }
    }
    if (bias.on) {
#pragma omp critical(tk_multipos_bias_sums)
      for (size_t x = 0; x < loc.size(); ++x) sums[x] += loc[x];
    }
  }
  if (bias.on) {
    A* db1 = static_cast<A*>(p.db1);
    A* dw2 = static_cast<A*>(p.dw2);
    A* dzc = static_cast<A*>(p.dzc);
    for (int64_t n = 0; n < hid; ++n) {
      db1[n] += (A)sums[n];
      dw2[n] += (A)sums[hid + n];
      dzc[n] += (A)sums[2 * hid + n];
      dzc[hid + n] += (A)sums[3 * hid + n];
    }
    *static_cast<A*>(p.db2) += (A)sums[4 * hid];
    *static_cast<A*>(p.dscale) += (A)sums[4 * hid + 1];
  }
}

}  // namespace

void multipos_infonce_fwd_cpu(const MultiposParams& p) {
  if (p.dtype == DType::F32) Pass<float>(p).fwd();
  else if (p.dtype == DType::F64) Pass<double>(p).fwd();
  else fail("multipos_infonce CPU kernels take float32 or float64 (the wrapper upcasts halves)");
}

void multipos_infonce_bwd_cpu(const MultiposParams& p) {
  if (p.dtype == DType::F32) Pass<float>(p).bwd();
  else if (p.dtype == DType::F64) Pass<double>(p).bwd();
  else fail("multipos_infonce CPU kernels take float32 or float64 (the wrapper upcasts halves)");
}

}  // namespace tk
