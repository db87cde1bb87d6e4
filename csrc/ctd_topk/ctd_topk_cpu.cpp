// CPU fused CTD top-k. Each thread streams its own contiguous slice of the gallery in
// chunks: packs the chunk (converted to A) into NR-wide panels, scores it against all
// queries with a register-blocked MR x NR micro-kernel, adds the bias, and keeps a
// per-query candidate buffer pruned to the k best. Threads' lists merge at the end.
// Memory: packed queries (Q x H), per-thread (Q x 2k) candidates and one chunk.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>
#include <omp.h>
#include "ctd_topk/ctd_topk.h"
#include "offset_bias/bias_math.h"

namespace tk {
namespace {

template <typename A> struct VecT;
template <> struct VecT<float> { typedef float type __attribute__((vector_size(32))); };
template <> struct VecT<double> { typedef double type __attribute__((vector_size(32))); };

constexpr int MR = 6;          // query rows per micro-tile
constexpr int kChunkPanels = 4;  // gallery panels per chunk (chunk = 4 * NR rows)
constexpr int kBiasCB = 3;       // hidden units per bias micro-tile
constexpr int64_t kDirectQ = 8;   // fewer queries than this: no packing, one gallery row at a time

template <typename A> struct Aligned {
  A* ptr = nullptr;
  explicit Aligned(size_t n) {
    size_t bytes = ((n * sizeof(A) + 63) / 64) * 64;
    ptr = static_cast<A*>(std::aligned_alloc(64, bytes ? bytes : 64));
    if (!ptr) throw std::bad_alloc();
    std::memset(ptr, 0, bytes ? bytes : 64);
  }
  ~Aligned() { std::free(ptr); }
  Aligned(const Aligned&) = delete;
  Aligned& operator=(const Aligned&) = delete;
};

template <typename A> struct Cand { A s; int64_t i; };

// Score descending, then lower index first: the order of the output.
template <typename A> inline bool better(const Cand<A>& a, const Cand<A>& b) {
  return a.s > b.s || (a.s == b.s && a.i < b.i);
}

// One query's running candidates within one thread's gallery slice (indices only increase).
template <typename A> struct TopBuf {
  Cand<A>* c;
  int64_t n, cap, k;
  A thr;  // a new item must beat this strictly (ties lose: their index is higher)
  void prune() {
    std::nth_element(c, c + (k - 1), c + n, better<A>);
    n = k;
    thr = c[k - 1].s;
    for (int64_t j = 0; j < k - 1; ++j)
      if (c[j].s < thr) thr = c[j].s;
  }
  inline void push(A s, int64_t i) {
    if (n == cap) prune();
    c[n++] = Cand<A>{s, i};
  }
};

inline bool excluded(const int64_t* row, int64_t m, int64_t idx) {
  return row && std::binary_search(row, row + m, idx);
}

template <typename T, typename A>
struct Kernel {
  using V = typename VecT<A>::type;
  static constexpr int VL = 32 / sizeof(A);
  static constexpr int NR = 2 * VL;

  const CtdTopkParams& p;
  int64_t Q, N, H, k, QP, K2, HB;
  A temp, bias_plus = 0, bias_minus = 0;
  A bias_ub = std::numeric_limits<A>::infinity();  // >= every computed bias value (pruning)
  std::unique_ptr<Aligned<A>> qpack;   // (QP panels, H, MR)
  std::unique_ptr<Aligned<A>> qrows;   // direct mode: (Q, H)
  bool direct = false;
  std::unique_ptr<Aligned<A>> amat;    // exact bias: (Q, K2, HB) first layer folded with the query's angle
  std::vector<A> b1v, w2v, fr;

  explicit Kernel(const CtdTopkParams& pp) : p(pp) {
    Q = p.Q; N = p.N; H = p.H; k = p.k;
    QP = (Q + MR - 1) / MR;
    temp = (A)p.temperature;
    direct = !p.cand && Q < kDirectQ;
    if (direct) {
      qrows.reset(new Aligned<A>((size_t)Q * H));
      for (int64_t i = 0; i < Q; ++i)
        for (int64_t h = 0; h < H; ++h) qrows->ptr[i * H + h] = load(static_cast<const T*>(p.q) + i * p.q_stride, h);
    }
    const bool packed = !p.cand && !direct;  // rerank reads q rows itself
    qpack.reset(new Aligned<A>(packed ? (size_t)QP * H * MR : 1));
    A* qp = qpack->ptr;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < (packed ? QP : 0); ++b)
      for (int r = 0; r < MR; ++r) {
        const int64_t i = b * MR + r;
        if (i >= Q) continue;
        const T* src = static_cast<const T*>(p.q) + i * p.q_stride;
        A* dst = qp + b * H * MR + r;
        for (int64_t h = 0; h < H; ++h) dst[h * MR] = load(src, h);
      }
    if (p.bias == CtdBias::Exact) setup_exact();
    if (p.bias == CtdBias::Table) {
      // interpolation never leaves [min, max] of the samples, up to rounding
      double mx = -std::numeric_limits<double>::infinity(), amax = 0;
      for (int64_t j = 0; j < p.P; ++j) { mx = std::max(mx, (double)p.table[j]); amax = std::max(amax, std::fabs((double)p.table[j])); }
      const double ub = mx + 8.0 * (double)std::numeric_limits<float>::epsilon() * amax;
      bias_ub = std::isfinite(ub) ? (A)ub : std::numeric_limits<A>::infinity();
    }
  }

  // Exact bias for one delta, straight from the formula (used for the clamped ends).
  A bias_at(double delta) const {
    const A* w1 = static_cast<const A*>(p.w1);
    double out = 0;
    for (int64_t c = 0; c < p.hidden; ++c) {
      double h = b1v[c];
      for (int64_t kk = 0; kk < p.K; ++kk) {
        const double a = (double)fr[kk] * delta;
        if (kk < p.D) h += (double)w1[c * p.D + kk] * std::sin(a);
        if (p.K + kk < p.D) h += (double)w1[c * p.D + p.K + kk] * std::cos(a);
      }
      out += (double)w2v[c] * std::max(h, 0.0);
    }
    return (A)(p.scale * (out + p.b2));
  }

  // sin(f (ug - uq)) and cos(f (ug - uq)) expand into per-row and per-column terms, so the
  // first layer is amat[i] (2K x hidden) times the gallery row's [sin(f ug), cos(f ug)].
  void setup_exact() {
    K2 = 2 * p.K;
    HB = (p.hidden + kBiasCB - 1) / kBiasCB * kBiasCB;
    const A* w1 = static_cast<const A*>(p.w1);
    const A* uq = static_cast<const A*>(p.u_q);
    fr.assign(static_cast<const A*>(p.freqs), static_cast<const A*>(p.freqs) + p.K);
    b1v.assign(HB, A(0));
    w2v.assign(HB, A(0));
    for (int64_t c = 0; c < p.hidden; ++c) {
      b1v[c] = static_cast<const A*>(p.b1)[c];
      w2v[c] = static_cast<const A*>(p.w2)[c];
    }
    bias_plus = bias_at(1.0);
    bias_minus = bias_at(-1.0);
    amat.reset(new Aligned<A>((size_t)(Q + 1) * K2 * HB));  // +1: bias_tile2 reads query pairs
    A* am = amat->ptr;
    const int64_t K = p.K, D = p.D;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < Q; ++i) {
      A* m = am + i * K2 * HB;
      for (int64_t kk = 0; kk < K; ++kk) {
        const double a = (double)fr[kk] * (double)uq[i];
        const A sq = (A)std::sin(a), cq = (A)std::cos(a);
        for (int64_t c = 0; c < p.hidden; ++c) {
          const A ws = kk < D ? w1[c * D + kk] : A(0);
          const A wc = K + kk < D ? w1[c * D + K + kk] : A(0);
          m[kk * HB + c] = ws * cq + wc * sq;         // multiplies sin(f ug)
          m[(K + kk) * HB + c] = wc * cq - ws * sq;   // multiplies cos(f ug)
        }
      }
    }
    bias_ub = upper_bound();
  }

  // A rigorous upper bound of the bias over delta in [-1, 1], so a pair whose semantic score
  // plus this bound cannot reach a query's current k-th score skips the bias (exact pruning).
  // Max over S samples, plus Lipschitz constant x half the spacing, plus a rounding margin.
  A upper_bound() const {
    const A* w1 = static_cast<const A*>(p.w1);
    const int64_t S = 1025, K = p.K, D = p.D;
    double lip = 0, mag = 0;
    for (int64_t c = 0; c < p.hidden; ++c) {
      double l = 0, a = std::fabs((double)b1v[c]);
      for (int64_t kk = 0; kk < K; ++kk) {
        const double ws = kk < D ? std::fabs((double)w1[c * D + kk]) : 0.0;
        const double wc = K + kk < D ? std::fabs((double)w1[c * D + K + kk]) : 0.0;
        l += (double)fr[kk] * (ws + wc);
        a += ws + wc;
      }
      lip += std::fabs((double)w2v[c]) * l;
      mag += std::fabs((double)w2v[c]) * a;
    }
    std::vector<double> phi(2 * K), h(p.hidden);
    double best = -std::numeric_limits<double>::infinity();
    for (int64_t sidx = 0; sidx < S; ++sidx) {
      const double delta = -1.0 + 2.0 * (double)sidx / (double)(S - 1);
      for (int64_t kk = 0; kk < K; ++kk) {
        phi[kk] = std::sin((double)fr[kk] * delta);
        phi[K + kk] = std::cos((double)fr[kk] * delta);
      }
      double out = 0;
      for (int64_t c = 0; c < p.hidden; ++c) {
        double hc = b1v[c];
        for (int64_t kk = 0; kk < K; ++kk) {
          if (kk < D) hc += (double)w1[c * D + kk] * phi[kk];
          if (K + kk < D) hc += (double)w1[c * D + K + kk] * phi[K + kk];
        }
        out += (double)w2v[c] * std::max(hc, 0.0);
      }
      best = std::max(best, p.scale * (out + p.b2));
    }
    const double eps = (double)std::numeric_limits<A>::epsilon();
    const double abs_scale = std::fabs(p.scale);
    const double margin = abs_scale * (lip * (1.0 / (double)(S - 1)) + mag * 64.0 * eps * (double)(2 * K + 8)) +
                          8.0 * eps * (std::fabs(best) + abs_scale * std::fabs(p.b2));
    const double ub = best + margin;
    return std::isfinite(ub) ? (A)(ub * (1 + 4 * eps) + 4 * eps) : std::numeric_limits<A>::infinity();
  }

  static inline V vload(const A* x) { V v; std::memcpy(&v, x, sizeof(V)); return v; }
  static inline void vstore(A* x, V v) { std::memcpy(x, &v, sizeof(V)); }

  // out[r][0..NR) = sum_h qp[h][r] * gp[h][0..NR)
  inline void dot_tile(const A* __restrict qp, const A* __restrict gp, A (*out)[NR]) const {
    V c00 = {}, c01 = {}, c10 = {}, c11 = {}, c20 = {}, c21 = {}, c30 = {}, c31 = {}, c40 = {}, c41 = {},
      c50 = {}, c51 = {};
    for (int64_t h = 0; h < H; ++h) {
      const V b0 = vload(gp + h * NR), b1 = vload(gp + h * NR + VL);
      const A* a = qp + h * MR;
      A a0 = a[0], a1 = a[1], a2 = a[2];
      c00 += a0 * b0; c01 += a0 * b1;
      c10 += a1 * b0; c11 += a1 * b1;
      c20 += a2 * b0; c21 += a2 * b1;
      a0 = a[3]; a1 = a[4]; a2 = a[5];
      c30 += a0 * b0; c31 += a0 * b1;
      c40 += a1 * b0; c41 += a1 * b1;
      c50 += a2 * b0; c51 += a2 * b1;
    }
    vstore(out[0], c00); vstore(out[0] + VL, c01);
    vstore(out[1], c10); vstore(out[1] + VL, c11);
    vstore(out[2], c20); vstore(out[2] + VL, c21);
    vstore(out[3], c30); vstore(out[3] + VL, c31);
    vstore(out[4], c40); vstore(out[4] + VL, c41);
    vstore(out[5], c50); vstore(out[5] + VL, c51);
  }

  // Exact bias (before scale and b2) of queries i0, i0 + 1 against one gallery panel:
  // fp (K2, NR) holds [sin(f ug); cos(f ug)]. 2 queries x 3 hidden units x 2 vectors = 12 chains.
  inline void bias_tile2(int64_t i0, const A* __restrict fp, A* out0, A* out1) const {
    const A* m0 = amat->ptr + i0 * K2 * HB;
    const A* m1 = m0 + K2 * HB;
    V o00 = {}, o01 = {}, o10 = {}, o11 = {};
    const V z = {};
    for (int64_t c0 = 0; c0 < HB; c0 += kBiasCB) {
      V p00 = z + b1v[c0], p01 = p00, p10 = z + b1v[c0 + 1], p11 = p10, p20 = z + b1v[c0 + 2], p21 = p20;
      V r00 = p00, r01 = p00, r10 = p10, r11 = p10, r20 = p20, r21 = p20;
      for (int64_t kk = 0; kk < K2; ++kk) {
        const V f0 = vload(fp + kk * NR), f1 = vload(fp + kk * NR + VL);
        const A* a = m0 + kk * HB + c0;
        const A* b = m1 + kk * HB + c0;
        p00 += a[0] * f0; p01 += a[0] * f1;
        p10 += a[1] * f0; p11 += a[1] * f1;
        p20 += a[2] * f0; p21 += a[2] * f1;
        r00 += b[0] * f0; r01 += b[0] * f1;
        r10 += b[1] * f0; r11 += b[1] * f1;
        r20 += b[2] * f0; r21 += b[2] * f1;
      }
      const A w0 = w2v[c0], w1_ = w2v[c0 + 1], w2_ = w2v[c0 + 2];
      o00 += w0 * (p00 <= z ? z : p00) + w1_ * (p10 <= z ? z : p10) + w2_ * (p20 <= z ? z : p20);
      o01 += w0 * (p01 <= z ? z : p01) + w1_ * (p11 <= z ? z : p11) + w2_ * (p21 <= z ? z : p21);
      o10 += w0 * (r00 <= z ? z : r00) + w1_ * (r10 <= z ? z : r10) + w2_ * (r20 <= z ? z : r20);
      o11 += w0 * (r01 <= z ? z : r01) + w1_ * (r11 <= z ? z : r11) + w2_ * (r21 <= z ? z : r21);
    }
    vstore(out0, o00); vstore(out0 + VL, o01);
    vstore(out1, o10); vstore(out1 + VL, o11);
  }

  inline A table_at(A uq, A ug) const { return bias::bias_table_lookup<A>(p.table, p.P, ug - uq); }

  // Scores gallery rows [lo, hi) against every query into this thread's buffers.
  void scan(int64_t lo, int64_t hi, std::vector<TopBuf<A>>& bufs) const {
    const int64_t NC = (int64_t)kChunkPanels * NR;
    Aligned<A> gpack((size_t)kChunkPanels * H * NR);
    Aligned<A> fpack(p.bias == CtdBias::Exact ? (size_t)kChunkPanels * K2 * NR : 1);
    std::vector<A> ugc(NC, A(0));
    alignas(64) A tile[MR][NR];
    alignas(64) A btile[MR][NR];
    const A* ug = static_cast<const A*>(p.u_g);
    const A* uq = static_cast<const A*>(p.u_q);
    const T* g = static_cast<const T*>(p.g);
    const A scale_a = (A)p.scale, b2_a = (A)p.b2;
    for (int64_t c0 = lo; c0 < hi; c0 += NC) {
      const int64_t nc = std::min(NC, hi - c0);
      const int64_t npan = (nc + NR - 1) / NR;
      for (int64_t j = 0; j < npan * NR; ++j) {
        A* dst = gpack.ptr + (j / NR) * H * NR + (j % NR);
        if (j < nc) {
          const T* src = g + (c0 + j) * p.g_stride;
          for (int64_t h = 0; h < H; ++h) dst[h * NR] = load(src, h);
        } else {
          for (int64_t h = 0; h < H; ++h) dst[h * NR] = A(0);
        }
        if (p.bias != CtdBias::None) ugc[j] = j < nc ? ug[c0 + j] : A(0);
      }
      A ug_lo = 0, ug_hi = 0;
      if (p.bias == CtdBias::Exact) {
        ug_lo = ug_hi = ugc[0];
        for (int64_t j = 1; j < nc; ++j) { ug_lo = std::min(ug_lo, ugc[j]); ug_hi = std::max(ug_hi, ugc[j]); }
        for (int64_t j = 0; j < npan * NR; ++j) {
          A* dst = fpack.ptr + (j / NR) * K2 * NR + (j % NR);
          for (int64_t kk = 0; kk < p.K; ++kk) {
            const double a = (double)fr[kk] * (double)ugc[j];
            dst[kk * NR] = (A)std::sin(a);
            dst[(p.K + kk) * NR] = (A)std::cos(a);
          }
        }
      }
      for (int64_t qb = 0; qb < QP; ++qb) {
        const A* qp = qpack->ptr + qb * H * MR;
        const int rows = (int)std::min<int64_t>(MR, Q - qb * MR);
        for (int64_t jp = 0; jp < npan; ++jp) {
          dot_tile(qp, gpack.ptr + jp * H * NR, tile);
          const int cols = (int)std::min<int64_t>(NR, nc - jp * NR);
          bool need[MR];
          for (int r = 0; r < rows; ++r) {
            A* s = tile[r];
            for (int j = 0; j < NR; ++j) s[j] = s[j] / temp;
            if (p.bias != CtdBias::None) {
              const A thr = bufs[qb * MR + r].thr;
              bool any = false;
              for (int j = 0; j < cols; ++j) any |= !(s[j] + bias_ub < thr);
              need[r] = any;
            }
          }
          if (p.bias == CtdBias::Exact)
            for (int r = 0; r < rows; r += 2)
              if (need[r] || (r + 1 < rows && need[r + 1]))
                bias_tile2(qb * MR + r, fpack.ptr + jp * K2 * NR, btile[r], btile[r + 1]);
          for (int r = 0; r < rows; ++r) {
            const int64_t i = qb * MR + r;
            A* s = tile[r];
            if (p.bias == CtdBias::Exact) {
              if (!need[r]) continue;  // no pair of this row can reach the k-th score
              if (ug_hi - uq[i] <= A(1) && ug_lo - uq[i] >= A(-1)) {  // the clamp cannot bite in this chunk
                for (int j = 0; j < NR; ++j) s[j] += scale_a * (btile[r][j] + b2_a);
              } else for (int j = 0; j < cols; ++j) {
                const A d = ugc[jp * NR + j] - uq[i];
                const A b = d > A(1) ? bias_plus : (d < A(-1) ? bias_minus : (A)(p.scale * ((double)btile[r][j] + p.b2)));
                s[j] += b;
              }
            } else if (p.bias == CtdBias::Table) {
              if (!need[r]) continue;
              for (int j = 0; j < cols; ++j) s[j] += table_at(uq[i], ugc[jp * NR + j]);
            }
            TopBuf<A>& tb = bufs[i];
            const int64_t* ex = p.exclude ? p.exclude + i * p.m : nullptr;
            for (int j = 0; j < cols; ++j) {
              if (!(s[j] > tb.thr)) continue;
              const int64_t idx = c0 + jp * NR + j;
              if (excluded(ex, p.m, idx)) continue;
              tb.push(s[j], idx);
            }
          }
        }
      }
    }
  }

  static inline A dot_row(const A* __restrict x, const A* __restrict y, int64_t n) {
    V acc0 = {}, acc1 = {}, acc2 = {}, acc3 = {};  // four chains hide the FMA latency
    int64_t h = 0;
    for (; h + 4 * VL <= n; h += 4 * VL) {
      acc0 += vload(x + h) * vload(y + h);
      acc1 += vload(x + h + VL) * vload(y + h + VL);
      acc2 += vload(x + h + 2 * VL) * vload(y + h + 2 * VL);
      acc3 += vload(x + h + 3 * VL) * vload(y + h + 3 * VL);
    }
    for (; h + VL <= n; h += VL) acc0 += vload(x + h) * vload(y + h);
    acc0 += acc1;
    acc2 += acc3;
    acc0 += acc2;
    A dot = 0;
    for (int l = 0; l < VL; ++l) dot += acc0[l];
    for (; h < n; ++h) dot += x[h] * y[h];
    return dot;
  }

  // [sin(f ug), cos(f ug)] of one gallery row (exact bias)
  inline void row_features(A ugv, A* feat) const {
    for (int64_t kk = 0; kk < p.K; ++kk) {
      const double a = (double)fr[kk] * (double)ugv;
      feat[kk] = (A)std::sin(a);
      feat[p.K + kk] = (A)std::cos(a);
    }
  }

  // Bias of one pair; feat = row_features(ug) for the exact bias, hid: HB scratch.
  inline A pair_bias(int64_t i, A uqv, A ugv, const A* feat, A* hid) const {
    if (p.bias == CtdBias::Table) return table_at(uqv, ugv);
    const A d = ugv - uqv;
    if (d > A(1)) return bias_plus;
    if (d < A(-1)) return bias_minus;
    const A* m = amat->ptr + i * K2 * HB;
    for (int64_t cc = 0; cc < HB; ++cc) hid[cc] = b1v[cc];
    for (int64_t kk = 0; kk < K2; ++kk) {
      const A f = feat[kk];
      const A* mr = m + kk * HB;
      for (int64_t cc = 0; cc < HB; ++cc) hid[cc] += mr[cc] * f;
    }
    A o = 0;
    for (int64_t cc = 0; cc < HB; ++cc) o += w2v[cc] * (hid[cc] <= A(0) ? A(0) : hid[cc]);
    return (A)(p.scale * ((double)o + p.b2));
  }

  // Few queries: packing a panel costs more than it saves, so dot each gallery row directly.
  void scan_direct(int64_t lo, int64_t hi, std::vector<TopBuf<A>>& bufs) const {
    const A* ug = static_cast<const A*>(p.u_g);
    const A* uq = static_cast<const A*>(p.u_q);
    const T* g = static_cast<const T*>(p.g);
    std::vector<A> grow(H), feat(p.bias == CtdBias::Exact ? K2 : 1), hid(p.bias == CtdBias::Exact ? HB : 1);
    const A* qr = qrows->ptr;
    for (int64_t idx = lo; idx < hi; ++idx) {
      const A* gr;
      if (std::is_same<T, A>::value) {
        gr = reinterpret_cast<const A*>(g + idx * p.g_stride);
      } else {
        const T* gs = g + idx * p.g_stride;
        for (int64_t h = 0; h < H; ++h) grow[h] = load(gs, h);
        gr = grow.data();
      }
      bool have_feat = false;
      for (int64_t i = 0; i < Q; ++i) {
        TopBuf<A>& tb = bufs[i];
        A s = dot_row(qr + i * H, gr, H) / temp;
        if (p.bias != CtdBias::None) {
          if (!(s + bias_ub >= tb.thr)) continue;  // cannot reach the k best
          if (p.bias == CtdBias::Exact && !have_feat) { row_features(ug[idx], feat.data()); have_feat = true; }
          s += pair_bias(i, uq[i], ug[idx], feat.data(), hid.data());
        }
        if (!(s > tb.thr)) continue;
        if (excluded(p.exclude ? p.exclude + i * p.m : nullptr, p.m, idx)) continue;
        tb.push(s, idx);
      }
    }
  }

  // Rerank: query i scores only the gallery rows cand[i, 0..C) (ascending; negatives skipped).
  void rerank() const {
    const int64_t C = p.C, cap = std::max<int64_t>(2 * k, k + 64);
    const A* ug = static_cast<const A*>(p.u_g);
    const A* uq = static_cast<const A*>(p.u_q);
    A* vals = static_cast<A*>(p.values);
#pragma omp parallel
    {
      std::vector<A> qrow(H), grow(H), feat(p.bias == CtdBias::Exact ? K2 : 1), hid(p.bias == CtdBias::Exact ? HB : 1);
      std::vector<Cand<A>> store(cap);
#pragma omp for schedule(dynamic, 4)
      for (int64_t i = 0; i < Q; ++i) {
        const T* qs = static_cast<const T*>(p.q) + i * p.q_stride;
        for (int64_t h = 0; h < H; ++h) qrow[h] = load(qs, h);
        TopBuf<A> tb{store.data(), 0, cap, k, -std::numeric_limits<A>::infinity()};
        const int64_t* ex = p.exclude ? p.exclude + i * p.m : nullptr;
        const int64_t* cr = p.cand + i * C;
        int64_t prev = -1;
        for (int64_t c = 0; c < C; ++c) {
          const int64_t idx = cr[c];
          if (idx < 0 || idx >= N || idx == prev) continue;
          prev = idx;
          const T* gs = static_cast<const T*>(p.g) + idx * p.g_stride;
          for (int64_t h = 0; h < H; ++h) grow[h] = load(gs, h);
          A s = dot_row(qrow.data(), grow.data(), H) / temp;
          if (p.bias != CtdBias::None) {
            if (!(s + bias_ub >= tb.thr)) continue;  // cannot reach the k best
            if (p.bias == CtdBias::Exact) row_features(ug[idx], feat.data());
            s += pair_bias(i, uq[i], ug[idx], feat.data(), hid.data());
          }
          if (!(s > tb.thr)) continue;
          if (excluded(ex, p.m, idx)) continue;
          tb.push(s, idx);
        }
        const int64_t take = std::min<int64_t>(k, tb.n);
        std::partial_sort(tb.c, tb.c + take, tb.c + tb.n, better<A>);
        for (int64_t j = 0; j < k; ++j) {
          vals[i * k + j] = j < take ? tb.c[j].s : -std::numeric_limits<A>::infinity();
          p.indices[i * k + j] = j < take ? tb.c[j].i : -1;
        }
      }
    }
  }

  void run() {
    if (p.cand) { rerank(); return; }
    int NT = omp_get_max_threads();
    const int64_t NC = (int64_t)kChunkPanels * NR;
    NT = (int)std::max<int64_t>(1, std::min<int64_t>(NT, (N + NC - 1) / NC));
    // slices aligned to NR so panels never straddle two threads
    const int64_t panels = (N + NR - 1) / NR;
    const int64_t cap = std::max<int64_t>(2 * k, k + 64);
    std::vector<Cand<A>> store((size_t)NT * Q * cap);
    std::vector<std::vector<TopBuf<A>>> all(NT);
#pragma omp parallel num_threads(NT)
    {
      const int t = omp_get_thread_num();
      const int64_t lo = std::min(N, panels * t / NT * NR), hi = std::min(N, panels * (t + 1) / NT * NR);
      auto& bufs = all[t];
      bufs.resize(Q);
      for (int64_t i = 0; i < Q; ++i)
        bufs[i] = TopBuf<A>{store.data() + ((size_t)t * Q + i) * cap, 0, cap, k,
                            -std::numeric_limits<A>::infinity()};
      if (hi > lo) { if (direct) scan_direct(lo, hi, bufs); else scan(lo, hi, bufs); }
    }
    A* vals = static_cast<A*>(p.values);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < Q; ++i) {
      std::vector<Cand<A>> merged;
      for (int t = 0; t < NT; ++t) {
        const TopBuf<A>& b = all[t][i];
        merged.insert(merged.end(), b.c, b.c + b.n);
      }
      const int64_t take = std::min<int64_t>(k, (int64_t)merged.size());
      std::partial_sort(merged.begin(), merged.begin() + take, merged.end(), better<A>);
      for (int64_t j = 0; j < k; ++j) {
        vals[i * k + j] = j < take ? merged[j].s : -std::numeric_limits<A>::infinity();
        p.indices[i * k + j] = j < take ? merged[j].i : -1;
      }
    }
  }
};

template <typename T>
void run_typed(const CtdTopkParams& p) {
  using A = typename Acc<T>::type;
  Kernel<T, A>(p).run();
}

}  // namespace

void ctd_topk_cpu(const CtdTopkParams& p) {
  dispatch_float(p.dtype, [&](auto t) { run_typed<decltype(t)>(p); });
}

}  // namespace tk
