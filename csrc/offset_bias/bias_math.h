// Torch-free maths of the relative-offset bias, shared by the offset_bias kernels and by other ops that
// fold the bias into their own kernels (fused InfoNCE, top-k scorer). Everything is inline and, under
// nvcc, __host__ __device__; A is the accumulation type (float, or double for float64 inputs).
//
// The bias (spec: tempokern/reference/offset_bias.py):
//   delta_ij = clamp(u_d[j] - u_q[i], -1, 1)
//   phi(x)   = [sin(x f_0..f_{K-1}), cos(x f_0..f_{K-1})] zero-padded (D = 1: truncated) to D features,
//              K = max(1, D / 2), f_k = exp(-ln(10000) t_k), t = linspace(0, 1, K) -- the frequencies are
//              computed in Python (reference.bias_frequencies) and passed in, never recomputed here.
//   h        = w1 phi(delta) + b1               (hidden)
//   out_ij   = scale * (w2 . relu(h) + b2)
// Layouts: w1 row-major (hidden, D) with row stride ld_w1; b1, w2 contiguous (hidden); b2, scale scalars.
// The number of non-zero features is P = min(2K, D): feature m < K is sin(f_m x), K <= m < P is cos(f_{m-K} x).
//
// Angle-difference form (the fast path): for |u_d - u_q| <= 1 the clamp is the identity and
//   h[n] = b1[n] + sum_m Q_i[n, m] c_j[m],  c_j = [sin(f u_d[j]), cos(f u_d[j])]  (2K, per column),
//   Q_i  = bias_row_weights(w1, sin/cos(f u_q[i]))                                   (hidden x 2K, per row),
// so the first layer is a small matrix product and no transcendental is evaluated per pair.
// dh/d(delta)[n] = sum_m Qd_i[n, m] c_j[m] with Qd_i = bias_row_dweights(Q_i, f). Tiles where some
// |u_d - u_q| > 1 (the clamp bites) must use the exact per-pair path (bias_pair_*); bias_tile_fast()
// decides, and also refuses |u| > kBiasFastRange where the expansion would lose precision.
//
// Backward bookkeeping (what the kernels reduce): with G the incoming gradient and
// M[n] = G * scale * [h[n] > 0], every weight gradient follows from the hidden x (D + 1) matrix
//   R[n, m] = sum_pairs M[n] phi[m]  (m < D, zero for m >= P),   R[n, D] = sum_pairs M[n]
// and two scalars S1 = sum_pairs G * (w2 . relu(h)), S0 = sum_pairs G:
//   d w1[n, m] = w2[n] R[n, m]   d b1[n] = w2[n] R[n, D]   d w2[n] = b1[n] R[n, D] + sum_m w1[n, m] R[n, m]
//   d scale    = S1 + b2 S0      d b2    = scale S0
//   d u_d[j]  += ddelta_ij, d u_q[i] -= ddelta_ij, ddelta = [-1 <= u_d - u_q <= 1] sum_n w2[n] M[n] dh/d(delta)[n]
// (the clamp passes the gradient at exactly +-1, like torch.clamp).
//
// Lookup table format (tempokern.nn.BiasTable.values, float32, contiguous): `points` >= 2 samples
//   values[p] = scale * (w2 . relu(w1 phi(delta_p) + b1) + b2),  delta_p = -1 + 2 p / (points - 1),
// i.e. scale and b2 are included: the table value IS the bias. Evaluation (bias_table_lookup) clamps delta
// to [-1, 1], sets x = (delta + 1) * (0.5 * (points - 1)), i = min(floor(x), points - 2), and returns
// values[i] + (x - i) * (values[i + 1] - values[i]) (spec: reference.offset_bias_lookup).
#pragma once
#include <cmath>
#include <cstdint>

#ifndef TK_HD
#if defined(__CUDACC__)
#define TK_HD __host__ __device__ __forceinline__
#else
#define TK_HD inline
#endif
#endif

namespace tk {
namespace bias {

// |u| above this leaves the fast path: sin(f u) for large u loses the digits the difference needs.
constexpr double kBiasFastRange = 4.0;
// Largest D the per-pair helpers' callers must size scratch arrays for is their own business; the
// kernels in this directory support any D and hidden.

template <typename A> TK_HD A bias_clamp(A diff) { return diff < A(-1) ? A(-1) : (diff > A(1) ? A(1) : diff); }
// Gradient mask of the clamp: 1 inside [-1, 1] (boundaries included, as torch.clamp), 0 outside.
template <typename A> TK_HD bool bias_passes(A diff) { return diff >= A(-1) && diff <= A(1); }

template <typename A> TK_HD A bias_floor(A x) {
#if defined(__CUDA_ARCH__)
  return floor(x);
#else
  return std::floor(x);
#endif
}

template <typename A> TK_HD void bias_sincos(A x, A* s, A* c) {
#if defined(__CUDA_ARCH__)
  *s = sin(x);
  *c = cos(x);
#else
  *s = std::sin(x);
  *c = std::cos(x);
#endif
}

TK_HD int bias_num_freqs(int64_t D) { return D / 2 > 1 ? (int)(D / 2) : 1; }
TK_HD int bias_num_features(int64_t D) { const int K = bias_num_freqs(D); return 2 * K < D ? 2 * K : (int)D; }

// Per-scalar angle features: s[k] = sin(f_k u), c[k] = cos(f_k u), k < K.
template <typename A> TK_HD void bias_angle_features(A u, const A* freqs, int K, A* s, A* c) {
  for (int k = 0; k < K; ++k) bias_sincos(freqs[k] * u, s + k, c + k);
}

// phi(delta) into phi[0..D) (zero beyond P); optionally dphi = d phi / d delta.
template <typename A>
TK_HD void bias_phi(A delta, const A* freqs, int64_t D, A* phi, A* dphi = nullptr) {
  const int K = bias_num_freqs(D);
  for (int64_t m = 0; m < D; ++m) {
    phi[m] = A(0);
    if (dphi) dphi[m] = A(0);
  }
  for (int k = 0; k < K; ++k) {
    A s, c;
    bias_sincos(freqs[k] * delta, &s, &c);
    if (k < D) {
      phi[k] = s;
      if (dphi) dphi[k] = freqs[k] * c;
    }
    if (K + k < D) {
      phi[K + k] = c;
      if (dphi) dphi[K + k] = -freqs[k] * s;
    }
  }
}

// Pre-activation h[n] = b1[n] + w1[n, :] . phi.
template <typename A>
TK_HD A bias_preact(const A* w1, int64_t ld_w1, const A* b1, const A* phi, int64_t D, int64_t n) {
  A h = b1[n];
  const A* w = w1 + n * ld_w1;
  for (int64_t m = 0; m < D; ++m) h += w[m] * phi[m];
  return h;
}

// w2 . relu(w1 phi + b1), without b2 and scale. Units n < n_linear skip the ReLU (the kernels may merge
// hidden units that are provably active for every delta in [-1, 1] into one such linear unit).
template <typename A>
TK_HD A bias_mlp_hidden_out(const A* w1, int64_t ld_w1, const A* b1, const A* w2, const A* phi, int64_t D,
                            int64_t hidden, int64_t n_linear = 0) {
  A y = 0;
  for (int64_t n = 0; n < hidden; ++n) {
    const A h = bias_preact(w1, ld_w1, b1, phi, D, n);
    if (n < n_linear || !(h <= A(0))) y += w2[n] * h;  // NaN passes, as torch's relu
  }
  return y;
}

// Exact per-pair bias out_ij from the unclamped difference diff = u_d[j] - u_q[i]; phi is scratch (D).
template <typename A>
TK_HD A bias_pair_eval(A diff, const A* freqs, int64_t D, int64_t hidden, const A* w1, int64_t ld_w1,
                       const A* b1, const A* w2, A b2, A scale, A* phi, int64_t n_linear = 0) {
  bias_phi(bias_clamp(diff), freqs, D, phi);
  return scale * (bias_mlp_hidden_out(w1, ld_w1, b1, w2, phi, D, hidden, n_linear) + b2);
}

// Exact per-pair backward (units n < n_linear without ReLU). g = incoming gradient of out_ij. Adds
// M[n] phi[m] into R (hidden x (D + 1), row stride D + 1) and M[n] into R[n, D]; adds G * (w2 . relu(h)) to *s1 and G to *s0; returns ddelta
// (already masked by the clamp). phi, dphi: scratch of D each.
template <typename A>
TK_HD A bias_pair_backward(A diff, A g, const A* freqs, int64_t D, int64_t hidden, const A* w1, int64_t ld_w1,
                           const A* b1, const A* w2, A scale, A* phi, A* dphi, A* R, A* s1, A* s0,
                           int64_t n_linear = 0) {
  bias_phi(bias_clamp(diff), freqs, D, phi, dphi);
  const A gs = g * scale;
  A y = 0, dd = 0;
  for (int64_t n = 0; n < hidden; ++n) {
    const A h = bias_preact(w1, ld_w1, b1, phi, D, n);
    if (!(n < n_linear || !(h <= A(0)))) continue;  // NaN passes (torch's relu gradient)
    y += w2[n] * h;
    A* r = R + n * (D + 1);
    const A* w = w1 + n * ld_w1;
    A hd = 0;
    for (int64_t m = 0; m < D; ++m) {
      r[m] += gs * phi[m];
      hd += w[m] * dphi[m];
    }
    r[D] += gs;
    dd += w2[n] * gs * hd;
  }
  *s1 += g * y;
  *s0 += g;
  return bias_passes(diff) ? dd : A(0);
}

// ---- angle-difference (fast path) helpers -------------------------------------------------------------

// Row weights Q (hidden x 2K, row stride ldq >= 2K) of one query from its angle features sq, cq (K each):
// Q[n, k] = ws cq_k + wc sq_k, Q[n, K + k] = wc cq_k - ws sq_k, ws = w1[n, k], wc = w1[n, K + k] (0 past D).
template <typename A>
TK_HD void bias_row_weights(const A* w1, int64_t ld_w1, int64_t D, int64_t hidden, const A* sq, const A* cq,
                            A* Q, int64_t ldq) {
  const int K = bias_num_freqs(D);
  for (int64_t n = 0; n < hidden; ++n) {
    const A* w = w1 + n * ld_w1;
    A* q = Q + n * ldq;
    for (int k = 0; k < K; ++k) {
      const A ws = k < D ? w[k] : A(0);
      const A wc = K + k < D ? w[K + k] : A(0);
      q[k] = ws * cq[k] + wc * sq[k];
      q[K + k] = wc * cq[k] - ws * sq[k];
    }
  }
}

// d h / d delta weights: Qd[n, k] = -f_k Q[n, K + k], Qd[n, K + k] = f_k Q[n, k].
template <typename A>
TK_HD void bias_row_dweights(const A* Q, int64_t ldq, const A* freqs, int K, int64_t hidden, A* Qd, int64_t ldqd) {
  for (int64_t n = 0; n < hidden; ++n) {
    const A* q = Q + n * ldq;
    A* qd = Qd + n * ldqd;
    for (int k = 0; k < K; ++k) {
      qd[k] = -freqs[k] * q[K + k];
      qd[K + k] = freqs[k] * q[k];
    }
  }
}

// Folds one query row's E[n, :] = sum_j M_ij[n] c_j (2K, row stride lde) and esum[n] = sum_j M_ij[n]
// into R (hidden x (D + 1)) using the row's angle features: phi_k = sd cq - cd sq, phi_{K+k} = cd cq + sd sq.
template <typename A>
TK_HD void bias_fold_row(const A* E, int64_t lde, const A* esum, const A* sq, const A* cq, int64_t D,
                         int64_t hidden, A* R) {
  const int K = bias_num_freqs(D);
  for (int64_t n = 0; n < hidden; ++n) {
    const A* e = E + n * lde;
    A* r = R + n * (D + 1);
    for (int k = 0; k < K; ++k) {
      if (k < D) r[k] += cq[k] * e[k] - sq[k] * e[K + k];
      if (K + k < D) r[K + k] += cq[k] * e[K + k] + sq[k] * e[k];
    }
    r[D] += esum[n];
  }
}

// True when every pair of a tile with u_q in [qmin, qmax], u_d in [dmin, dmax] may use the fast path.
template <typename A> TK_HD bool bias_tile_fast(A qmin, A qmax, A dmin, A dmax) {
  const A R = A(kBiasFastRange);
  return dmax - qmin <= A(1) && qmax - dmin <= A(1) && qmin >= -R && qmax <= R && dmin >= -R && dmax <= R;
}

// ---- lookup table ---------------------------------------------------------------------------------------

// Table value at the unclamped difference diff (see the format above); points >= 2. V: the table's storage
// type (float for BiasTable; A for the training table mode, whose values are exact float64 MLP samples).
template <typename A, typename V> TK_HD A bias_table_lookup(const V* values, int64_t points, A diff) {
  const A x = (bias_clamp(diff) + A(1)) * (A(0.5) * A(points - 1));
  if (!(x == x)) return x;  // NaN in, NaN out (and no float -> int conversion of NaN)
  int64_t i = (int64_t)bias_floor(x);
  i = i < 0 ? 0 : (i > points - 2 ? points - 2 : i);
  const A v0 = (A)values[i], v1 = (A)values[i + 1];
  return v0 + (x - A(i)) * (v1 - v0);
}

// d lookup / d diff: the segment slope inside (-1, 1) and 0 where the clamp holds delta.
template <typename A, typename V> TK_HD A bias_table_slope(const V* values, int64_t points, A diff) {
  if (!(diff == diff)) return diff;
  if (!bias_passes(diff)) return A(0);
  const A x = (diff + A(1)) * (A(0.5) * A(points - 1));
  int64_t i = (int64_t)bias_floor(x);
  i = i < 0 ? 0 : (i > points - 2 ? points - 2 : i);
  return ((A)values[i + 1] - (A)values[i]) * (A(0.5) * A(points - 1));
}

}  // namespace bias
}  // namespace tk
