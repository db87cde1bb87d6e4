#!/usr/bin/env python
"""One command for GPU numbers: each op's default path and candidates (tempokern._ops.dispatch) against eager
torch, torch.compile of the reference and the bare matmul yardstick.

    python benchmarks/gpu_suite.py                            # full suite, one GPU, < 8 minutes on an H100
    python benchmarks/gpu_suite.py --quick                    # small sizes: smoke test of the whole suite
    python benchmarks/gpu_suite.py --only 'multipos_infonce/no bias' --csv /tmp/gpu.csv --md /tmp/gpu.md
    python benchmarks/gpu_suite.py --device emu --csv /tmp/emu.csv   # tiny sizes on the CUDA emulator

Builds nothing: it imports the tempokern that is there (the in-place build of this checkout if
tempokern/_C*.so exists, else the installed package) and stops with a clear message if that build has no
CUDA kernels. Appends to one long-format CSV (--csv, default benchmarks/results/gpu.csv; columns
date, device, commit, src_hash, op, case, B, impl, metric, value, note; one row per (op, case, B, impl, metric),
written as it goes, so a killed run keeps its rows); --md PATH also writes the tables as Markdown.

impl: the columns come from the dispatch table. tempokern: the op's default path (TEMPOKERN_EXPERIMENTAL
empty during its calls); tempokern:<name>: the same op with candidate <name> enabled (TEMPOKERN_EXPERIMENTAL=<name>
during its calls), one column per candidate whose ops include the case's op; eager (tempokern.reference or the
plain formula a user writes), eager_chunked (the same over gallery chunks, ctd_topk), compile
(torch.compile(reference, dynamic=False), compiled once per shape), compile_autochunk (the same with inductor's
auto-chunker on: torch._inductor.config.auto_chunker.enable), inf_cl (Inf-CL's cal_inf_loss, both directions, on
the one-positive case only: it takes one positive per row and no bias; import-guarded: a status row says why it
did not run), matmul (the bare q @ d.T / q @ g.T
yardstick), single (matryoshka_infonce: one level at the full dim through multipos_infonce, the yardstick).
metric: time_ms (CUDA events around one step, median of
the timed runs after one warm-up, inputs rotated through several copies when one copy fits in L2),
src_hash: the hash of the sources of the path the row measured (benchmarks/_sources.py: a tempokern column's
kernels, bindings and wrappers, a baseline's reference formulation), so a table can mark a figure whose sources
changed since; time_ms_pipelined (CUDA, steps under 50 ms: up to 30 steps back to back between two events, no synchronize
between them, per step: what a training loop that does not read the loss every step sees),
extra_peak_mb (torch.cuda.max_memory_allocated above what was allocated before the step, first timed run),
compile_s (first call of a compiled function), floor_ms (the lower bound from the flop/byte count, see each
case), agreement_abs:<q> / agreement_rel:<q> (max |impl - float64 reference| and that over max |reference|,
for the loss/output and every gradient, on the same inputs; a random sub-batch where the float64 reference
would not fit, said in the note), agreement (the largest agreement_rel), err_vs_torch:<q> (a tempokern
column's abs error over eager torch's in the same dtype: the 2x rule wants <= 2), topk_index_match (fraction
of top-k indices equal to the float64 reference's), status (ok / out of memory / unsupported: why / skipped:
why / error: what). --device cpu runs tiny sizes on the CPU kernels and --device emu tiny sizes on the CUDA
kernels through the CPU emulator (tools/cuda_emu): both exist for tests and tools/gpu_check.sh --dry.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import datetime as _dt
import gc
import importlib
import inspect
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parent.parent
if list(REPO.joinpath("tempokern").glob("_C*.so")) and str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # the in-place developer build of this checkout (tools/dev_build.sh)

import torch  # noqa: E402

from tempokern._ops import dispatch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _sources  # noqa: E402  (beside this script)

FIELDS = ["date", "device", "commit", "src_hash", "op", "case", "B", "impl", "metric", "value", "note"]
DEFAULT_CSV = REPO / dispatch.GPU_CSV
BASELINES = ("eager", "eager_chunked", "compile", "compile_autochunk", "inf_cl", "matmul",
             "single")   # single: matryoshka_infonce's yardstick
#: the torch.compile columns (compiled last, each skipped when less than COMPILE_RESERVE_S of the budget is left)
COMPILED = ("compile", "compile_autochunk")


def op_name(op: str) -> str:
    """The suite's op name of a dispatch-table op ("multipos_infonce / CTDLoss" -> "multipos_infonce")."""
    return op.split(" / ")[0].strip()


def candidates_for(op: str) -> List[str]:
    """The candidates (dispatch.CANDIDATES) whose ops include the suite op `op`, in table order."""
    return [c.name for c in dispatch.CANDIDATES if op in {op_name(o) for o in c.ops}]


def candidate_impl(name: str) -> str:
    return f"tempokern:{name}"


#: Every impl column, in table order: the default, one per candidate, the baselines.
IMPLS = ("tempokern",) + tuple(candidate_impl(c.name) for c in dispatch.CANDIDATES) + BASELINES


def impl_env(impl: str) -> Optional[dict]:
    """The environment of a tempokern column's calls: the default runs with no candidate enabled,
    tempokern:<name> with exactly candidate <name>; None for the baselines."""
    if impl == "tempokern":
        return {dispatch.ENV: ""}
    if impl.startswith("tempokern:"):
        return {dispatch.ENV: impl.split(":", 1)[1]}
    return None


def is_tempokern(impl: str) -> bool:
    return impl == "tempokern" or impl.startswith("tempokern:")


H, HIDDEN, D_FEAT, TEMPERATURE, TABLE_POINTS, MONTHS = 768, 32, 32, 0.05, 4097, 2030
COMPILE_RESERVE_S = 60   # no torch.compile case starts with less of the time budget left


class Unsupported(Exception):
    """The installed tempokern lacks a keyword/feature the case needs (reported as a row, not a crash)."""


class Skipped(Exception):
    pass


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and "out of memory" in str(e).lower())


def failure(e: BaseException) -> str:
    return "out of memory" if _is_oom(e) else f"error: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"


def free_memory(dev: torch.device, collect: bool = False) -> None:
    """Hand cached CUDA blocks back (after a failure also run the cycle collector: a full gc.collect costs
    ~0.4 s once torch._dynamo is imported, too much to pay after every measurement)."""
    if collect:
        gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()


def accepts(fn, keyword: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return keyword in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


def tk():
    import tempokern
    return tempokern


def ref():
    import tempokern.reference
    return tempokern.reference


# ---- timing --------------------------------------------------------------------------------------------------

@dataclass
class Timing:
    ms: float
    peak_mb: Optional[float]
    warm_s: float
    runs: int
    pipelined_ms: Optional[float] = None
    pipelined_runs: int = 0


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


ULP32 = float(torch.finfo(torch.float32).eps)   # err_vs_torch's floor, per unit of magnitude
PIPELINE_MAX_MS = 50.0   # steps this fast also get time_ms_pipelined
PIPELINE_STEPS = 30


def time_step(fns: Sequence[Callable[[], object]], dev: torch.device, repeats: int, budget_s: float) -> Timing:
    """One warm-up call (for compile: the compilation), then up to `repeats` timed calls cycling through
    `fns` (one per rotating input set); the first timed call decides how many fit in about `budget_s`
    (at least one). CUDA: synchronize, event, step, event, synchronize per call (the step's whole GPU time,
    launch gaps included); the peak memory of the first timed call above what was allocated before it."""
    sync(dev)
    t0 = time.perf_counter()
    out = fns[0]()
    sync(dev)
    warm = time.perf_counter() - t0
    del out
    times, peak, n, r = [], None, repeats, 0
    while r < n:
        f = fns[(r + 1) % len(fns)]
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            if r == 0:
                base = torch.cuda.memory_allocated(dev)
                torch.cuda.reset_peak_memory_stats(dev)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = f()
            end.record()
            torch.cuda.synchronize(dev)
            times.append(start.elapsed_time(end))
            if r == 0:
                peak = (torch.cuda.max_memory_allocated(dev) - base) / 2 ** 20
        else:
            t = time.perf_counter()
            out = f()
            times.append((time.perf_counter() - t) * 1e3)
        del out
        if r == 0:
            n = max(1, min(repeats, int(budget_s * 1e3 / max(times[0], 1e-3))))
        r += 1
    med = statistics.median(times)
    pipe, k = None, 0
    if dev.type == "cuda" and med < PIPELINE_MAX_MS:
        # the same steps back to back, no synchronize between them (a training loop that does not read the loss
        # every step): host work of one step overlaps the GPU work of the previous one
        k = max(3, min(PIPELINE_STEPS, int(budget_s * 1e3 / max(med, 1e-3))))
        torch.cuda.synchronize(dev)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for r in range(k):
            out = fns[(r + 1) % len(fns)]()
            del out
        end.record()
        torch.cuda.synchronize(dev)
        pipe = start.elapsed_time(end) / k
    return Timing(med, peak, warm, n, pipe, k)


# ---- agreement -----------------------------------------------------------------------------------------------

def compare(got: Sequence[Tuple[str, torch.Tensor]], want: Sequence[Tuple[str, torch.Tensor]]) -> Dict[str, tuple]:
    """{quantity: (max abs error, relative error)} of `got` vs the float64 `want`. Relative = abs / max|want|,
    the denominator floored for gradients at 1e-3 of the largest gradient magnitude (a gradient that is
    zero in exact arithmetic, like d loss / d b2 without extra negatives, is rounding noise)."""
    mags = {n: (w.abs().max().item() if w.numel() else 0.0) for n, w in want}
    gmax = max([m for n, m in mags.items() if n.startswith("grad")], default=0.0)
    res = {}
    for (n, g), (n2, w) in zip(got, want):
        assert n == n2, (n, n2)
        if g is None or g.shape != w.shape:
            res[n] = (math.inf, math.inf)
            continue
        err = (g.double() - w).abs().max().item() if w.numel() else 0.0
        den = mags[n] if not n.startswith("grad") else max(mags[n], 1e-3 * gmax)
        res[n] = (err, err / den if den > 0 else (0.0 if err == 0 else math.inf))
    return res


def with_grads(out: torch.Tensor, leaves: Sequence[torch.Tensor], names: Sequence[str], gout=None, label="loss"):
    """[(label, out), (grad <name>, d out / d leaf) ...]; gout the upstream gradient (None: out is a scalar)."""
    grads = torch.autograd.grad(out, list(leaves), grad_outputs=gout, allow_unused=True)
    return [(label, out.detach())] + [(f"grad {n}", None if g is None else g.detach()) for n, g in zip(names, grads)]


# ---- cases ---------------------------------------------------------------------------------------------------

@dataclass
class Case:
    op: str
    case: str
    size: str
    make: Callable[[int], dict]                  # seed -> one input set (dict)
    steps: Dict[str, Callable[[dict], Callable[[], object]]]   # impl -> (inputs -> zero-arg step)
    # (inputs, impls) -> ({impl: {quantity: (abs, rel)}}, note)
    agree: Optional[Callable[[dict, List[str]], Tuple[dict, str]]] = None
    mem_bytes: Dict[str, float] = field(default_factory=dict)   # impl -> estimated extra bytes (known-OOM skip)
    scale: float = 1.0                           # work relative to the previous size of the same series
    floor: Optional[Callable[[Dict[str, float]], Tuple[float, str]]] = None    # measured {impl: ms} -> (floor, how)
    key: str = ""

    def __post_init__(self):
        self.key = f"{self.op}/{self.case}/{self.size}"

    def set_bytes(self, inputs: dict) -> int:
        return sum(t.numel() * t.element_size() for t in _tensors(inputs))


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)


def _gen(dev, seed):
    return torch.Generator(device=dev).manual_seed(seed)


def _unit_rows(n, h, dev, dtype, g):
    return torch.nn.functional.normalize(torch.randn(n, h, device=dev, generator=g), dim=1).to(dtype)


def _leaf(t):
    return t.detach().clone().requires_grad_()


def _bias_params(dev, seed):
    """(w1, b1, w2, b2, scale) of a tempokern.nn.OffsetBias(32, 32) at its nn.Linear init, scale 0.5
    (the module's own 0 would switch the bias and its weight gradients off)."""
    from tempokern.nn import OffsetBias
    from tempokern.nn.offset_bias import bias_params
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        m = OffsetBias(D_FEAT, HIDDEN)
    with torch.no_grad():
        m.scale.fill_(0.5)
    return tuple(_leaf(p.to(dev)) for p in bias_params(m))


def _spans(n, dev, g):
    s = torch.randint(0, MONTHS - 30, (n,), device=dev, generator=g)
    return s, s + torch.randint(0, 30, (n,), device=dev, generator=g)


BIAS_NAMES = ("u_q", "u_d", "w1", "b1", "w2", "b2", "scale")


# multipos_infonce -----------------------------------------------------------------------------------------------

def loss_inputs(B, dev, dtype, seed, bias: Optional[str]):
    """bias: None (no bias, random spans: several positives per row), "one" (no bias, one positive per row: the
    diagonal, the case Inf-CL takes), "table" or "exact"."""
    g = _gen(dev, seed)
    q, d = _leaf(_unit_rows(B, H, dev, dtype, g)), _leaf(_unit_rows(B, H, dev, dtype, g))
    qs, ds = _spans(B, dev, g), _spans(B, dev, g)
    if bias == "one":   # disjoint spans: each query overlaps its own document only
        s = torch.arange(B, device=dev) * 2
        qs = ds = (s, s)
        bias = None
    inp = {"q": q, "d": d, "q_span": qs, "d_span": ds, "bias": None, "leaves": [q, d], "names": ["q", "d"],
           "mode": bias}
    if bias:
        u_q = _leaf((qs[0] + qs[1]).float() / (2 * (MONTHS - 1)))   # month midpoints on [0, 1]
        u_d = _leaf((ds[0] + ds[1]).float() / (2 * (MONTHS - 1)))
        inp["bias"] = (u_q, u_d) + _bias_params(dev, seed)
        inp["leaves"] += list(inp["bias"])
        inp["names"] += list(BIAS_NAMES)
    return inp


def loss_call(fn, inp, *, check_keyword: bool):
    kw = {"temperature": TEMPERATURE}
    if inp["bias"] is not None:
        kw["bias"] = inp["bias"]
    if inp["mode"] == "table":
        if check_keyword and not accepts(fn, "bias_table_points"):
            raise Unsupported(f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__name__', fn)} has no "
                              "bias_table_points keyword (no table mode in this build)")
        kw["bias_table_points"] = TABLE_POINTS
    return fn(inp["q"], inp["d"], inp["q_span"], inp["d_span"], **kw)


def loss_step(fn_get, check_keyword=True):
    def build(inp):
        fn = fn_get()
        if inp["mode"] == "table" and check_keyword and not accepts(fn, "bias_table_points"):
            loss_call(fn, inp, check_keyword=True)   # raises Unsupported before anything is timed
        leaves = inp["leaves"]
        return lambda: torch.autograd.grad(loss_call(fn, inp, check_keyword=False), leaves)
    return build


def inf_cl_loss():
    """Inf-CL's symmetric contrastive loss with the diagonal as the positives, as a function of (q, d); raises
    Unsupported where it cannot run (not installed, no GPU: it is Triton)."""
    try:
        from inf_cl import cal_inf_loss
    except ImportError as e:
        raise Unsupported(f"Inf-CL is not installed (pip install inf-cl): {e}")
    if not torch.cuda.is_available():
        raise Unsupported("Inf-CL is Triton, GPU only")
    import torch.distributed as dist
    if not dist.is_initialized():   # its ring communication asks for a process group: a group of one
        import tempfile
        store = dist.FileStore(tempfile.mktemp(prefix="tk_infcl_"), 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1)

    def loss(q, d):
        scale = torch.tensor(1.0 / TEMPERATURE, device=q.device)
        return (cal_inf_loss(q, d, scale=scale) + cal_inf_loss(d, q, scale=scale)) / 2
    return loss


def inf_cl_step(inp):
    fn = inf_cl_loss()
    q, d = inp["q"], inp["d"]
    return lambda: torch.autograd.grad(fn(q, d), [q, d])


def run_as(impl: str, call):
    """call() in the environment of column `impl` (impl_env; a plain call() for a baseline)."""
    env = impl_env(impl)
    return with_env(lambda _: call, env)(None)() if env else call()


def with_env(build, settings: dict):
    """The step of `build` with os.environ updated by `settings` (name -> value) during each call (and
    restored after it)."""
    def b(inp):
        fn = build(inp)

        def run():
            old = {name: os.environ.get(name) for name in settings}
            os.environ.update(settings)
            try:
                return fn()
            finally:
                for name, v in old.items():
                    if v is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = v
        return run
    return b


def row_blocks_mm(a, b, max_out_bytes=4 << 30):
    """The bare matmul yardstick a @ b.T, in the inputs' dtype; where the whole product would exceed
    max_out_bytes, in row blocks of at most that output (each block freed before the next: the caching
    allocator hands the same memory back), so that B = 262,144 has a yardstick too."""
    rows = max(1, min(a.shape[0], max_out_bytes // max(1, b.shape[0] * a.element_size())))

    def run():
        with torch.no_grad():
            for r0 in range(0, a.shape[0], rows):
                out = a[r0:r0 + rows] @ b.t()
                del out
        return None
    return run


def subset(inp, idx, dev):
    """The same loss on rows idx of every per-row input (fresh leaves)."""
    q, d = _leaf(inp["q"][idx]), _leaf(inp["d"][idx])
    out = {"q": q, "d": d, "q_span": tuple(t[idx] for t in inp["q_span"]),
           "d_span": tuple(t[idx] for t in inp["d_span"]), "bias": None, "leaves": [q, d], "names": ["q", "d"],
           "mode": inp["mode"]}
    if inp["bias"] is not None:
        b = inp["bias"]
        out["bias"] = (_leaf(b[0][idx]), _leaf(b[1][idx])) + tuple(_leaf(t) for t in b[2:])
        out["leaves"] += list(out["bias"])
        out["names"] += list(BIAS_NAMES)
    return out


def to64(inp):
    out = dict(inp)
    out["q"], out["d"] = _leaf(inp["q"].double()), _leaf(inp["d"].double())
    out["leaves"] = [out["q"], out["d"]]
    if inp["bias"] is not None:
        out["bias"] = tuple(_leaf(t.double()) for t in inp["bias"])
        out["leaves"] += list(out["bias"])
    return out


def loss_agree(max_rows: int, seed: int):
    def agree(inp, impls):
        B = inp["q"].shape[0]
        note = ""
        if B > max_rows:
            g = torch.Generator().manual_seed(seed + 1)
            idx = torch.randperm(B, generator=g)[:max_rows].sort().values.to(inp["q"].device)
            inp = subset(inp, idx, inp["q"].device)
            note = f"on a random sub-batch of {max_rows} of the {B} rows (tempokern and reference alike)"
        i64 = to64(inp)
        want = with_grads(loss_call(ref().multipos_infonce, i64, check_keyword=False), i64["leaves"], i64["names"])
        res = {}
        for impl in impls:
            fused = is_tempokern(impl)
            fn = tk().multipos_infonce if fused else ref().multipos_infonce
            i = subset(inp, slice(None), inp["q"].device)
            call = lambda: with_grads(loss_call(fn, i, check_keyword=fused), i["leaves"], i["names"])  # noqa: E731
            got = run_as(impl, call)
            res[impl] = compare(got, want)
        return res, note
    return agree


def loss_cases(sizes, dev, dtype, seed, compile_fn) -> List[Case]:
    cases = []
    bpp = {None: {"eager": 19.4, "compile": 6.7}, "table": {"eager": 80.0, "compile": 11.0},
           "exact": {"eager": 550.0, "compile": 292.0}}   # bytes per (q, d) pair: H100 report, bf16 (table: estimate)
    bpp["one"] = bpp[None]
    agree_rows = {None: sizes["agree_rows"], "one": sizes["agree_rows"], "table": sizes["agree_rows"],
                  "exact": sizes["agree_rows_exact"]}
    for mode, label, Bs in ((None, "no bias", sizes["loss"]), ("one", "no bias, one positive", sizes["loss_one"]),
                            ("table", f"table bias ({TABLE_POINTS})", sizes["loss_table"]),
                            ("exact", "exact bias", sizes["loss_exact"])):
        prev = None
        for B in Bs:
            steps = {
                "tempokern": loss_step(lambda: tk().multipos_infonce),
                "matmul": lambda inp: row_blocks_mm(inp["q"].detach(), inp["d"].detach()),
                "eager": loss_step(lambda: ref().multipos_infonce, check_keyword=False),
                "compile": loss_step(lambda: compile_fn(ref().multipos_infonce), check_keyword=False),
                "compile_autochunk": loss_step(lambda: compile_fn(ref().multipos_infonce, autochunk=True),
                                               check_keyword=False),
            }
            if mode == "one":
                steps["inf_cl"] = inf_cl_step
            cases.append(Case(
                "multipos_infonce", label, f"B={B}",
                make=(lambda s, B=B, mode=mode: loss_inputs(B, dev, dtype, s, mode)), steps=steps,
                agree=loss_agree(agree_rows[mode], seed),
                mem_bytes={k: v * B * B for k, v in bpp[mode].items()},
                scale=(B / prev) ** 2 if prev else 1.0,
                floor=lambda ms: (4 * ms["matmul"], "4 x the bare q @ d.T (fwd, recompute, dq, dd products)")
                if "matmul" in ms else (math.nan, "")))
            prev = B
    return cases


# matryoshka_infonce ------------------------------------------------------------------------------------

MAT_DIMS = (64, 128, 256, 512, 768)


def mat_inputs(B, dev, dtype, seed):
    g = _gen(dev, seed)
    q = _leaf(torch.randn(B, H, generator=g, device=dev).to(dtype))
    d = _leaf(torch.randn(B, H, generator=g, device=dev).to(dtype))
    return {"q": q, "d": d, "leaves": [q, d], "names": ["q", "d"]}


def mat_step(impl, compile_fn=None):
    """Forward + backward of one Matryoshka step: tempokern (the fused op), single (one level at the full dim
    through the fused multipos_infonce: the yardstick), eager (the ST-style loop, tempokern.reference),
    compile (torch.compile of that loop)."""
    def build(inp):
        q, d = inp["q"], inp["d"]
        if is_tempokern(impl):  # the candidate columns: TEMPOKERN_EXPERIMENTAL set by with_env
            f = lambda: tk().matryoshka_infonce(q, d, MAT_DIMS, temperature=TEMPERATURE)  # noqa: E731
        elif impl == "single":
            ids = torch.arange(q.shape[0], device=q.device)
            f = lambda: tk().multipos_infonce(torch.nn.functional.normalize(q, dim=-1),  # noqa: E731
                                              torch.nn.functional.normalize(d, dim=-1), (ids, ids), (ids, ids),
                                              temperature=TEMPERATURE, symmetric=False)
        else:
            fn = ref().matryoshka_infonce if impl == "eager" else compile_fn(ref().matryoshka_infonce,
                                                                              autochunk=impl == "compile_autochunk")
            f = lambda: fn(q, d, MAT_DIMS, temperature=TEMPERATURE)  # noqa: E731
        return lambda: torch.autograd.grad(f(), [q, d])
    return build


def mat_agree(max_rows: int, seed: int):
    def agree(inp, impls):
        B = inp["q"].shape[0]
        note = ""
        q, d = inp["q"].detach(), inp["d"].detach()
        if B > max_rows:
            g = torch.Generator().manual_seed(seed + 1)
            idx = torch.randperm(B, generator=g)[:max_rows].sort().values.to(q.device)
            q, d = q[idx], d[idx]
            note = f"on a random sub-batch of {max_rows} of the {B} rows (tempokern and reference alike)"
        q64, d64 = _leaf(q.double()), _leaf(d.double())
        want = with_grads(ref().matryoshka_infonce(q64, d64, MAT_DIMS, temperature=TEMPERATURE), [q64, d64],
                          ["q", "d"])
        res = {}
        for impl in impls:
            if not (is_tempokern(impl) or impl == "eager"):
                continue
            a, b = _leaf(q.clone()), _leaf(d.clone())
            fn = ref().matryoshka_infonce if impl == "eager" else tk().matryoshka_infonce
            run = lambda: with_grads(fn(a, b, MAT_DIMS, temperature=TEMPERATURE), [a, b], ["q", "d"])  # noqa: E731
            res[impl] = compare(run_as(impl, run), want)
        return res, note
    return agree


def matryoshka_cases(sizes, dev, dtype, seed, compile_fn) -> List[Case]:
    cases, prev = [], None
    for B in sizes.get("matryoshka", []):
        steps = {impl: mat_step(impl, compile_fn) for impl in ("tempokern", "single", "eager", "compile",
                                                                 "compile_autochunk")}
        steps["matmul"] = lambda inp: row_blocks_mm(inp["q"].detach(), inp["d"].detach())
        cases.append(Case(
            "matryoshka_infonce", "dims 64..768", f"B={B}", make=(lambda s, B=B: mat_inputs(B, dev, dtype, s)),
            steps=steps, agree=mat_agree(sizes["agree_rows"], seed),
            # eager: K levels of (bf16 logits + float32 log-softmax and its gradient), ~5 x 19.4 bytes per pair
            # (multipos's measured eager bytes per pair, one level); compile: 5 x 6.7 (estimates)
            mem_bytes={"eager": 5 * 19.4 * B * B, "compile": 5 * 6.7 * B * B},
            scale=(B / prev) ** 2 if prev else 1.0,
            floor=lambda ms: (4 * ms["matmul"], "4 x the bare q @ d.T (one level's fwd, recompute, dq, dd products)")
            if "matmul" in ms else (math.nan, "")))
        prev = B
    return cases


# ctd_topk -------------------------------------------------------------------------------------------------------

def _ref_topk_mod():
    return importlib.import_module("tempokern.reference.ctd_topk")


def topk_inputs(Q, N, dev, dtype, seed, mode):
    g = _gen(dev, seed)
    q, gal = _unit_rows(Q, H, dev, dtype, g), _unit_rows(N, H, dev, dtype, g)
    inp = {"q": q, "g": gal, "mode": mode, "bias": None, "k": 10}
    if mode:
        u_q = torch.randint(0, MONTHS, (Q,), device=dev, generator=g).float() / (MONTHS - 1)
        u_g = torch.randint(0, MONTHS, (N,), device=dev, generator=g).float() / (MONTHS - 1)
        w1, b1, w2, b2, scale = (t.detach() for t in _bias_params(dev, seed))
        if mode == "exact":
            inp["bias"] = (u_q, u_g, w1, b1, w2, b2, scale)
        else:
            values = ref().offset_bias_table_values(w1, b1, w2, b2, scale, TABLE_POINTS)
            inp["bias"] = (u_q, u_g, values)
    return inp


def _bias_scores(inp, s, c0, c1):
    """s (Q, c1 - c0) float32 + the bias of gallery rows c0..c1 (the plain formula, reference helpers)."""
    m = _ref_topk_mod()
    if inp["mode"] == "exact":
        u_q, u_g, *w = inp["bias"]
        return s + m.offset_bias(u_q, u_g[c0:c1], *w)
    if inp["mode"] == "table":
        u_q, u_g, values = inp["bias"]
        return s + m.table_bias(u_q, u_g[c0:c1], values)
    return s


def topk_eager(inp):
    """What a user writes: (q @ g.T).topk(k) (temperature only rescales the k values), with a bias
    (q @ g.T).float() / T + bias."""
    q, g, k = inp["q"], inp["g"], inp["k"]
    if inp["mode"] is None:
        v, i = (q @ g.t()).topk(k, dim=1)
        return v.float() / TEMPERATURE, i
    return _bias_scores(inp, (q @ g.t()).float() / TEMPERATURE, 0, g.shape[0]).topk(k, dim=1)


def topk_chunked(inp, chunk):
    q, g, k = inp["q"], inp["g"], inp["k"]
    vals, idxs = [], []
    for c0 in range(0, g.shape[0], chunk):
        c1 = min(g.shape[0], c0 + chunk)
        s = q @ g[c0:c1].t()
        if inp["mode"] is not None:
            s = _bias_scores(inp, s.float() / TEMPERATURE, c0, c1)
        v, i = s.topk(min(k, c1 - c0), dim=1)
        vals.append(v)
        idxs.append(i + c0)
    v, i = torch.cat(vals, 1), torch.cat(idxs, 1)
    top = v.topk(k, dim=1)
    v = top.values.float() / TEMPERATURE if inp["mode"] is None else top.values
    return v, i.gather(1, top.indices)


def topk_chunk(Q, mode):
    if mode == "exact":   # the reference bias holds (Q, chunk, D + hidden) floats: keep it near 2 GB
        return int(max(1024, min(131072, (2 << 30) // (Q * (D_FEAT + HIDDEN) * 4 * 2))))
    return 131072


def topk_agree(max_q: int, max_n: int, seed: int):
    def agree(inp, impls):
        Q, N = inp["q"].shape[0], inp["g"].shape[0]
        qn = max_q if inp["mode"] != "exact" else max(1, max_q // 4)
        dev = inp["q"].device
        note = ""
        qi, gi = torch.arange(min(Q, qn)), torch.arange(N)
        if Q > qn or N > max_n:
            gen = torch.Generator().manual_seed(seed + 2)
            qi = torch.randperm(Q, generator=gen)[:qn].sort().values
            gi = torch.randperm(N, generator=gen)[:min(N, max_n)].sort().values
            note = f"on {len(qi)} random queries x a random sub-gallery of {len(gi)} rows"
        qi, gi = qi.to(dev), gi.to(dev)
        sub = dict(inp, q=inp["q"][qi], g=inp["g"][gi])
        if inp["mode"] == "exact":
            sub["bias"] = (inp["bias"][0][qi], inp["bias"][1][gi]) + tuple(inp["bias"][2:])
        elif inp["mode"] == "table":
            sub["bias"] = (inp["bias"][0][qi], inp["bias"][1][gi], inp["bias"][2])
        b64 = None if sub["bias"] is None else tuple(t.double() for t in sub["bias"][:2]) + tuple(
            t.double() if inp["mode"] == "exact" else t for t in sub["bias"][2:])
        wv, wi = ref().ctd_topk(sub["q"].double(), sub["g"].double(), inp["k"], temperature=TEMPERATURE, bias=b64)
        res = {}
        for impl in impls:
            if is_tempokern(impl):
                v, i = run_as(impl, lambda: tk().ctd_topk(sub["q"], sub["g"], inp["k"], temperature=TEMPERATURE,
                                                          bias=sub["bias"]))
            else:
                v, i = topk_eager(sub)
            r = compare([("values", v)], [("values", wv)])
            r["topk_index_match"] = (i == wi).double().mean().item()
            res[impl] = r
        return res, note
    return agree


def topk_cases(sizes, dev, dtype, seed, bandwidth) -> List[Case]:
    cases = []
    Q, N = sizes["topk"]
    runs = [(Q, N, None, "no bias"), (Q, N, "exact", "exact bias"), (Q, N, "table", f"table bias ({TABLE_POINTS})")]
    runs += [(q1, N, "exact", "exact bias") for q1 in sizes["topk_small_q"]]
    for Qc, Nc, mode, label in runs:
        chunk = topk_chunk(Qc, mode)
        full_bytes = {None: 2.0, "table": 40.0, "exact": 8.0 * (D_FEAT + HIDDEN) + 40}[mode] * Qc * Nc
        steps = {
            "tempokern": (lambda inp: lambda: tk().ctd_topk(inp["q"], inp["g"], inp["k"], temperature=TEMPERATURE,
                                                            bias=inp["bias"])),
            "matmul": lambda inp: row_blocks_mm(inp["q"], inp["g"]),
            "eager": lambda inp: lambda: topk_eager(inp),
            "eager_chunked": lambda inp, chunk=chunk: lambda: topk_chunked(inp, chunk),
        }

        def floor(ms, Qc=Qc, Nc=Nc):
            gal = Nc * H * 2 / bandwidth * 1e3 if bandwidth else math.nan
            mm = ms.get("matmul", math.nan)
            return (max(gal, mm) if not math.isnan(mm) else gal,
                    f"max(bare q @ g.T, one read of the bf16 gallery {Nc * H * 2 / 1e9:.2f} GB at the measured "
                    f"copy bandwidth)")
        cases.append(Case("ctd_topk", label, f"Q={Qc} N={Nc} k=10",
                          make=(lambda s, Qc=Qc, Nc=Nc, mode=mode: topk_inputs(Qc, Nc, dev, dtype, s, mode)),
                          steps=steps, agree=topk_agree(sizes["agree_q"], sizes["agree_n"], seed),
                          mem_bytes={"eager": full_bytes}, floor=floor))
    return cases


# calendar -------------------------------------------------------------------------------------------------------

LEVELS = (12, 32, 12)
CAL_DIM = 64


def calendar_inputs(rows, dev, seed, op):
    g = _gen(dev, seed)
    logits = [_leaf(torch.randn(rows, n, device=dev, generator=g)) for n in LEVELS]
    width = len(LEVELS) * CAL_DIM if op == "calendar_context" else None
    gout = torch.randn(rows, width, device=dev, generator=g) if width else torch.randn(rows, device=dev, generator=g)
    return {"logits": logits, "gout": gout, "op": op}


def calendar_call(fn, inp):
    return fn(inp["logits"], CAL_DIM) if inp["op"] == "calendar_context" else fn(inp["logits"])


def calendar_step(fn_get):
    def build(inp):
        fn = fn_get()
        return lambda: torch.autograd.grad(calendar_call(fn, inp), inp["logits"], grad_outputs=inp["gout"])
    return build


def calendar_agree(inp, impls):
    names = [f"logits[{i}]" for i in range(len(LEVELS))]
    l64 = [_leaf(t.double()) for t in inp["logits"]]
    i64 = dict(inp, logits=l64)
    want = with_grads(calendar_call(getattr(ref(), inp["op"]), i64), l64, names, inp["gout"].double(), "out")
    res = {}
    for impl in impls:
        fn = getattr(tk() if is_tempokern(impl) else ref(), inp["op"])
        li = [_leaf(t) for t in inp["logits"]]
        call = lambda: with_grads(calendar_call(fn, dict(inp, logits=li)), li, names, inp["gout"], "out")  # noqa: E731
        got = run_as(impl, call)
        res[impl] = compare(got, want)
    return res, ""


def calendar_cases(sizes, dev, bandwidth, compile_fn) -> List[Case]:
    rows = sizes["calendar"]
    cases = []
    n = sum(LEVELS)
    for op, out_w in (("calendar_context", len(LEVELS) * CAL_DIM), ("calendar_scalar", 1)):
        steps = {"tempokern": calendar_step(lambda op=op: getattr(tk(), op)),
                 "eager": calendar_step(lambda op=op: getattr(ref(), op)),
                 "compile": calendar_step(lambda op=op: compile_fn(getattr(ref(), op))),
                 "compile_autochunk": calendar_step(lambda op=op: compile_fn(getattr(ref(), op), autochunk=True))}
        nbytes = rows * 4 * (3 * n + 2 * out_w)   # fwd: logits in, out; bwd: logits + gout in, grads out

        def floor(ms, nbytes=nbytes):
            return (nbytes / bandwidth * 1e3 if bandwidth else math.nan,
                    f"{nbytes / 1e9:.2f} GB moved (fwd reads logits, writes out; bwd reads logits and the upstream "
                    "gradient, writes the logits' gradients) at the measured copy bandwidth")
        cases.append(Case(op, "fwd+bwd float32" + (f" dim {CAL_DIM}" if op == "calendar_context" else ""),
                          f"rows={rows} levels=12x32x12",
                          make=(lambda s, op=op: calendar_inputs(rows, dev, s, op)), steps=steps,
                          agree=calendar_agree, floor=floor))
    return cases


# offset_bias ----------------------------------------------------------------------------------------------------

def bias_inputs(B, dev, seed, table: bool):
    g = _gen(dev, seed)
    u_q = _leaf(torch.randint(0, MONTHS, (B,), device=dev, generator=g).float() / (MONTHS - 1))
    u_d = _leaf(torch.randint(0, MONTHS, (B,), device=dev, generator=g).float() / (MONTHS - 1))
    leaves = [u_q, u_d, *_bias_params(dev, seed)]
    return {"leaves": leaves, "gout": torch.randn(B, B, device=dev, generator=g), "table": table}


def bias_call(fn, inp, tempokern_op: bool):
    if not inp["table"]:
        return fn(*inp["leaves"])
    if tempokern_op:
        if not accepts(fn, "table_points"):
            raise Unsupported("tempokern.offset_bias has no table_points keyword in this build")
        return fn(*inp["leaves"], table_points=TABLE_POINTS)
    return ref().offset_bias_tabulated(*inp["leaves"], TABLE_POINTS)


def bias_step(impl, backward):
    def build(inp):
        fn = tk().offset_bias if impl == "tempokern" else ref().offset_bias
        if impl == "tempokern" and inp["table"] and not accepts(fn, "table_points"):
            bias_call(fn, inp, True)   # raises Unsupported before anything is timed
        if not backward:
            def fwd():
                with torch.no_grad():
                    return bias_call(fn, inp, impl == "tempokern")
            return fwd
        return lambda: torch.autograd.grad(bias_call(fn, inp, impl == "tempokern"), inp["leaves"],
                                           grad_outputs=inp["gout"])
    return build


def bias_agree(max_rows: int, seed: int, backward: bool):
    def agree(inp, impls):
        B = inp["leaves"][0].shape[0]
        note = ""
        if B > max_rows:
            gen = torch.Generator().manual_seed(seed + 3)
            iq = torch.randperm(B, generator=gen)[:max_rows].sort().values.to(inp["gout"].device)
            idd = torch.randperm(B, generator=gen)[:max_rows].sort().values.to(inp["gout"].device)
            lv = inp["leaves"]
            inp = dict(inp, leaves=[_leaf(lv[0][iq]), _leaf(lv[1][idd])] + [_leaf(t) for t in lv[2:]],
                       gout=inp["gout"][iq][:, idd])
            note = f"on a random {max_rows} x {max_rows} sub-block"
        l64 = [_leaf(t.double()) for t in inp["leaves"]]
        names = list(BIAS_NAMES) if backward else []
        fn64 = ref().offset_bias
        out64 = bias_call(fn64, dict(inp, leaves=l64), False)
        want = with_grads(out64, l64, names, inp["gout"].double(), "out") if backward else [("out", out64.detach())]
        res = {}
        for impl in impls:
            li = [_leaf(t) for t in inp["leaves"]]
            fused = is_tempokern(impl)
            fn = tk().offset_bias if fused else ref().offset_bias

            def call(fn=fn, li=li, fused=fused):
                out = bias_call(fn, dict(inp, leaves=li), fused)
                return with_grads(out, li, names, inp["gout"], "out") if backward else [("out", out.detach())]
            got = run_as(impl, call)
            res[impl] = compare(got, want)
        return res, note
    return agree


def bias_cases(sizes, dev, seed, bandwidth) -> List[Case]:
    B = sizes["bias"]
    cases = []
    for table in (False, True):
        for backward in (False, True):
            label = ("table (%d) " % TABLE_POINTS if table else "exact ") + ("fwd+bwd" if backward else "fwd")
            per_pair = {(False, False): 360, (False, True): 560, (True, False): 40, (True, True): 80}[(table, backward)]
            nbytes = B * B * 4 * (2 if backward else 1)

            def floor(ms, nbytes=nbytes):
                return (nbytes / bandwidth * 1e3 if bandwidth else math.nan,
                        f"{nbytes / 1e9:.2f} GB: the float32 output written (and the upstream gradient read) at the "
                        "measured copy bandwidth; the first layer's flops are not counted")
            cases.append(Case("offset_bias", label + " float32", f"{B}x{B}",
                              make=(lambda s, table=table: bias_inputs(B, dev, s, table)),
                              steps={"tempokern": bias_step("tempokern", backward),
                                     "eager": bias_step("eager", backward)},
                              agree=bias_agree(sizes["agree_bias"], seed, backward),
                              mem_bytes={"eager": per_pair * B * B}, floor=floor))
    return cases


# Re3Loss ---------------------------------------------------------------------------------------------------

def re3_inputs(B, dev, dtype, seed):
    """Unit rows, each document a noisy copy of its query and each time-wrong negative a noisy copy of the
    document (so both margins are active), all documents distinct; H = 768 as the other loss cases."""
    g = _gen(dev, seed)
    q = _unit_rows(B, H, dev, torch.float32, g)
    d = torch.nn.functional.normalize(q + torch.randn(B, H, device=dev, generator=g), dim=1)
    tw = torch.nn.functional.normalize(d + 0.5 * torch.randn(B, H, device=dev, generator=g), dim=1)
    q, d, tw = (_leaf(x.to(dtype)) for x in (q, d, tw))
    return {"q": q, "d": d, "d_tw": tw, "ids": torch.arange(B, device=dev), "leaves": [q, d, tw],
            "names": ["q", "d", "d_tw"]}


def re3_call(impl, inp, compile_fn=None):
    if impl == "tempokern":
        from tempokern.nn import Re3Loss
        return Re3Loss(temperature=TEMPERATURE)(inp["q"], inp["d"], inp["d_tw"], inp["ids"])[0]
    fn = importlib.import_module("tempokern.reference.re3").re3_loss
    if compile_fn is not None:
        fn = compile_fn(fn)
    return fn(inp["q"], inp["d"], inp["d_tw"], inp["ids"], temperature=TEMPERATURE)[0]


def re3_step(impl, compile_fn=None):
    def build(inp):
        fn = (None if impl not in COMPILED else compile_fn if impl == "compile"
              else (lambda f: compile_fn(f, autochunk=True)))
        return lambda: torch.autograd.grad(re3_call(impl, inp, fn), inp["leaves"])
    return build


def re3_agree(max_rows: int, seed: int):
    def agree(inp, impls):
        B = inp["q"].shape[0]
        note = ("hardest-negative ties in the low-precision scores may pick another column than float64 does "
                "(a different, equally valid subgradient)")
        if B > max_rows:
            g = torch.Generator().manual_seed(seed + 1)
            idx = torch.randperm(B, generator=g)[:max_rows].sort().values.to(inp["q"].device)
            inp = {k: (v[idx] if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}
            note += f"; on a random sub-batch of {max_rows} of the {B} rows (tempokern and reference alike)"
        fresh = lambda i, dt=None: {**i, **{k: _leaf(i[k] if dt is None else i[k].to(dt))  # noqa: E731
                                             for k in ("q", "d", "d_tw")}}
        i64 = fresh(inp, torch.float64)
        i64["leaves"] = [i64["q"], i64["d"], i64["d_tw"]]
        want = with_grads(re3_call("eager", i64), i64["leaves"], inp["names"])
        res = {}
        for impl in impls:
            i = fresh(inp)
            i["leaves"] = [i["q"], i["d"], i["d_tw"]]
            got = with_grads(re3_call("tempokern" if impl == "tempokern" else "eager", i), i["leaves"], inp["names"])
            res[impl] = compare(got, want)
        return res, note
    return agree


def re3_cases(sizes, dev, dtype, seed, compile_fn) -> List[Case]:
    B = sizes["loss"][0]
    steps = {"tempokern": re3_step("tempokern"), "eager": re3_step("eager"),
             "compile": re3_step("compile", compile_fn),
             "compile_autochunk": re3_step("compile_autochunk", compile_fn),
             "matmul": lambda inp: row_blocks_mm(inp["q"].detach(), inp["d"].detach())}
    return [Case("re3_loss", "Re3Loss (nce + hard + tw)", f"B={B}", make=lambda s: re3_inputs(B, dev, dtype, s),
                 steps=steps, agree=re3_agree(sizes["agree_rows"], seed),
                 mem_bytes={"eager": 24.0 * B * B, "compile": 8.0 * B * B},
                 floor=lambda ms: (4 * ms["matmul"], "4 x the bare q @ d.T (fwd, recompute, dq, dd products)")
                 if "matmul" in ms else (math.nan, ""))]


# ---- sizes -----------------------------------------------------------------------------------------------------

def suite_sizes(device: str, quick: bool) -> dict:
    if device in ("cpu", "emu"):   # tests and gpu_check.sh --dry: tiny, seconds
        return dict(loss=[48, 96], loss_one=[48], loss_table=[48], loss_exact=[48], agree_rows=64, agree_rows_exact=64, matryoshka=[48],
                    topk=(8, 3000), topk_small_q=[1], agree_q=4, agree_n=1000, calendar=300, bias=80, agree_bias=50)
    if quick:
        return dict(loss=[1024, 4096], loss_one=[1024], loss_table=[1024], loss_exact=[1024], agree_rows=4096, agree_rows_exact=1024,
                    matryoshka=[1024],
                    topk=(64, 100_000), topk_small_q=[1], agree_q=64, agree_n=50_000, calendar=65_536, bias=1024,
                    agree_bias=1024)
    return dict(loss=[8192, 65536, 262144], loss_one=[8192, 65536], loss_table=[8192, 65536], loss_exact=[8192], agree_rows=8192,
                matryoshka=[8192, 65536],
                agree_rows_exact=2048, topk=(1024, 1_000_000), topk_small_q=[1, 16], agree_q=256, agree_n=131_072,
                calendar=1 << 20, bias=8192, agree_bias=2048)


# ---- targets ---------------------------------------------------------------------------------------------------

# (label, op, case, B, target ms, target extra MB or None, note): H100 80GB, bf16, H = 768, D = hidden = 32
TARGETS = [
    ("loss, no bias, B = 8,192", "multipos_infonce", "no bias", "B=8192", 1.5, None, "compile: 2.17"),
    ("loss, no bias, B = 65,536", "multipos_infonce", "no bias", "B=65536", 60.0, 2048.0, "compile: 139 ms, 28.7 GB"),
    ("loss, no bias, B = 262,144", "multipos_infonce", "no bias", "B=262144", 1100.0, None, "compile: out of memory"),
    ("loss, table bias, B = 8,192", "multipos_infonce", f"table bias ({TABLE_POINTS})", "B=8192", 3.0, None, ""),
    ("loss, table bias, B = 65,536", "multipos_infonce", f"table bias ({TABLE_POINTS})", "B=65536", 90.0, None, ""),
    ("loss, exact bias, B = 8,192", "multipos_infonce", "exact bias", "B=8192", 20.0, None, "compile: 80 ms"),
    ("ctd_topk Q 1,024 x N 1M, none", "ctd_topk", "no bias", "Q=1024 N=1000000 k=10", 9.0, None,
     "(q @ g.T).topk: 9.7 ms, 2 GB"),
    ("ctd_topk Q 1,024 x N 1M, exact", "ctd_topk", "exact bias", "Q=1024 N=1000000 k=10", 40.0, None, ""),
    ("ctd_topk Q 1,024 x N 1M, table", "ctd_topk", f"table bias ({TABLE_POINTS})", "Q=1024 N=1000000 k=10", 12.0,
     None, ""),
    ("ctd_topk Q 1 x N 1M, exact", "ctd_topk", "exact bias", "Q=1 N=1000000 k=10", 1.2, None, ""),
    ("calendar_context fwd+bwd 1M rows dim 64 f32", "calendar_context", f"fwd+bwd float32 dim {CAL_DIM}",
     "rows=1048576 levels=12x32x12", 2.0, None, "eager: 5.0"),
]


# ---- the run ---------------------------------------------------------------------------------------------------

class Suite:
    def __init__(self, args, argv):
        self.args = args
        self.dev = torch.device("cpu" if args.device == "emu" else args.device)
        self.t0 = time.perf_counter()
        self.rows: List[dict] = []
        self._hashes: Dict[Tuple[str, str], str] = {}
        self.measured: Dict[Tuple[str, str], Tuple[int, float]] = {}   # (op/case series, impl) -> (index, ms)
        self.meta = self._meta(argv)
        self.csv_path = Path(args.csv)
        self.md_path = Path(args.md) if args.md else None
        self.csv_path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.csv_path.exists() or self.csv_path.stat().st_size == 0
        if not new:   # appending: the file must have this suite's columns
            with open(self.csv_path, newline="") as f:
                header = next(csv.reader(f), [])
            if header != FIELDS:
                die(f"gpu_suite: {self.csv_path} has the columns {header}, not {FIELDS}: pass another --csv")
        self._csv = open(self.csv_path, "a", newline="")
        self._writer = csv.DictWriter(self._csv, fieldnames=FIELDS)
        if new:
            self._writer.writeheader()
        self._csv.flush()

    def _meta(self, argv):
        tkm = tk()
        try:
            commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                                    timeout=10).stdout.strip() or "unknown"
            dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            commit += "+dirty" if dirty else ""
        except (OSError, subprocess.SubprocessError):
            commit = "unknown"
        if os.environ.get("TEMPOKERN_GIT_COMMIT"):   # a copy of the checkout without its .git
            commit = os.environ["TEMPOKERN_GIT_COMMIT"]
        if self.dev.type == "cuda":
            name = torch.cuda.get_device_name(self.dev)
        elif self.args.device == "emu":
            name = f"cuda emulator on cpu x{os.cpu_count()}"
        else:
            name = f"cpu x{os.cpu_count()} (torch threads {torch.get_num_threads()})"
        return {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "device": name,
                "commit": commit, "command": " ".join(shlex.quote(a) for a in ["python"] + list(argv)),
                "torch": torch.__version__, "tempokern": tkm.__version__}

    # -- rows
    def emit(self, case: Case, impl: str, metric: str, value, note: str = "") -> None:
        if isinstance(value, float):
            value = f"{value:.6g}"
        row = {"date": self.meta["date"], "device": self.meta["device"], "commit": self.meta["commit"],
               "src_hash": self.src_hash(case.op, impl), "op": case.op, "case": case.case, "B": case.size, "impl": impl, "metric": metric, "value": value,
               "note": note}
        self.rows.append(row)
        self._writer.writerow(row)
        self._csv.flush()

    def src_hash(self, op: str, impl: str) -> str:
        key = (op, impl)
        if key not in self._hashes:
            self._hashes[key] = _sources.source_hash(op, "cuda", impl) if not op.startswith("_") else ""
        return self._hashes[key]

    def log(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {msg}", flush=True)

    def left_s(self) -> float:
        return self.args.budget_s - (time.perf_counter() - self.t0)

    # -- one measurement
    def skip_reason(self, case: Case, impl: str, series_pos: int) -> Optional[str]:
        if self.left_s() <= 0:
            return f"skipped: suite time budget of {self.args.budget_s:.0f} s spent"
        if impl in COMPILED and self.args.no_compile:
            return "skipped: --no-compile"
        if impl in COMPILED and self.dev.type == "cuda" and self.left_s() < COMPILE_RESERVE_S:
            return f"skipped: less than {COMPILE_RESERVE_S} s of the suite time budget left for a compilation"
        est = case.mem_bytes.get(impl)
        if est and self.dev.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.dev)
            if est > 0.9 * free:
                return (f"skipped: known to run out of memory (needs ~{est / 2**30:.0f} GiB by the bytes per element "
                        f"measured on the H100 at smaller sizes; {free / 2**30:.0f} GiB free)")
        last = self.measured.get((case.op + "/" + case.case, impl))
        if last and last[0] == series_pos - 1:
            predicted = last[1] * case.scale / 1e3
            if predicted > self.args.max_step_s:
                return (f"skipped: one step predicted at {predicted:.0f} s from the previous size "
                        f"(> --max-step-s {self.args.max_step_s:.0f})")
        return None

    def measure(self, case: Case, impl: str, series_pos: int, sets: List[dict]) -> Optional[float]:
        why = self.skip_reason(case, impl, series_pos)
        if why:
            self.emit(case, impl, "status", why)
            self.log(f"{case.key} {impl}: {why}")
            return None
        status = None
        try:
            env = impl_env(impl)
            build = with_env(case.steps[impl], env) if env else case.steps[impl]
            fns = [build(s) for s in sets]
            t = time_step(fns, self.dev, self.args.repeats, self.args.measure_s)
            del fns
        except Unsupported as e:
            status = f"unsupported: {e}"
        except Exception as e:  # noqa: BLE001  (a failure is a result: report it and go on)
            status = failure(e)
        # outside the except blocks: the traceback's frames (and their tensors) are gone before empty_cache
        free_memory(self.dev, collect=status is not None)
        if status is not None:
            self.emit(case, impl, "status", status)
            self.log(f"{case.key} {impl}: {status}")
            return None
        runs = f"median of {t.runs} timed runs after 1 warm-up; {len(sets)} rotating input set(s)"
        self.emit(case, impl, "time_ms", t.ms, runs)
        if t.pipelined_ms is not None:
            self.emit(case, impl, "time_ms_pipelined", t.pipelined_ms,
                      f"{t.pipelined_runs} steps back to back between two events, no synchronize between them")
        self.emit(case, impl, "extra_peak_mb", "" if t.peak_mb is None else t.peak_mb,
                  "" if t.peak_mb is not None else "not measured on this device")
        if impl in COMPILED:
            self.emit(case, impl, "compile_s", t.warm_s, "first call: dynamo + inductor compile of this shape")
        self.emit(case, impl, "status", "ok")
        self.measured[(case.op + "/" + case.case, impl)] = (series_pos, t.ms)
        self.log(f"{case.key} {impl}: {t.ms:.3f} ms" + (f", +{t.peak_mb:.0f} MB" if t.peak_mb is not None else "")
                 + (f" (compile {t.warm_s:.1f} s)" if impl in COMPILED else ""))
        return t.ms

    def n_sets(self, case: Case) -> List[dict]:
        first = case.make(self.args.seed)
        size = case.set_bytes(first)
        if self.dev.type == "cuda":
            l2 = getattr(torch.cuda.get_device_properties(self.dev), "L2_cache_size", 50 << 20) or (50 << 20)
        else:
            l2 = 1 << 20
        n = 1 if size >= 2 * l2 else min(4, math.ceil(2 * l2 / max(1, size)))
        return [first] + [case.make(self.args.seed + 100 * i) for i in range(1, n)]

    def run_case(self, case: Case, series_pos: int, impls: Sequence[str], agreement: bool) -> None:
        impls = [i for i in impls if i in case.steps]
        whys = [self.skip_reason(case, i, series_pos) for i in impls]
        if all(whys):   # nothing to run: do not build the inputs
            for impl, why in zip(impls, whys):
                self.emit(case, impl, "status", why)
                self.log(f"{case.key} {impl}: {why}")
            return
        self.log(f"{case.key}: inputs")
        try:
            sets = self.n_sets(case)
        except Exception as e:  # noqa: BLE001
            sets, status = None, failure(e)
        if sets is None:
            free_memory(self.dev, collect=True)
            for impl in impls:
                self.emit(case, impl, "status", f"{status} (building the inputs)")
            return
        ms = {}
        for impl in impls:
            if impl in case.steps:
                v = self.measure(case, impl, series_pos, sets)
                if v is not None:
                    ms[impl] = v
        if case.floor and "tempokern" in impls:
            fl, how = case.floor(ms)
            if not math.isnan(fl):
                self.emit(case, "tempokern", "floor_ms", fl, how)
        if agreement and case.agree:
            self.agreement(case, sets[0], [i for i in impls if (is_tempokern(i) or i == "eager")
                                           and i in case.steps])
        del sets
        free_memory(self.dev)

    def agreement(self, case: Case, inp: dict, impls: List[str]) -> None:
        if self.left_s() <= 0:
            for impl in impls:
                self.emit(case, impl, "agreement", "", "skipped: suite time budget spent")
            return
        res = {}
        note = ""
        for impl in impls:   # one impl at a time: an unsupported tempokern keyword must not hide eager's numbers
            failed = False
            try:
                r, note = case.agree(inp, [impl])
                res.update(r)
            except Unsupported as e:
                self.emit(case, impl, "agreement", "", f"unsupported: {e}")
            except Exception as e:  # noqa: BLE001
                self.emit(case, impl, "agreement", "", f"not computed: {failure(e)}")
                failed = True
            free_memory(self.dev, collect=failed)
        for impl, r in res.items():
            worst, worst_q = -1.0, ""
            for qn, v in r.items():
                if qn == "topk_index_match":
                    self.emit(case, impl, "topk_index_match", v, note)
                    continue
                self.emit(case, impl, f"agreement_abs:{qn}", v[0], note)
                self.emit(case, impl, f"agreement_rel:{qn}", v[1], note)
                if v[1] > worst:
                    worst, worst_q = v[1], qn
            self.emit(case, impl, "agreement", worst, f"largest agreement_rel ({worst_q}) vs float64"
                      + (f"; {note}" if note else ""))
        for fused in [i for i in res if is_tempokern(i)]:
            if fused not in res or "eager" not in res:
                continue
            worst, worst_q = 0.0, ""
            for qn, v in res[fused].items():
                if qn == "topk_index_match":
                    continue
                a, e = v[0], res["eager"][qn][0]
                # floored at one float32 ulp of the reference's magnitude (abs / rel): a scalar that torch happens
                # to round to within 0.7 ulp must not make a 1.7-ulp result look like a 2.5x error
                mag = v[0] / v[1] if v[1] > 0 else 0.0
                e = max(e, ULP32 * mag)
                ratio = (a / e) if e > 0 else (1.0 if a == 0 else math.inf)
                self.emit(case, fused, f"err_vs_torch:{qn}", ratio,
                          "tempokern's abs error / max(eager torch's, one float32 ulp of the reference's magnitude), "
                          "same inputs and dtype (2x rule: <= 2)")
                if ratio > worst:
                    worst, worst_q = ratio, qn
            self.emit(case, fused, "err_vs_torch", worst, f"largest ratio ({worst_q})")
        free_memory(self.dev)
        self.log(f"{case.key}: agreement " + ", ".join(
            f"{i} {max((v[1] for k, v in r.items() if k != 'topk_index_match'), default=math.nan):.2e}"
            for i, r in res.items()) + (f" ({note})" if note else ""))

    def bandwidth(self) -> float:
        """Device-to-device copy bandwidth (read + write) of a 1 GiB float32 tensor in bytes/s, the yardstick of
        the memory floors; a CSV row of its own (op "_device", impl "eager", metric bandwidth_GBps)."""
        if self.dev.type != "cuda":
            return 0.0
        x = torch.empty(1 << 28, dtype=torch.float32, device=self.dev)
        y = torch.empty_like(x)
        t = time_step([lambda: y.copy_(x)], self.dev, 10, 2.0)
        bw = 2 * x.numel() * 4 / (t.ms * 1e-3)
        del x, y
        free_memory(self.dev)
        self.emit(Case("_device", "copy (read + write)", "1 GiB", make=lambda s: {}, steps={}), "eager",
                  "bandwidth_GBps", bw / 1e9, f"y.copy_(x), float32; median of {t.runs} CUDA-event timings")
        self.log(f"copy bandwidth {bw / 1e9:.0f} GB/s")
        return bw


def decision_keys(sizes) -> set:
    """(op, case, B) of the cases that decide the candidates: the CTD loss without a bias and with the table
    bias at the first two sizes (8,192 and 65,536 on a GPU), Matryoshka at the first size, both calendar ops,
    Re3Loss."""
    keys = {("multipos_infonce", "no bias", f"B={b}") for b in sizes["loss"][:2]}
    keys |= {("multipos_infonce", "no bias, one positive", f"B={b}") for b in sizes["loss_one"][:2]}
    keys |= {("multipos_infonce", f"table bias ({TABLE_POINTS})", f"B={b}") for b in sizes["loss_table"][:2]}
    keys |= {("matryoshka_infonce", "dims 64..768", f"B={b}") for b in sizes["matryoshka"][:1]}
    rows = f"rows={sizes['calendar']} levels=12x32x12"
    keys |= {("calendar_context", f"fwd+bwd float32 dim {CAL_DIM}", rows), ("calendar_scalar", "fwd+bwd float32", rows)}
    keys.add(("re3_loss", "Re3Loss (nce + hard + tw)", f"B={sizes['loss'][0]}"))
    return keys


def stale_keys(rows: List[dict], cases: List[Case]) -> set:
    """(op, case, B) of the cases whose default-path figure is older than its sources: the newest ``tempokern``
    time_ms row of the case (in ``rows``, a gpu.csv) has a src_hash other than the current sources' hash
    (benchmarks/_sources.py; rows from before the column read ``unknown``), or there is no such row."""
    newest: Dict[tuple, dict] = {}
    for r in rows:
        if r.get("impl") == "tempokern" or (r.get("impl", "").startswith("tempokern:") and
                                            r["impl"].split(":", 1)[1] not in dispatch.NAMES):
            if r.get("metric") != "time_ms" or _sources.device_kind(r.get("device", "")) != "cuda":
                continue
            k = (r["op"], r["case"], r["B"])
            if k not in newest or r["date"] >= newest[k]["date"]:
                newest[k] = r
    out = set()
    for c in cases:
        k = (c.op, c.case, c.size)
        r = newest.get(k)
        if r is None or _sources.is_stale(r.get("src_hash", ""), c.op, "cuda", "tempokern"):
            out.add(k)
    return out


def read_rows(path) -> List[dict]:
    try:
        with open(path, newline="") as f:
            return list(csv.DictReader(f))
    except OSError:
        return []


def build_cases(args, dev, bandwidth, compile_fn) -> List[Tuple[Case, int]]:
    sizes = suite_sizes(args.device, args.quick)
    dtype = torch.bfloat16
    series: List[List[Case]] = []
    cur: List[Case] = []
    for c in loss_cases(sizes, dev, dtype, args.seed, compile_fn):
        if cur and cur[-1].case != c.case:
            series.append(cur)
            cur = []
        cur.append(c)
    series.append(cur)
    series.append(matryoshka_cases(sizes, dev, dtype, args.seed, compile_fn))
    series += [[c] for c in topk_cases(sizes, dev, dtype, args.seed, bandwidth)]
    series += [[c] for c in calendar_cases(sizes, dev, bandwidth, compile_fn)]
    series += [[c] for c in bias_cases(sizes, dev, args.seed, bandwidth)]
    series += [[c] for c in re3_cases(sizes, dev, dtype, args.seed, compile_fn)]
    for s in series:   # the candidate columns: the default's step with each candidate of the op enabled
        for c in s:
            if "tempokern" in c.steps:
                steps = {}
                for impl, step in c.steps.items():
                    steps[impl] = step
                    if impl == "tempokern":
                        steps.update((candidate_impl(n), step) for n in candidates_for(c.op))
                c.steps = steps
    pat = re.compile(args.only, re.I) if args.only else None
    keep = decision_keys(sizes) if getattr(args, "decision", False) else None
    first = set(keep or ())
    if keep is not None and getattr(args, "stale", False):
        keep = keep | stale_keys(read_rows(args.stale_csv or args.csv), [c for s in series for c in s])
    out = []
    for s in series:
        for pos, c in enumerate(s):
            if (pat is None or pat.search(c.key)) and (keep is None or (c.op, c.case, c.size) in keep):
                out.append((c, pos))
    # the decision cases first, then the stale ones (the budget cuts the latter first); stable within each
    out.sort(key=lambda cp: (cp[0].op, cp[0].case, cp[0].size) not in first if first else False)
    return out


def _fmt(v, nd=3):
    try:
        x = float(v)
    except (TypeError, ValueError):
        return str(v)
    if math.isnan(x):
        return ""
    if x == 0:
        return "0"
    if abs(x) >= 100:
        return f"{x:,.1f}"
    if abs(x) >= 1e-2:
        return f"{x:.{nd}f}"
    return f"{x:.2e}"


def tables(rows: List[dict], meta: dict, bandwidth: float) -> str:
    by: Dict[tuple, Dict[str, dict]] = {}
    order: List[tuple] = []
    for r in rows:
        key = (r["op"], r["case"], r["B"])
        if key not in by:
            by[key] = {}
            order.append(key)
        by[key].setdefault(r["impl"], {})[r["metric"]] = r["value"]
        if r["metric"] in ("agreement", "err_vs_torch"):
            m = re.search(r"\((.*?)\)", r["note"])
            by[key][r["impl"]][r["metric"] + "_what"] = m.group(1) if m and r["value"] != "" else ""

    lines = [f"# tempokern GPU suite: {meta['device']}", "",
             f"date {meta['date']}, commit {meta['commit']}, torch {meta['torch']}, tempokern {meta['tempokern']}",
             f"command: `{meta['command']}`", ""]
    if bandwidth:
        lines += [f"Device-to-device copy bandwidth (read + write, 1 GiB): {bandwidth / 1e9:.0f} GB/s.", ""]
    lines += ["Times: median of one step, fwd+bwd unless the case says fwd (CUDA events; perf_counter on CPU). "
              "agreement: largest relative error of the output/loss and every gradient vs float64 on the same "
              "inputs. err_vs_torch: largest "
              "ratio of tempokern's error to eager torch's in the same dtype (<= 2 meets the 2x rule). "
              "floor: from the flop/byte count (see the CSV notes).", ""]
    for op in dict.fromkeys(k[0] for k in order if not k[0].startswith("_")):
        lines += [f"## {op}", "", "| case | size | impl | ms | ms pipelined | extra MB | floor ms | agreement | "
                  "err_vs_torch | status |", "|---|---|---|---|---|---|---|---|---|---|"]
        for key in (k for k in order if k[0] == op):
            for impl in sorted(by[key], key=lambda i: IMPLS.index(i) if i in IMPLS else 99):
                m = by[key][impl]
                agree = _fmt(m.get("agreement", "")) + (f" ({m['agreement_what']})" if m.get("agreement_what") else "")
                if "topk_index_match" in m:
                    agree += f" (idx {float(m['topk_index_match']):.4f})"
                lines.append(f"| {key[1]} | {key[2]} | {impl} | {_fmt(m.get('time_ms', ''))} | "
                             f"{_fmt(m.get('time_ms_pipelined', ''))} | {_fmt(m.get('extra_peak_mb', ''), 1)} | {_fmt(m.get('floor_ms', ''))} | {agree} | "
                             f"{_fmt(m.get('err_vs_torch', ''), 2)}"
                             f"{' (' + m['err_vs_torch_what'] + ')' if m.get('err_vs_torch_what') else ''} | "
                             f"{m.get('status', '')} |")
        lines.append("")
    lines += ["## Targets (the default path; H100 80GB, bf16, H = 768, D = hidden = 32, fwd+bwd)", "",
              "| case | target | tempokern ms | extra MB | met | floor ms | compile ms | eager ms "
              "| err_vs_torch | tempokern / compile ms pipelined |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for label, op, case, size, tms, tmb, note in TARGETS:
        m = by.get((op, case, size), {})
        t = m.get("tempokern", {})
        ms = t.get("time_ms")
        if ms in (None, ""):
            met = "not measured" + (f" ({t['status']})" if t.get("status") else "")
        else:
            ok = float(ms) <= tms and (tmb is None or float(t.get("extra_peak_mb") or 0) <= tmb)
            met = "yes" if ok else "no"
        target = f"<= {tms:g} ms" + (f", <= {tmb / 1024:g} GB extra" if tmb else "") + (f" ({note})" if note else "")
        lines.append(f"| {label} | {target} | {_fmt(ms or '')} | {_fmt(t.get('extra_peak_mb', ''), 1)} | "
                     f"{met} | {_fmt(t.get('floor_ms', ''))} | {_fmt(m.get('compile', {}).get('time_ms', ''))} | "
                     f"{_fmt(m.get('eager', {}).get('time_ms', '') or m.get('eager', {}).get('status', ''))} | "
                     f"{_fmt(t.get('err_vs_torch', ''), 2)} | {_fmt(t.get('time_ms_pipelined', '')) or '-'} / "
                     f"{_fmt(m.get('compile', {}).get('time_ms_pipelined', '')) or '-'} |")
    return "\n".join(lines) + "\n"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--csv", default=str(DEFAULT_CSV),
                   help=f"the long-format CSV the rows are appended to (default {dispatch.GPU_CSV}; created with its "
                   "header when missing)")
    p.add_argument("--md", default=None, help="also write this run's tables as Markdown to this file")
    p.add_argument("--only", default=None, help="regex over 'op/case/B', e.g. 'multipos_infonce/no bias' or "
                   "'ctd_topk|calendar'")
    p.add_argument("--decision", action="store_true",
                   help="only the cases that decide the candidates (CTD loss no bias and table bias at the first two "
                   "sizes, Matryoshka at the first, the calendar ops, Re3Loss)")
    p.add_argument("--stale", action="store_true",
                   help="with --decision: also every case whose default path's newest time_ms row in the CSV "
                   "(--stale-csv, else --csv) was measured on other sources than the current ones (src_hash; "
                   "benchmarks/_sources.py), after the decision cases")
    p.add_argument("--stale-csv", default=None, help="the CSV --stale reads (default: --csv)")
    p.add_argument("--plan", action="store_true",
                   help="print the cases this command would run (with --stale: which are stale and why) and exit; "
                   "needs no GPU")
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke test of the whole suite")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per measurement (default 10, --device cpu "
                   "2; fewer when one step is slow, see --measure-s)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu", "emu"],
                   help="cuda (default); cpu: tiny sizes on the CPU kernels; emu: tiny sizes on the CUDA kernels\n"
                   "through the CPU emulator (tools/cuda_emu). cpu and emu exist for tests and gpu_check.sh --dry")
    p.add_argument("--measure-s", type=float, default=None,
                   help="at most about this many seconds of timed runs per measurement (default 3, --device cpu 0.2)")
    p.add_argument("--max-step-s", type=float, default=20.0,
                   help="skip a size whose step is predicted above this from the previous size (default 20)")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="stop measuring after this many seconds; the rest is reported as skipped (default 420; "
                   "no compilation starts in the last 60)")
    p.add_argument("--no-compile", action="store_true", help="leave out the torch.compile baselines")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend (default inductor; the CPU tests use aot_eager)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    cpu = args.device != "cuda"
    args.repeats = (2 if cpu else 10) if args.repeats is None else args.repeats
    args.measure_s = (0.2 if cpu else 3.0) if args.measure_s is None else args.measure_s
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    return args


def die(message: str):
    """A usage or set-up error: the message on stderr, exit status 2, nothing measured."""
    print(message, file=sys.stderr, flush=True)
    raise SystemExit(2)


def check_build(device: str) -> None:
    """Exit with a clear message (status 2) when the suite cannot run on `device`."""
    try:
        import tempokern
    except ImportError as e:
        die(f"gpu_suite: cannot import tempokern ({e}). It builds nothing: install it "
                         "(TEMPOKERN_CUDA=ON pip install .) or build in place (TEMPOKERN_CUDA=ON tools/dev_build.sh).")
    if device != "cuda":
        return
    info = tempokern.build_info()
    where = Path(tempokern.__file__).parent
    if not info["cuda_compiled"]:
        die(f"gpu_suite: the tempokern at {where} was built without CUDA kernels; rebuild with "
                         "TEMPOKERN_CUDA=ON TEMPOKERN_CUDA_ARCHS=90 pip install . (or tools/dev_build.sh), then rerun.")
    if not torch.cuda.is_available():
        die(f"gpu_suite: torch {torch.__version__} sees no CUDA device (torch.version.cuda = "
                         f"{torch.version.cuda}); run on a GPU machine, or use --device cpu for the test mode.")
    if not info["cuda_runtime_ok"]:
        die(f"gpu_suite: tempokern's CUDA runtime is unavailable: {info['cuda_runtime_message']}")


def emulator():
    """The context in which CPU tensors run the CUDA kernels on the CPU emulator (tools/cuda_emu: its _C module
    is built on first use and cached under build/cuda_emu/)."""
    sys.path.insert(0, str(REPO / "tools" / "cuda_emu"))
    try:
        import build as emu_build
        from emu_support import cuda_emulator
    finally:
        sys.path.pop(0)
    return cuda_emulator(emu_build.load())


def print_plan(args) -> Tuple[Path, Optional[Path]]:
    """The cases of this command, in order, each marked decision / stale (the source hash it was measured on vs
    the current one)."""
    sizes = suite_sizes(args.device, args.quick)
    keys = decision_keys(sizes)
    cases = build_cases(args, torch.device("cpu"), 0.0, lambda fn, autochunk=False: fn)
    rows = read_rows(args.stale_csv or args.csv)
    stale = stale_keys(rows, [c for c, _ in cases]) if args.stale else set()
    print(f"plan: {len(cases)} case(s) on {args.device}" + (" (decision cases, then the stale ones)" if args.stale
                                                           else ""))
    for c, _ in cases:
        k = (c.op, c.case, c.size)
        why = []
        if k in keys:
            why.append("decision")
        if k in stale:
            why.append(f"stale: sources now {_sources.source_hash(c.op, 'cuda', 'tempokern')}")
        print(f"  {c.key}: {', '.join(why) or 'selected'}; columns {', '.join(c.steps)}")
    return Path(args.csv), None


def main(argv=None) -> Tuple[Path, Optional[Path]]:
    prog = sys.argv[0] if argv is None else "benchmarks/gpu_suite.py"
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.plan:
        return print_plan(args)
    check_build(args.device)
    for name, value in (("cache_size_limit", 64), ("recompile_limit", 64), ("accumulated_cache_size_limit", 256)):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, value)
    compiled: Dict[Tuple[Callable, bool], Callable] = {}

    def compile_fn(fn, autochunk=False):
        """One compiled wrapper per function (and auto-chunker setting); dynamo specialises it per shape
        (dynamic=False). autochunk: inductor's auto-chunker on (torch._inductor.config.auto_chunker.enable)."""
        if (fn, autochunk) not in compiled:
            opts = {"auto_chunker.enable": True} if autochunk and args.compile_backend == "inductor" else None
            compiled[(fn, autochunk)] = torch.compile(fn, dynamic=False, backend=args.compile_backend,
                                                      options=opts)
        return compiled[(fn, autochunk)]

    try:
        re.compile(args.only or "")
    except re.error as e:
        die(f"gpu_suite: --only {args.only!r} is not a regular expression ({e})")
    if not build_cases(args, torch.device("cpu" if args.device == "emu" else args.device), 0.0, compile_fn):   # cheap: cases build inputs lazily
        die(f"gpu_suite: --only {args.only!r} matches no case")
    emu = emulator() if args.device == "emu" else contextlib.nullcontext()
    suite = Suite(args, [prog] + argv)
    import tempokern
    suite.log(f"tempokern {tempokern.__version__} from {Path(tempokern.__file__).parent} on {suite.meta['device']}; "
              f"commit {suite.meta['commit']}; appending to {suite.csv_path}")
    bw = suite.bandwidth()
    cases = build_cases(args, suite.dev, bw, compile_fn)
    try:
        with emu:
            # everything but torch.compile first (compilation is the slow part), then the compile baselines
            for case, pos in cases:
                suite.run_case(case, pos, [i for i in IMPLS if i not in COMPILED], agreement=True)
            for impl in COMPILED:   # compile first on every case, then the auto-chunker (the budget cuts it first)
                for case, pos in cases:
                    if impl in case.steps:
                        suite.run_case(case, pos, [impl], agreement=False)
    finally:   # an interrupted run still gets its tables (the CSV is written row by row)
        suite._csv.close()
        text = tables(suite.rows, suite.meta, bw)
        if suite.md_path is not None:
            suite.md_path.parent.mkdir(parents=True, exist_ok=True)
            suite.md_path.write_text(text)
    print("\n" + text, flush=True)
    suite.log(f"appended {len(suite.rows)} rows to {suite.csv_path}"
              + (f"; wrote {suite.md_path}" if suite.md_path is not None else ""))
    return suite.csv_path, suite.md_path


if __name__ == "__main__":
    main()
