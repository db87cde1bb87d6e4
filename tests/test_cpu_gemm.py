"""The CPU micro-kernels of csrc/common/cpu_gemm.h (acc_nn: C += alpha * A(strided) @ B; dot_nt: C = alpha *
A @ B^T + beta * C) against a float64 torch product, on shapes that are not multiples of any register block
(every M % 12 and M % 8 remainder, N hitting the 48- and 32-wide strips and every masked tail, K = 1 and K not
a multiple of the K block), with padded strides and A read transposed. Padding around C must stay untouched
(the masked tail stores)."""
import pytest
import torch

from tempokern import _C

EPS = {torch.float32: torch.finfo(torch.float32).eps, torch.float64: torch.finfo(torch.float64).eps}

SHAPES = [  # (M, N, K)
    (1, 1, 1), (1, 17, 1), (13, 47, 1), (7, 16, 3), (12, 48, 128), (8, 96, 384), (64, 96, 384),
    (64, 384, 96), (96, 384, 64), (11, 33, 257), (25, 100, 129), (9, 31, 130), (14, 64, 5), (5, 80, 200),
    (23, 145, 17), (3, 2, 300), (7, 128, 33), (13, 256, 96), (0, 5, 7), (6, 0, 7), (6, 5, 0),
]


def bound(k, absprod, dtype):
    # |fl(sum) - sum| <= gamma_k * sum |a_k b_k| (any summation order), gamma_k ~ k * eps; x2 for the
    # final alpha * acc + c rounding and slack
    return 2.0 * (k + 2) * EPS[dtype] * absprod + 1e-30


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_acc_nn(shape, transpose_a, dtype):
    M, N, K = shape
    g = torch.Generator().manual_seed(M * 1000003 + N * 1009 + K)
    pad_a, pad_b, pad_c = 3, 5, 7
    if transpose_a:  # A(i, k) = buf[k, i]: sam = 1, sak = row length
        abuf = torch.randn(max(K, 1), M + pad_a, generator=g, dtype=torch.float64)
        A = abuf[:K, :M].T
        sam, sak = 1, M + pad_a
    else:
        abuf = torch.randn(max(M, 1), K + pad_a, generator=g, dtype=torch.float64)
        A = abuf[:M, :K]
        sam, sak = K + pad_a, 1
    bbuf = torch.randn(max(K, 1), N + pad_b, generator=g, dtype=torch.float64)
    B = bbuf[:K, :N]
    cbuf = torch.randn(max(M, 1) + 1, N + pad_c, generator=g, dtype=torch.float64)
    alpha = -0.75
    want = cbuf.clone()
    want[:M, :N] += alpha * (A @ B)
    absprod = cbuf[:M, :N].abs() + abs(alpha) * (A.abs() @ B.abs())

    a, b, c = (t.to(dtype).clone() for t in (abuf, bbuf, cbuf))  # copies: .to() of the same dtype aliases
    c0 = c.double().clone()
    _C.cpu_gemm_acc_nn(dtype == torch.float64, M, N, K, a.data_ptr(), sam, sak, b.data_ptr(), N + pad_b,
                       c.data_ptr(), N + pad_c, alpha)
    got = c.double()
    # operands rounded to dtype first: compare with the exact product of the rounded operands
    a64, b64 = a.double(), b.double()
    A64 = a64[:K, :M].T if transpose_a else a64[:M, :K]
    exact = c0.clone()
    exact[:M, :N] += alpha * (A64 @ b64[:K, :N])
    err = (got - exact).abs()
    assert torch.equal(got[:, N:], c0[:, N:]), "columns past N were written"
    assert torch.equal(got[M:, :], c0[M:, :]), "rows past M were written"
    if M and N:
        assert (err[:M, :N] <= bound(K, absprod, dtype)).all(), f"max err {err.max().item():.3g}"
    if dtype == torch.float64 and M and N:
        assert (got - want).abs().max().item() <= 1e-9 * max(1.0, absprod.max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("beta", [0.0, 0.5])
@pytest.mark.parametrize("shape", SHAPES[:12], ids=lambda s: "x".join(map(str, s)))
def test_dot_nt(shape, beta, dtype):
    M, N, K = shape
    g = torch.Generator().manual_seed(7 + M * 31 + N * 7 + K)
    lda, ldb, ldc = K + 2, K + 1, N + 3
    abuf = torch.randn(max(M, 1), lda, generator=g, dtype=torch.float64).to(dtype).clone()
    bbuf = torch.randn(max(N, 1), ldb, generator=g, dtype=torch.float64).to(dtype).clone()
    cbuf = torch.randn(max(M, 1), ldc, generator=g, dtype=torch.float64).to(dtype).clone()
    if beta == 0.0:
        cbuf[:M, :N] = float("nan")  # beta == 0 must never read C
    c0 = cbuf.double().clone()
    _C.cpu_gemm_dot_nt(dtype == torch.float64, M, N, K, abuf.data_ptr(), lda, bbuf.data_ptr(), ldb,
                       cbuf.data_ptr(), ldc, 1.25, beta)
    A, B = abuf.double()[:M, :K], bbuf.double()[:N, :K]
    exact = 1.25 * (A @ B.T) + (beta * c0[:M, :N] if beta else 0.0)
    absprod = 1.25 * (A.abs() @ B.abs().T) + (beta * c0[:M, :N].abs() if beta else 0.0)
    got = cbuf.double()
    assert torch.equal(got[:, N:], c0[:, N:])
    assert ((got[:M, :N] - exact).abs() <= bound(K, absprod, dtype)).all()


def test_acc_nn_random_shapes():
    """Seeded random shapes and strides, float32 vs float64, plus the float32 error at most 2x torch's own
    float32 product error (vs the float64 product) plus a small floor, the project's lower-precision rule."""
    g = torch.Generator().manual_seed(1234)
    for _ in range(40):
        M, N, K = (int(x) for x in torch.randint(1, 140, (3,), generator=g))
        A = torch.randn(M, K, generator=g, dtype=torch.float64)
        B = torch.randn(K, N, generator=g, dtype=torch.float64)
        ref = A @ B
        a, b = A.float().contiguous(), B.float().contiguous()
        c = torch.zeros(M, N)
        _C.cpu_gemm_acc_nn(False, M, N, K, a.data_ptr(), K, 1, b.data_ptr(), N, c.data_ptr(), N, 1.0)
        ours = (c.double() - ref).abs().max().item()
        torch_err = ((a @ b).double() - ref).abs().max().item()
        assert ours <= 2 * torch_err + 4 * EPS[torch.float32] * ref.abs().max().item(), (M, N, K, ours, torch_err)


def test_simd_name():
    assert _C.cpu_gemm_simd() in ("avx512", "avx2", "scalar")
