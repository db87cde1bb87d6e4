"""Hypothesis fuzzing of every op against tempokern.reference: random shapes, dtypes, memory layouts
(contiguous, strided, column-major, offset views, expanded rows) and special values (zeros, large values,
duplicated rows, values outside the bias clamp, NaN), on the CPU kernels and on the CUDA kernels (the
`device` fixture: "cpu", "cuda" with a GPU, "emu" = the CUDA emulator).

Forward values are compared with the reference computed in float64 on the same inputs (NaN exactly where
the reference has NaN); gradients of every differentiable input when the reference's are finite. The example
counts keep the file within a CI budget (``TEMPOKERN_FUZZ_EXAMPLES`` scales them, e.g. 20 for a longer run);
the examples are derandomized, so CI sees the same ones every run."""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tempokern
from tempokern import reference as ref
from tempokern.reference.ctd_topk import ctd_scores, sorted_topk
from tempokern.nn import Re3Loss

_SCALE = float(os.environ.get("TEMPOKERN_FUZZ_EXAMPLES", "1"))


def _examples(device: torch.device, cpu: int, emu: int) -> int:
    from tempokern._ops.common import on_cuda_path
    n = emu if (device.type == "cpu" and on_cuda_path(device)) else cpu
    return max(1, int(round(n * _SCALE)))


def _run(device, cpu: int, emu: int, body):
    """Runs body(data) for the device's number of examples (hypothesis, derandomized, no deadline)."""
    s = settings(max_examples=_examples(device, cpu, emu), deadline=None, derandomize=True, database=None,
                 suppress_health_check=list(HealthCheck), print_blob=True)

    @s
    @given(st.data())
    def inner(data):
        body(data)
    inner()


# ---- inputs ------------------------------------------------------------------------------------

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
LAYOUTS = ["contiguous", "strided", "column-major", "offset", "expanded"]


def _tol(dtype):
    """(rtol, atol) of the op's result against the float64 reference on the same (rounded) inputs."""
    return {torch.float64: (1e-7, 1e-9), torch.float32: (2e-4, 2e-4)}.get(dtype, (2e-2, 2e-2))


def layout(t: torch.Tensor, kind: str) -> torch.Tensor:
    """t's values in another memory layout ("expanded" repeats the first row/element: different values, so
    the op and the reference both get the returned tensor)."""
    if kind == "contiguous" or t.numel() == 0:
        return t.contiguous()
    if kind == "strided":        # every other element of a wider buffer along the last dim
        buf = t.new_zeros(*t.shape[:-1], 2 * t.shape[-1])
        buf[..., ::2] = t
        return buf[..., ::2]
    if kind == "column-major":
        return t.t().contiguous().t() if t.dim() == 2 else t.flip(0).contiguous().flip(0)
    if kind == "offset":         # a view starting one row into its storage
        buf = t.new_zeros(t.shape[0] + 1, *t.shape[1:])
        buf[1:] = t
        return buf[1:]
    if kind == "expanded":
        return t[:1].expand_as(t)
    raise ValueError(kind)


SPECIALS = ("none", "zeros", "large", "duplicates", "nan")


def draw_matrix(data, n: int, m: int, dtype, device, *, special=SPECIALS, name: str = "x") -> torch.Tensor:
    seed = data.draw(st.integers(0, 2 ** 31 - 1), label=f"{name} seed")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, m, generator=g, dtype=torch.float64)
    if special and n and m:
        kind = data.draw(st.sampled_from(special), label=f"{name} values")
        if kind == "zeros":
            x[torch.randint(n, (max(1, n // 3),), generator=g)] = 0
        elif kind == "large":
            x = x * 30
        elif kind == "duplicates":
            x[n // 2:] = x[: n - n // 2].clone()
        elif kind == "nan":
            x[torch.randint(n, (1,), generator=g), torch.randint(m, (1,), generator=g)] = float("nan")
    x = x.to(dtype).to(device)
    return layout(x, data.draw(st.sampled_from(LAYOUTS), label=f"{name} layout"))


def draw_vector(data, n: int, dtype, device, lo: float, hi: float, name: str) -> torch.Tensor:
    seed = data.draw(st.integers(0, 2 ** 31 - 1), label=f"{name} seed")
    g = torch.Generator().manual_seed(seed)
    x = (lo + (hi - lo) * torch.rand(n, generator=g, dtype=torch.float64)).to(dtype).to(device)
    kind = data.draw(st.sampled_from(["contiguous", "strided", "offset", "expanded"]), label=f"{name} layout")
    return layout(x[:, None], kind)[:, 0] if kind != "strided" else layout(x, kind)


def draw_mlp(data, dtype, device, nan: bool = False):
    hidden = data.draw(st.integers(1, 40), label="hidden")
    D = data.draw(st.integers(1, 40), label="D")
    seed = data.draw(st.integers(0, 2 ** 31 - 1), label="mlp seed")
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(hidden, D, generator=g, dtype=torch.float64)
    b1 = torch.randn(hidden, generator=g, dtype=torch.float64)
    w2 = torch.randn(1, hidden, generator=g, dtype=torch.float64) / hidden ** 0.5
    b2 = torch.randn(1, generator=g, dtype=torch.float64)
    scale = torch.rand((), generator=g, dtype=torch.float64)
    if nan and data.draw(st.booleans(), label="NaN in the MLP"):
        which = data.draw(st.sampled_from(["w1", "b1"]), label="NaN where")
        if which == "w1":
            w1[data.draw(st.integers(0, hidden - 1)), data.draw(st.integers(0, D - 1))] = float("nan")
        else:
            b1[data.draw(st.integers(0, hidden - 1))] = float("nan")
    w1 = layout(w1.to(dtype).to(device), data.draw(st.sampled_from(LAYOUTS[:4]), label="w1 layout"))
    return w1, b1.to(dtype).to(device), w2.to(dtype).to(device), b2.to(dtype).to(device), scale.to(dtype).to(device)


def draw_spans(data, n: int, device, name: str):
    seed = data.draw(st.integers(0, 2 ** 31 - 1), label=f"{name} seed")
    g = torch.Generator().manual_seed(seed)
    width = data.draw(st.integers(1, 3 * n + 1), label=f"{name} range")
    dt = data.draw(st.sampled_from([torch.int64, torch.int32, torch.uint8, torch.uint64]), label=f"{name} dtype")
    hi = min(width, 255) if dt == torch.uint8 else width
    s = torch.randint(0, hi, (n,), generator=g)
    e = torch.randint(0, hi, (n,), generator=g)
    return s.to(dt).to(device), e.to(dt).to(device)


def _i64(span):
    return tuple(t.to(torch.int64) for t in span)


# ---- comparison ----------------------------------------------------------------------------------

def close(out: torch.Tensor, want: torch.Tensor, dtype, what: str, scale: float = 1.0):
    assert out.shape == want.shape, f"{what}: shape {tuple(out.shape)} vs {tuple(want.shape)}"
    o, w = out.detach().double().cpu(), want.detach().double().cpu()
    assert torch.equal(o.isnan(), w.isnan()), (
        f"{what}: NaN at {o.isnan().nonzero().tolist()[:8]}, the reference at {w.isnan().nonzero().tolist()[:8]}")
    rtol, atol = _tol(dtype)
    torch.testing.assert_close(o, w, rtol=rtol, atol=atol * scale, equal_nan=True, msg=lambda m: f"{what}: {m}")


def leaves(ts):
    return [t.detach().clone().requires_grad_(True) if t.is_floating_point() else t for t in ts]


def grads_of(out, ins):
    ins = [t for t in ins if isinstance(t, torch.Tensor) and t.requires_grad]
    return torch.autograd.grad(out.double().sum(), ins, allow_unused=True)


def compare_with_grads(op, refop, inputs, dtype, what, scale=1.0, grad_scale=None):
    """op(*inputs) vs refop(*float64 copies): forward, and the gradients when the reference's are finite
    (grad_scale: {input index: extra tolerance factor} where the dtype bounds a gradient's accuracy)."""
    a = leaves(inputs)
    b = leaves([t.double() if t.is_floating_point() else t for t in inputs])
    out, want = op(*a), refop(*b)
    close(out, want, dtype, what, scale)
    if not bool(torch.isfinite(want).all()):
        return
    ga, gb = grads_of(out, a), grads_of(want, b)
    for k, (x, y) in enumerate(zip(ga, gb)):
        if y is None or not bool(torch.isfinite(y).all()):
            continue
        assert x is not None, f"{what}: no gradient for input {k}"
        extra = (grad_scale or {}).get(k, 1.0)
        close(x, y, dtype, f"{what} d/d input {k}", extra * scale * (1 + (float(y.abs().max()) if y.numel() else 0.0)))


# ---- offset_bias ---------------------------------------------------------------------------------------

def test_fuzz_offset_bias(device):
    def body(data):
        dtype = data.draw(st.sampled_from([torch.float64, torch.float32]), label="dtype")
        Bq, Bd = data.draw(st.integers(0, 40), label="Bq"), data.draw(st.integers(0, 40), label="Bd")
        u_q = draw_vector(data, Bq, dtype, device, -1.5, 1.5, "u_q")
        u_d = draw_vector(data, Bd, dtype, device, -1.5, 1.5, "u_d")
        mlp = draw_mlp(data, dtype, device, nan=True)
        table = data.draw(st.sampled_from([None, 2, 33, 4097]), label="table_points")
        if table is None:
            compare_with_grads(tempokern.offset_bias, ref.offset_bias, (u_q, u_d, *mlp), dtype, "offset_bias")
        else:
            # d/du is the interpolant's slope (v_{k+1} - v_k) (P - 1) / 2 from table values rounded to the dtype:
            # its error grows with the points, ~ eps (P - 1) |v| (the same for any float32 evaluation)
            eps = torch.finfo(dtype).eps
            su = 1.0 + 5 * (table - 1) * eps / _tol(dtype)[1]
            compare_with_grads(lambda *a: tempokern.offset_bias(*a, table_points=table),
                               lambda *a: ref.offset_bias_tabulated(*a, table), (u_q, u_d, *mlp), dtype,
                               f"offset_bias table {table}", grad_scale={0: su, 1: su})
    _run(device, 60, 20, body)


# ---- ctd_topk --------------------------------------------------------------------------------------------

def test_fuzz_ctd_topk(device):
    def body(data):
        dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
        Q, N = data.draw(st.integers(0, 24), label="Q"), data.draw(st.integers(1, 60), label="N")
        H = data.draw(st.integers(1, 40), label="H")
        k = data.draw(st.integers(1, N), label="k")
        q = draw_matrix(data, Q, H, dtype, device, special=False, name="q")
        g = draw_matrix(data, N, H, dtype, device, special=False, name="g")
        if data.draw(st.booleans(), label="duplicate gallery rows") and N > 1:
            g = torch.cat([g[: N // 2], g[: N - N // 2]])
        temperature = data.draw(st.sampled_from([1.0, 0.05, 3.0]), label="temperature")
        kind = data.draw(st.sampled_from(["none", "exact", "table"]), label="bias")
        bias = None
        if kind != "none":
            u_q = draw_vector(data, Q, dtype, device, -0.5, 1.5, "u_q")
            u_g = draw_vector(data, N, dtype, device, -0.5, 1.5, "u_g")
            if kind == "exact":
                bias = (u_q, u_g, *draw_mlp(data, dtype, device))
            else:
                P = data.draw(st.integers(2, 300), label="table points")
                gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 31 - 1), label="table seed"))
                bias = (u_q, u_g, torch.randn(P, generator=gen, dtype=torch.float32).to(device))
        exclude = None
        if data.draw(st.booleans(), label="exclude") and Q:
            m = data.draw(st.integers(0, 5), label="exclude width")
            gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 31 - 1), label="exclude seed"))
            exclude = torch.randint(-1, N, (Q, m), generator=gen).to(device)
        vals, idx = tempokern.ctd_topk(q, g, k, temperature=temperature, bias=bias, exclude=exclude)
        # the reference in float64 on the same inputs; the scores the op returns must be the reference's
        # scores of the rows it returns, and those rows must be a top-k (near-ties may swap)
        b64 = None if bias is None else tuple(t if kind == "table" and i == 2 else t.double()  # (the table: float32)
                                              for i, t in enumerate(bias))
        s = ctd_scores(q.double(), g.double(), temperature=temperature, bias=b64)
        if exclude is not None and exclude.numel():
            keep = exclude >= 0
            rows = torch.arange(Q, device=device)[:, None].expand_as(exclude)
            s[rows[keep], exclude[keep]] = float("-inf")
        want_vals, _ = sorted_topk(s, k)
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        assert vals.dtype == acc and idx.dtype == torch.int64 and vals.shape == (Q, k) == idx.shape
        fin = s[torch.isfinite(s)]
        tol = 1e-9 if dtype == torch.float64 else 2e-4 * (1 + (float(fin.abs().max()) if fin.numel() else 0.0))
        close(vals, want_vals, torch.float64, "ctd_topk values", scale=tol / 1e-9)
        valid = idx >= 0
        assert torch.equal(valid, torch.isfinite(want_vals)), "ctd_topk: -1 slots differ from the reference's"
        got = s.gather(1, idx.clamp(min=0))
        torch.testing.assert_close(torch.where(valid, got, 0.0), torch.where(valid, vals.double(), 0.0),
                                   rtol=0, atol=tol, msg=lambda m: f"ctd_topk: returned values vs their rows: {m}")
        for r in range(Q):  # no row returned twice
            row = idx[r][valid[r]]
            assert row.unique().numel() == row.numel(), f"ctd_topk: row {r} repeats a gallery row: {row.tolist()}"
    _run(device, 75, 20, body)


# ---- multipos_infonce / Re3Loss --------------------------------------------------------------------------

def test_fuzz_multipos_infonce(device):
    def body(data):
        dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
        B = data.draw(st.integers(0, 30), label="B")
        H = data.draw(st.integers(1, 40), label="H")
        q = draw_matrix(data, B, H, dtype, device, name="q")
        d = draw_matrix(data, B, H, dtype, device, name="d")
        qs, ds = draw_spans(data, B, device, "q_span"), draw_spans(data, B, device, "d_span")
        temperature = data.draw(st.sampled_from([0.05, 0.5, 2.0]), label="temperature")
        symmetric = data.draw(st.booleans(), label="symmetric")
        extra = None
        if data.draw(st.booleans(), label="extra_neg"):
            extra = draw_matrix(data, data.draw(st.integers(0, 12), label="N"), H, dtype, device, name="extra_neg")
        bias_kind = data.draw(st.sampled_from(["none", "exact", "table"]), label="bias")
        bias, points = None, None
        if bias_kind != "none":
            bias = (draw_vector(data, B, dtype, device, -0.5, 1.5, "u_q"),
                    draw_vector(data, B, dtype, device, -0.5, 1.5, "u_d"), *draw_mlp(data, dtype, device))
            points = 4097 if bias_kind == "table" else None
        nb = 0 if bias is None else 7
        grp = {}
        if data.draw(st.booleans(), label="groups"):  # group-scoped positives
            ng = data.draw(st.integers(1, 4), label="groups count")
            grp = {k: torch.tensor(data.draw(st.lists(st.integers(0, ng - 1), min_size=B, max_size=B), label=k),
                                   dtype=torch.int64, device=device) for k in ("q_group", "d_group")}

        def op(q, d, extra, *b):
            return tempokern.multipos_infonce(q, d, qs, ds, temperature=temperature, bias=b or None, extra_neg=extra,
                                              symmetric=symmetric, bias_table_points=points, **grp)

        def refop(q, d, extra, *b):
            return ref.multipos_infonce(q, d, _i64(qs), _i64(ds), temperature=temperature, bias=b or None,
                                        extra_neg=extra, symmetric=symmetric, bias_table_points=points, **grp)
        ins = [q, d, extra] + (list(bias) if nb else [])
        if extra is None:
            compare_with_grads(lambda q, d, *b: op(q, d, None, *b), lambda q, d, *b: refop(q, d, None, *b),
                               [q, d, *ins[3:]], dtype, "multipos_infonce", scale=1 / temperature)
        else:
            compare_with_grads(op, refop, ins, dtype, "multipos_infonce", scale=1 / temperature)
    _run(device, 60, 15, body)


def test_fuzz_re3_loss(device):
    def body(data):
        dtype = data.draw(st.sampled_from([torch.float32, torch.float64]), label="dtype")
        B = data.draw(st.integers(0, 24), label="B")
        H = data.draw(st.integers(1, 32), label="H")
        q = torch.nn.functional.normalize(draw_matrix(data, B, H, dtype, device, special=False, name="q"), dim=-1)
        d = torch.nn.functional.normalize(draw_matrix(data, B, H, dtype, device, special=False, name="d"), dim=-1)
        d_tw = None
        if data.draw(st.booleans(), label="d_tw"):
            d_tw = torch.nn.functional.normalize(draw_matrix(data, B, H, dtype, device, special=False, name="tw"), dim=-1)
        ids = None
        if data.draw(st.booleans(), label="doc_ids") and B:
            gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 31 - 1), label="doc_ids seed"))
            ids = torch.randint(0, max(1, B // 2), (B,), generator=gen).to(device)
            d = d[ids]  # equal ids are the same document
        kw = dict(temperature=data.draw(st.sampled_from([0.05, 0.5]), label="temperature"),
                  margin=data.draw(st.sampled_from([0.0, 0.1, 0.5]), label="margin"),
                  lambda_hard=0.3, lambda_tw=0.2, tw_in_nce=data.draw(st.booleans(), label="tw_in_nce"),
                  dedup=data.draw(st.booleans(), label="dedup"))
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss, parts = Re3Loss(**kw)(q, d, d_tw, ids)
        want, wparts = ref.re3_loss(q.double(), d.double(), None if d_tw is None else d_tw.double(), ids, **kw)
        for key in ("nce", "hard", "tw", "total"):
            close(parts[key], wparts[key], dtype, f"Re3Loss {key}", scale=1 / kw["temperature"])
        # the hardest column: the op's choice must have the reference's score (near-ties may pick another)
        hc, whc = parts["hardest_col"], wparts["hardest_col"]
        assert torch.equal(hc >= 0, whc >= 0), f"Re3Loss hardest_col: {hc.tolist()} vs {whc.tolist()}"
        if B:
            cos = q.double() @ d.double().t()
            ok = hc >= 0
            torch.testing.assert_close(cos.gather(1, hc.clamp(min=0)[:, None])[ok], cos.gather(1, whc.clamp(min=0)[:, None])[ok],
                                       rtol=0, atol=1e-4 if dtype == torch.float32 else 1e-9)
    _run(device, 50, 15, body)


# ---- matryoshka_infonce ------------------------------------------------------------------------------

def test_fuzz_matryoshka_infonce(device):
    def body(data):
        dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
        B = data.draw(st.integers(1, 24), label="B")
        H = data.draw(st.integers(1, 48), label="H")
        symmetric = data.draw(st.booleans(), label="symmetric")
        Bd = B if symmetric else B + data.draw(st.integers(0, 6), label="extra documents")
        normalize = data.draw(st.booleans(), label="normalize")
        # normalize=True: no all-zero rows. normalize's gradient at a zero row is 1 / eps = 1e12 times the score
        # gradient, so a rounding-level score gradient (the reference's is exactly 0 where the loss is constant,
        # e.g. B = 1) becomes an arbitrary number there: a comparison of noise, not of the kernels
        special = tuple(k for k in SPECIALS if k != "zeros") if normalize else SPECIALS
        q = draw_matrix(data, B, H, dtype, device, special=special, name="q")
        d = draw_matrix(data, Bd, H, dtype, device, special=special, name="d")
        dims = sorted(set(data.draw(st.lists(st.integers(1, H), min_size=1, max_size=4), label="dims")))
        dims = data.draw(st.permutations(dims), label="dims order")
        weights = data.draw(st.one_of(st.none(), st.lists(st.floats(0.0, 2.0), min_size=len(dims),
                                                           max_size=len(dims))), label="weights")
        spans = data.draw(st.booleans(), label="spans") and symmetric
        qs = ds = None
        if spans:
            qs, ds = draw_spans(data, B, device, "q_span"), draw_spans(data, Bd, device, "d_span")
        extra = None
        if data.draw(st.booleans(), label="extra_neg"):
            extra = draw_matrix(data, data.draw(st.integers(1, 8), label="N"), H, dtype, device, special=special,
                                name="extra_neg")
        bias, points = None, None
        if spans and data.draw(st.booleans(), label="bias"):
            bias = (draw_vector(data, B, dtype, device, -0.5, 1.5, "u_q"),
                    draw_vector(data, Bd, dtype, device, -0.5, 1.5, "u_d"), *draw_mlp(data, dtype, device))
            points = data.draw(st.sampled_from([None, 4097]), label="bias_table_points")
        temperature = data.draw(st.sampled_from([0.05, 0.5]), label="temperature")
        kw = dict(temperature=temperature, weights=weights, symmetric=symmetric, normalize=normalize,
                  bias_table_points=points)
        nb = 0 if bias is None else 7

        def op(q, d, extra, *b):
            return tempokern.matryoshka_infonce(q, d, dims, extra_neg=extra, q_span=qs, d_span=ds, bias=b or None, **kw)

        def refop(q, d, extra, *b):
            return ref.matryoshka_infonce(q, d, dims, extra_neg=extra, q_span=None if qs is None else _i64(qs),
                                          d_span=None if ds is None else _i64(ds), bias=b or None, **kw)
        ins = [q, d] + ([] if extra is None else [extra]) + (list(bias) if nb else [])
        if extra is None:
            compare_with_grads(lambda q, d, *b: op(q, d, None, *b), lambda q, d, *b: refop(q, d, None, *b), ins, dtype,
                               "matryoshka_infonce", scale=len(dims) * 2 / temperature)
        else:
            compare_with_grads(op, refop, ins, dtype, "matryoshka_infonce", scale=len(dims) * 2 / temperature)
    _run(device, 50, 12, body)


# ---- calendar ------------------------------------------------------------------------------------

def test_fuzz_calendar(device):
    def body(data):
        dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
        B = data.draw(st.integers(0, 40), label="B")
        sizes = data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=8), label="level sizes")
        logits = [draw_matrix(data, B, n, dtype, device, name=f"logits[{i}]") for i, n in enumerate(sizes)]
        tau = data.draw(st.sampled_from([1.0, 0.1, 4.0]), label="tau")
        if data.draw(st.booleans(), label="context"):
            dim = data.draw(st.integers(1, 40), label="dim")
            compare_with_grads(lambda *x: tempokern.calendar_context(list(x), dim, tau),
                               lambda *x: ref.calendar_context(list(x), dim, tau), logits, dtype, "calendar_context")
        else:
            compare_with_grads(lambda *x: tempokern.calendar_scalar(list(x), tau),
                               lambda *x: ref.calendar_scalar(list(x), tau), logits, dtype, "calendar_scalar")
    _run(device, 60, 20, body)
