"""Bad and edge-case inputs of every op, in one table: each case is an op call and what it must do, either
raise (exception type + a fragment of the message naming the argument) or return what tempokern.reference
(plain torch) returns, NaN included (NaN where the reference has NaN, the same finite values elsewhere).
Cases marked for the emulator also run the CUDA kernels (tools/cuda_emu)."""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import pytest
import torch

import tempokern
from tempokern import reference as ref
from _emu_support import cuda_emulator
from tempokern.nn import CTDLoss, OffsetBias, Re3Loss

H, B, HID, D = 8, 5, 6, 4


def _bias(Bq=B, Bd=B, dtype=torch.float32, nan=None, device="cpu"):
    g = torch.Generator().manual_seed(1)
    t = [torch.rand(Bq, generator=g, dtype=dtype), torch.rand(Bd, generator=g, dtype=dtype),
         torch.randn(HID, D, generator=g, dtype=dtype), torch.randn(HID, generator=g, dtype=dtype),
         torch.randn(1, HID, generator=g, dtype=dtype), torch.randn(1, generator=g, dtype=dtype),
         torch.tensor(0.7, dtype=dtype)]
    if nan is not None:  # (index into the 7-tuple, element)
        k, idx = nan
        t[k][idx] = float("nan")
    return tuple(x.to(device) for x in t)


def _emb(n, dtype=torch.float32, seed=2, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, H, generator=g, dtype=dtype).to(device)


def _spans(n, device="cpu"):
    a = torch.arange(n, device=device)
    return (a, a + 1)


def _u64(values):
    return torch.tensor(values, dtype=torch.uint64)


# q_span = (0, 2^63 + 10) against d_span = (5, 5): the intervals overlap, but wrapped to int64 they do not
_BIG_Q = (_u64([0] * B), _u64([2 ** 63 + 10] * B))
_SMALL_D = (_u64([5] * B), _u64([5] * B))
_META = torch.device("meta")


def _meta(ts):
    return tuple(t.to(_META) for t in ts)


@dataclasses.dataclass
class Case:
    name: str
    call: Callable                      # () -> result, the product op
    raises: Optional[type] = None       # expected exception type ...
    match: str = ""                     # ... and a fragment of its message (a regex)
    like: Optional[Callable] = None     # () -> the reference's result (compared with NaN positions)
    emu: bool = False                   # also run on the CUDA emulator
    cpu: bool = True                    # run on the CPU kernels
    launches: bool = True               # (on the emulator) the call launches a kernel


def _grads(fn, inputs):
    """(out, grads of out.sum() w.r.t. inputs) with fresh leaves; float outputs only."""
    leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out = fn(*leaves)
    first = out[0] if isinstance(out, tuple) else out
    grads = torch.autograd.grad(first.double().sum(), [x for x in leaves if x.requires_grad], allow_unused=True)
    return (out, *grads)


def _ob(nan):
    inputs = _bias(nan=nan, dtype=torch.float64)
    return (lambda: _grads(tempokern.offset_bias, inputs), lambda: _grads(ref.offset_bias, inputs))


def _ob_empty():
    inputs = (torch.zeros(0, dtype=torch.float64), *_bias(dtype=torch.float64)[1:])
    return (lambda: _grads(tempokern.offset_bias, inputs), lambda: _grads(ref.offset_bias, inputs))


def _mp_zero_row_nan():
    q, d, s = torch.zeros(1, H, dtype=torch.float64), _emb(1, torch.float64, seed=3), _spans(1)
    d[0, 2] = float("nan")   # 0 * NaN is NaN in torch's product: the loss is NaN
    return (lambda: tempokern.multipos_infonce(q, d, s, s, temperature=0.1, symmetric=False),
            lambda: ref.multipos_infonce(q, d, s, s, temperature=0.1, symmetric=False))


def _topk(nan, k=3):
    q, g = _emb(B), _emb(B + 2, seed=3)
    bias = _bias(B, B + 2, nan=nan)
    return (lambda: tempokern.ctd_topk(q, g, k, bias=bias)[0],
            lambda: ref.ctd_topk(q, g, k, bias=bias)[0])


def _checked(fn):
    """fn() with the finite-value checks on (TEMPOKERN_CHECK=1)."""
    def run():
        was = tempokern.debug_checks_enabled()
        tempokern.set_debug_checks(True)
        try:
            return fn()
        finally:
            tempokern.set_debug_checks(was)
    return run


def _mp_empty(dtype=torch.float32, bias=False):
    q, d, s = _emb(0, dtype), _emb(0, dtype, seed=3), _spans(0)
    kw = dict(temperature=0.1, bias=_bias(0, 0, dtype) if bias else None)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    return (lambda: _grads(lambda q, d: tempokern.multipos_infonce(q, d, s, s, **kw), (q, d)),
            lambda: _grads(lambda q, d: ref.multipos_infonce(q, d, s, s, **kw).to(acc), (q, d)))


def _re3_empty():
    q, d = _emb(0), _emb(0, seed=3)

    def parts(fn):
        loss, p = fn()
        return (loss, p["nce"], p["hard"], p["tw"], p["hardest_col"])
    return (lambda: parts(lambda: Re3Loss()(q, d)), lambda: parts(lambda: ref.re3_loss(q, d)))


def _ctd_empty():
    q, d, s = _emb(0), _emb(0, seed=3), _spans(0)
    return (lambda: CTDLoss(0.1)(q, d, s, s),
            lambda: ref.multipos_infonce(torch.nn.functional.normalize(q, dim=-1),
                                         torch.nn.functional.normalize(d, dim=-1), s, s, temperature=0.1))


def _mp_meta():
    q, d, s = _emb(B), _emb(B, seed=3), _spans(B)
    args = (_meta((q, d)), _meta(s), _meta(s), _meta(_bias()))
    return (lambda: tempokern.multipos_infonce(args[0][0], args[0][1], args[1], args[2], temperature=0.1,
                                               bias=args[3]),
            lambda: torch.empty((), dtype=torch.float32, device=_META))


def _topk_meta():
    q, g = _meta((_emb(B), _emb(B + 2, seed=3)))
    bias = _meta(_bias(B, B + 2))
    return (lambda: tempokern.ctd_topk(q, g, 3, bias=bias),
            lambda: (torch.empty(B, 3, device=_META), torch.empty(B, 3, dtype=torch.int64, device=_META)))


_lg = [torch.randn(3, 4), torch.randn(3, 6)]
_q, _d, _s = _emb(B), _emb(B, seed=3), _spans(B)

CASES = [
    # NaN in the bias MLP propagates as through torch's relu: forward and every gradient
    Case("offset_bias NaN in w1", *_ob((2, (1, 0)))[:1], like=_ob((2, (1, 0)))[1], emu=True),
    Case("offset_bias NaN in b1", *_ob((3, 2))[:1], like=_ob((3, 2))[1], emu=True),
    # float64 products keep 0 * NaN = NaN (a zero query row against a NaN document)
    Case("multipos_infonce float64 zero row x NaN", *_mp_zero_row_nan()[:1], like=_mp_zero_row_nan()[1], emu=True),
    # no query row: the CUDA backward launched an empty grid (a floating-point exception on the emulator)
    Case("offset_bias Bq=0 backward", *_ob_empty()[:1], like=_ob_empty()[1], emu=True, cpu=False, launches=False),
    # ctd_topk: NaN scores are outside its contract; with the checks on, a NaN in the MLP is an error
    Case("ctd_topk exact bias, NaN in w1, checks on", _checked(_topk((2, (0, 1)))[0]), ValueError, r"bias w1 .*NaN"),
    Case("ctd_topk exact bias, NaN in b1, checks on", _checked(_topk((3, 4))[0]), ValueError, r"bias b1 .*NaN"),
    Case("ctd_topk table bias, NaN in u_g, checks on",
         _checked(lambda: tempokern.ctd_topk(_q, _d, 2, bias=(_bias()[0], _bias(nan=(1, 3))[1], torch.zeros(5)))),
         ValueError, r"bias u_g .*NaN"),
    # uint64 values >= 2^63 are outside int64: rejected, naming the argument
    Case("multipos_infonce uint64 span", lambda: tempokern.multipos_infonce(_q, _d, _BIG_Q, _SMALL_D, temperature=0.1),
         ValueError, r"q_span end .*2\*\*63"),
    Case("multipos_infonce uint64 d_span", lambda: tempokern.multipos_infonce(_q, _d, _SMALL_D, _BIG_Q, temperature=0.1),
         ValueError, r"d_span end .*2\*\*63"),
    Case("CTDLoss uint64 span", lambda: CTDLoss(0.1)(_q, _d, _BIG_Q, _SMALL_D), ValueError, r"q_span end .*2\*\*63"),
    Case("matryoshka_infonce uint64 span",
         lambda: tempokern.matryoshka_infonce(_q, _d, [4, 8], q_span=_BIG_Q, d_span=_SMALL_D, temperature=0.1),
         ValueError, r"q_span end .*2\*\*63"),
    Case("Re3Loss uint64 doc_ids", lambda: Re3Loss()(_q, _d, doc_ids=_u64([2 ** 63 + 1, 1, 2, 3, 4])),
         ValueError, r"doc_ids .*2\*\*63"),
    Case("ctd_topk uint64 exclude", lambda: tempokern.ctd_topk(_q, _d, 2, exclude=_u64([[2 ** 64 - 1]] * B)),
         ValueError, r"exclude .*2\*\*63"),
    # an empty batch: the reference's result (NaN: the mean over no rows), gradients of the right shapes
    Case("multipos_infonce B=0", _mp_empty()[0], like=_mp_empty()[1]),
    Case("multipos_infonce B=0 with a bias", _mp_empty(bias=True)[0], like=_mp_empty(bias=True)[1]),
    Case("multipos_infonce B=0 float64", _mp_empty(torch.float64)[0], like=_mp_empty(torch.float64)[1]),
    Case("CTDLoss B=0", _ctd_empty()[0], like=_ctd_empty()[1]),
    Case("Re3Loss B=0", _re3_empty()[0], like=_re3_empty()[1]),
    # meta tensors with a bias: the fake implementation (shapes and dtypes, no values)
    Case("multipos_infonce meta with a bias", _mp_meta()[0], like=_mp_meta()[1]),
    Case("ctd_topk meta with an exact bias", _topk_meta()[0], like=_topk_meta()[1]),
    # table sizes are checked before anything is allocated
    Case("offset_bias table_points=2**40", lambda: tempokern.offset_bias(*_bias(), table_points=2 ** 40),
         ValueError, r"table_points must be <= "),
    Case("multipos_infonce bias_table_points=2**40",
         lambda: tempokern.multipos_infonce(_q, _d, _s, _s, temperature=0.1, bias=_bias(), bias_table_points=2 ** 40),
         ValueError, r"bias_table_points must be <= "),
    Case("matryoshka_infonce bias_table_points=2**40",
         lambda: tempokern.matryoshka_infonce(_q, _d, [4, 8], q_span=_s, d_span=_s, temperature=0.1, bias=_bias(),
                                              bias_table_points=2 ** 40),
         ValueError, r"bias_table_points must be <= "),
    Case("CTDLoss bias_table_points=2**40", lambda: CTDLoss(0.1, OffsetBias(4, 4), bias_table_points=2 ** 40),
         ValueError, r"bias_table_points must be <= "),
    Case("OffsetBias table_points=2**40", lambda: OffsetBias(4, 4, table_points=2 ** 40),
         ValueError, r"table_points must be <= "),
    # a temperature / tau whose reciprocal overflows the compute dtype: ctd_topk's rule everywhere
    Case("calendar_scalar tau=1e-320", lambda: tempokern.calendar_scalar(_lg, tau=1e-320), ValueError, r"tau .*too small"),
    Case("calendar_context tau=1e-320", lambda: tempokern.calendar_context(_lg, 4, tau=1e-320), ValueError,
         r"tau .*too small"),
    Case("calendar_scalar tau=1e-40 float32", lambda: tempokern.calendar_scalar(_lg, tau=1e-40), ValueError,
         r"tau .*too small.*float32"),
    Case("multipos_infonce temperature=1e-320",
         lambda: tempokern.multipos_infonce(_q, _d, _s, _s, temperature=1e-320), ValueError, r"temperature .*too small"),
    Case("multipos_infonce temperature=1e-40 float32",
         lambda: tempokern.multipos_infonce(_q, _d, _s, _s, temperature=1e-40), ValueError,
         r"temperature .*too small.*float32"),
    Case("matryoshka_infonce temperature=1e-320",
         lambda: tempokern.matryoshka_infonce(_q, _d, [4, 8], temperature=1e-320), ValueError, r"temperature .*too small"),
    Case("CTDLoss temperature=1e-320", lambda: CTDLoss(1e-320), ValueError, r"temperature .*too small"),
    Case("Re3Loss temperature=1e-320", lambda: Re3Loss(1e-320), ValueError, r"temperature .*too small"),
]


def _same(out, want, path="result"):
    """out equals want: same type / shape / dtype / device; NaN exactly where want has NaN, the other values
    close (integers equal)."""
    if isinstance(want, (tuple, list)):
        assert isinstance(out, (tuple, list)) and len(out) == len(want), f"{path}: {type(out)} vs {type(want)}"
        for i, (o, w) in enumerate(zip(out, want)):
            _same(o, w, f"{path}[{i}]")
        return
    if want is None:
        assert out is None, path
        return
    assert isinstance(out, torch.Tensor), f"{path}: {type(out).__name__}"
    assert out.shape == want.shape and out.dtype == want.dtype and out.device == want.device, (
        f"{path}: {tuple(out.shape)} {out.dtype} {out.device} vs {tuple(want.shape)} {want.dtype} {want.device}")
    if out.device.type == "meta":
        return
    if not want.is_floating_point():
        assert torch.equal(out, want), f"{path}: {out} vs {want}"
        return
    assert torch.equal(out.isnan(), want.isnan()), (
        f"{path}: NaN at {out.isnan().nonzero().tolist()}, the reference at {want.isnan().nonzero().tolist()}")
    torch.testing.assert_close(out, want, equal_nan=True, rtol=1e-5, atol=1e-5, msg=lambda m: f"{path}: {m}")


_PARAMS = [pytest.param(c, "cpu", id=c.name) for c in CASES if c.cpu] + [
    pytest.param(c, "emu", id=c.name + " [emu]", marks=pytest.mark.emu) for c in CASES if c.emu]


@pytest.mark.parametrize("case,dev", _PARAMS)
def test_bad_input(case, dev, request):
    emu = request.getfixturevalue("cuda_emu") if dev == "emu" else None
    launches = emu.emu_launch_count() if emu is not None else 0
    with cuda_emulator(emu):
        if case.raises is not None:
            with pytest.raises(case.raises, match=case.match):
                case.call()
            return
        out = case.call()
    if emu is not None and case.launches:
        assert emu.emu_launch_count() > launches, "the case ran no kernel on the CUDA emulator"
    with cuda_emulator(None):
        want = case.like()
    _same(out, want)
