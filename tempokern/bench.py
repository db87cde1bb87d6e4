"""`tempokern bench`: fused op vs its plain-PyTorch reference, same inputs, same run.

Times forward (+ backward where the op has gradients) and the extra peak memory of each
provider, for every op that this install has in both `tempokern` and `tempokern.reference`, and
checks that they agree: the largest difference between fused and reference outputs and gradients
(relative to each tensor's largest magnitude), so `tempokern bench --device cuda` also verifies the
CUDA kernels on a GPU.
CPU peak memory is the process high-water mark (VmHWM, reset through /proc/self/clear_refs)
above the resident size before the call; CUDA uses torch.cuda.max_memory_allocated."""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import re
import statistics
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

# ---- memory ----------------------------------------------------------------------------------------

def _status_kb(field: str) -> Optional[int]:
    try:
        m = re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text())
        return int(m.group(1)) if m else None
    except OSError:
        return None


def _reset_cpu_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def measure(fn: Callable[[], object], device: torch.device, repeat: int = 3, warmup: int = 1,
            times_out: Optional[list] = None) -> Tuple[float, Optional[float]]:
    """(median ms, extra peak MB or None when this platform cannot tell); every timing is
    appended to `times_out` when given."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t) * 1e3)
    if times_out is not None:
        times_out.extend(times)
    peak = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2 ** 20
    elif _reset_cpu_peak():
        base = _status_kb("VmRSS")
        fn()
        hwm = _status_kb("VmHWM")
        if base is not None and hwm is not None:
            peak = max(0, hwm - base) / 1024
    return statistics.median(times), peak


# ---- cases -----------------------------------------------------------------------------------------

def _bias_inputs(Bq, Bd, D, hidden, device, gen, requires_grad=True):
    def t(*shape, scale=1.0):
        x = (torch.randn(*shape, generator=gen) * scale).to(device)
        return x.requires_grad_(requires_grad)
    u_q = torch.rand(Bq, generator=gen).to(device).requires_grad_(requires_grad)
    u_d = torch.rand(Bd, generator=gen).to(device).requires_grad_(requires_grad)
    return (u_q, u_d, t(hidden, D, scale=D ** -0.5), t(hidden, scale=0.1), t(1, hidden, scale=hidden ** -0.5),
            t(1, scale=0.1), torch.tensor(0.5, device=device).requires_grad_(requires_grad))


def _case_calendar_scalar(B, H, device, gen):
    xs = [torch.randn(B, n, generator=gen).to(device).requires_grad_() for n in (12, 32, 12)]
    return (xs,), {}, xs


def _case_calendar_context(B, H, device, gen):
    xs = [torch.randn(B, n, generator=gen).to(device).requires_grad_() for n in (12, 32, 12)]
    return (xs, 64), {}, xs


def _case_offset_bias(B, H, device, gen):
    args = _bias_inputs(B, B, 32, 32, device, gen)
    return args, {}, list(args)


def _case_multipos_infonce(B, H, device, gen):
    q = torch.nn.functional.normalize(torch.randn(B, H, generator=gen), dim=-1).to(device).requires_grad_()
    d = torch.nn.functional.normalize(torch.randn(B, H, generator=gen), dim=-1).to(device).requires_grad_()
    s = torch.randint(0, max(2, B // 4), (B,), generator=gen).to(device)
    e = s + torch.randint(0, 3, (B,), generator=gen).to(device)
    ds = torch.randint(0, max(2, B // 4), (B,), generator=gen).to(device)
    bias = _bias_inputs(B, B, 32, 32, device, gen)
    return (q, d, (s, e), (ds, ds)), {"temperature": 0.05, "bias": bias}, [q, d, *bias]


def _case_ctd_topk(B, H, device, gen):
    q = torch.randn(max(1, B // 8), H, generator=gen).to(device)
    g = torch.randn(B * 8, H, generator=gen).to(device)
    return (q, g, 10), {}, []


CASES = {
    "calendar_scalar": _case_calendar_scalar,
    "calendar_context": _case_calendar_context,
    "offset_bias": _case_offset_bias,
    "multipos_infonce": _case_multipos_infonce,
    "ctd_topk": _case_ctd_topk,
}


def available_ops() -> List[str]:
    import tempokern
    from tempokern import reference
    return [op for op in CASES if callable(getattr(tempokern, op, None)) and callable(getattr(reference, op, None))]


def _runner(fn, args, kwargs, grads_of):
    def run():
        out = fn(*args, **kwargs)
        if grads_of:
            if isinstance(out, (tuple, list)):
                out = out[0]
            loss = out.float().sum() if out.ndim else out.float()
            torch.autograd.grad(loss, grads_of, allow_unused=True)
        return out
    return run


def _results(fn, op, size, hidden, device, seed) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """(floating outputs, gradients of their sum) for one provider on the case's inputs."""
    gen = torch.Generator().manual_seed(seed)
    args, kwargs, grads_of = CASES[op](size, hidden, device, gen)
    out = fn(*args, **kwargs)
    outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if o.is_floating_point()]
    grads = []
    if grads_of:
        loss = outs[0].float().sum() if outs[0].ndim else outs[0].float()
        grads = torch.autograd.grad(loss, grads_of, allow_unused=True)
        grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, grads_of)]
    return [o.detach() for o in outs], grads


def max_rel_diff(op: str, size: int, hidden: int, device: torch.device, seed: int = 0) -> float:
    """max over outputs and gradients of max|fused - reference| / scale, where scale is the tensor's
    largest reference magnitude, floored for gradients at 1e-3 of the largest gradient magnitude (a
    gradient that is zero in exact arithmetic, such as the loss's with respect to a constant bias
    shift, is rounding noise in both providers)."""
    import tempokern
    from tempokern import reference
    fa, ga = _results(getattr(tempokern, op), op, size, hidden, device, seed)
    fb, gb = _results(getattr(reference, op), op, size, hidden, device, seed)
    a, b, n_out = fa + ga, fb + gb, len(fb)  # outputs first, then gradients
    if len(fa) != len(fb) or len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return math.inf
    mags = [y.double().abs().max().item() if y.numel() else 0.0 for y in b]
    floor = 1e-3 * max(mags[n_out:], default=0.0)
    worst = 0.0
    for i, (x, y) in enumerate(zip(a, b)):
        diff = (x.double() - y.double()).abs().max().item() if x.numel() else 0.0
        scale = mags[i] if i < n_out else max(mags[i], floor)
        worst = max(worst, diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf))
    return worst


def bench_op(op: str, size: int, hidden: int, device: torch.device, repeat: int = 3, seed: int = 0,
             check: bool = True) -> List[dict]:
    import tempokern
    from tempokern import reference
    rows = []
    for provider, fn in (("fused", getattr(tempokern, op)), ("reference", getattr(reference, op))):
        gen = torch.Generator().manual_seed(seed)
        args, kwargs, grads_of = CASES[op](size, hidden, device, gen)
        try:
            all_ms: list = []
            ms, mb = measure(_runner(fn, args, kwargs, grads_of), device, repeat=repeat, times_out=all_ms)
            rows.append({"op": op, "provider": provider, "size": size, "hidden": hidden, "ms": ms,
                         "min_ms": min(all_ms), "extra_peak_mb": mb, "pass": "fwd+bwd" if grads_of else "fwd"})
        except (RuntimeError, MemoryError) as e:   # the reference running out of memory is a result too
            rows.append({"op": op, "provider": provider, "size": size, "hidden": hidden, "ms": None,
                         "extra_peak_mb": None, "pass": "fwd+bwd" if grads_of else "fwd",
                         "error": str(e).splitlines()[0][:200]})
    if check and all(r["ms"] is not None for r in rows):
        rows[0]["max_rel_diff"] = max_rel_diff(op, size, hidden, device, seed)
    return rows


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.machine()} CPU, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}"


def run_bench(ops: Optional[Sequence[str]] = None, sizes: Sequence[int] = (256, 1024), hidden: int = 256,
              device: str = "cpu", repeat: int = 3) -> dict:
    dev = torch.device(device)
    have = available_ops()
    ops = list(ops) if ops else have
    for op in ops:
        if op not in CASES:
            raise ValueError(f"unknown op {op!r}: expected some of {', '.join(CASES)}")
    skipped = [op for op in ops if op not in have]
    rows = []
    for op in ops:
        if op in skipped:
            continue
        for n in sizes:
            rows.extend(bench_op(op, int(n), hidden, dev, repeat))
    return {"device": device_name(dev), "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "rows": rows,
            "skipped": {op: "not in this install (fused op or reference missing)" for op in skipped}}


def speedups(result: dict) -> List[dict]:
    out = []
    by = {(r["op"], r["size"], r["provider"]): r for r in result["rows"]}
    for (op, n, prov), r in by.items():
        if prov != "fused":
            continue
        ref = by.get((op, n, "reference"))
        row = {"op": op, "size": n, "pass": r["pass"], "fused_ms": r["ms"], "reference_ms": ref and ref["ms"],
               "fused_min_ms": r.get("min_ms"), "reference_min_ms": ref and ref.get("min_ms"),
               "fused_peak_mb": r["extra_peak_mb"], "reference_peak_mb": ref and ref["extra_peak_mb"]}
        row["speedup"] = (ref["ms"] / r["ms"]) if ref and ref["ms"] and r["ms"] else None
        row["max_rel_diff"] = r.get("max_rel_diff")
        out.append(row)
    return out


def markdown(result: dict) -> str:
    def f(v, fmt):
        return "" if v is None else format(v, fmt)
    lines = [f"Device: {result['device']}; torch {result['torch']}; {result['date']}", "",
             "Times: median (min) over the repeats, in ms.", "",
             "Agreement: max |fused - reference| / max |reference| over the outputs and gradients.", "",
             "| op | size | pass | fused ms | reference ms | speed-up | fused extra peak MB | reference extra peak MB "
             "| agreement |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in speedups(result):
        fm = f"{f(r['fused_ms'], '.2f')} ({f(r.get('fused_min_ms'), '.2f')})"
        rm = f"{f(r['reference_ms'], '.2f')} ({f(r.get('reference_min_ms'), '.2f')})"
        lines.append(f"| {r['op']} | {r['size']} | {r['pass']} | {fm} | {rm} | "
                     f"{f(r['speedup'], '.1f')}{'x' if r['speedup'] else ''} | {f(r['fused_peak_mb'], '.1f')} | "
                     f"{f(r['reference_peak_mb'], '.1f')} | {f(r['max_rel_diff'], '.1e')} |")
    for op, why in result.get("skipped", {}).items():
        lines.append(f"\n{op}: skipped, {why}")
    return "\n".join(lines) + "\n"


def plot(result: dict, path) -> Optional[str]:
    """Bar chart of fused vs reference time (log scale) per op and size; None if matplotlib is absent."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in speedups(result) if r["fused_ms"] and r["reference_ms"]]
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(rows) + 2), 4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["reference_ms"] for r in rows], width=0.4, label="reference (PyTorch)")
    ax.bar([x + 0.2 for x in xs], [r["fused_ms"] for r in rows], width=0.4, label="tempokern fused")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([f"{r['op']}\nB={r['size']}" for r in rows], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("ms (median, log scale)")
    ax.set_title(f"fused vs reference, {result['device']}", fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save_fig(fig, path)
    plt.close(fig)
    return str(path)


def _save_fig(fig, path) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)


def write_outputs(result: dict, out_dir) -> Dict[str, str]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    for name, text in (("bench.json", json.dumps(result, indent=1)), ("bench.md", markdown(result))):
        tmp = out / (name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, out / name)
        files[name] = str(out / name)
    png = plot(result, out / "bench.png")
    if png:
        files["bench.png"] = png
    return files
