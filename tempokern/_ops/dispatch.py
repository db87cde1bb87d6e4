"""Which kernel path each op runs: one table.

Per op and device the table names the **default** path (a path that ran on a GPU, passed the CUDA tests and
compute-sanitizer, and won a committed measurement: its evidence is a row of ``benchmarks/results/gpu.csv``
or, on the CPU, a per-op CSV) and the **candidates**: kernels written and tested on the CUDA emulator but not
yet timed on a GPU. A candidate runs only when it is named in the environment variable
``TEMPOKERN_EXPERIMENTAL`` (a comma-separated list of candidate names, ``all`` for every candidate), or inside
:func:`use` (tests). At most one candidate per kernel family. ``tools/gpu_check.sh`` times each candidate
against its default; the measurement either makes it the default (and deletes the old path) or deletes it.

The README's and ``docs/performance.md``'s table of paths is generated from this module
(``python -m tempokern._ops.dispatch``), so the table cannot disagree with the code.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
from dataclasses import dataclass
from typing import Callable, FrozenSet, Iterable, Iterator, Tuple, Union

ENV = "TEMPOKERN_EXPERIMENTAL"
GPU_CSV = "benchmarks/results/gpu.csv"


def _doc(fn: Callable) -> str:
    """A predicate's docstring as one line: the table's "takes" column."""
    return " ".join((fn.__doc__ or "").split())


@dataclass(frozen=True)
class Path:
    """A default path (or a size regime of one) of an op on a device. ``predicate(call, backend)`` says whether it
    takes a call (``call``: the op's validated call object, ``backend``: tempokern/_ops/backend.py's Backend);
    its docstring is the table's "takes". ``kernels``: (role, kernel) pairs where the op runs different kernels
    per role (calendar: fwd / bwd)."""
    op: str
    device: str      # "cpu" | "cuda"
    name: str
    predicate: Callable
    kernel: str      # where it lives
    evidence: str    # the measurement that makes it the default: file and row
    kernels: Tuple[Tuple[str, str], ...] = ()

    @property
    def takes(self) -> str:
        """Which calls it takes (the predicate's docstring)."""
        return _doc(self.predicate)

    def kernel_for(self, role: str) -> str:
        return dict(self.kernels)[role]


@dataclass(frozen=True)
class Candidate:
    """An opt-in kernel that has not run on a GPU yet (or has not won there)."""
    name: str        # its TEMPOKERN_EXPERIMENTAL name
    ops: Tuple[str, ...]
    kernel: str
    predicate: Callable  # which calls it takes when enabled (others keep the default); docstring: "takes"
    against: str     # the default path it must beat
    decision: str    # the gpu_check.sh cases that decide it
    kernels: Tuple[Tuple[str, str], ...] = ()

    @property
    def takes(self) -> str:
        """Which calls it takes when enabled (the predicate's docstring)."""
        return _doc(self.predicate)

    def kernel_for(self, role: str) -> str:
        return dict(self.kernels)[role]


# ---- the predicates: call objects are built by the op modules (their attributes and methods are named here);
# backend is tempokern/_ops/backend.py's Backend. A predicate's docstring is its row's "takes" column.

MULTIPOS = "multipos_infonce / CTDLoss"
MATRYOSHKA = "matryoshka_infonce / TMRLLoss"


def _mp_cpu_fused(call, backend) -> bool:
    """calls without a table bias"""
    return not backend.cuda_path and not call.table


def _mp_cpu_blocked(call, backend) -> bool:
    """calls with a table bias (bias_table_points)"""
    return not backend.cuda_path and call.table


def _cuda_blocked(call, backend) -> bool:
    """every call: cuBLAS score blocks (float32 output) + the fused statistics / gradient passes"""
    return backend.cuda_path


def _every_cpu_call(call, backend) -> bool:
    """every call"""
    return not backend.cuda_path


def _mrl_cpu_fused(call, backend) -> bool:
    """calls without a bias"""
    return not backend.cuda_path and call.bias is None


def _mrl_cpu_blocked(call, backend) -> bool:
    """calls with a bias: element-wise torch blocks of rows, the bias computed once per block and shared by the
    levels"""
    return not backend.cuda_path and call.bias is not None


def _mrl_levels(call, backend) -> bool:
    """no bias and as many candidates as anchors: one blocked multipos_infonce per level"""
    return backend.cuda_path and call.bias is None and call.rows == call.cols and call.rows > 0


def _mrl_fused(call, backend) -> bool:
    """a bias, or a different number of candidates than anchors (the only CUDA path for these)"""
    return backend.cuda_path


def _calendar_context(call, backend) -> bool:
    """every call: warp-cooperative rows forward, thread-per-row tiles backward"""
    return backend.cuda_path


def _calendar_scalar(call, backend) -> bool:
    """every call: thread-per-row tiles"""
    return backend.cuda_path


def _topk_serve(call, backend) -> bool:
    """1 to 4 queries: one scan over the gallery, no host synchronisation"""
    return backend.cuda_path and not call.rerank and call.queries >= 1 and call.serve_fits()  # <= 4: serve_fits


def _topk_select(call, backend) -> bool:
    """5 or more queries: cuBLAS score tiles + the fused select"""
    return backend.cuda_path


def _topk_cpu(call, backend) -> bool:
    """CPU calls, and candidate reranking (cand; CPU tensors only): query blocks through the per-thread top-k
    kernel"""
    return not backend.cuda_path or call.rerank


def _bias_cpu(call, backend) -> bool:
    """every call: the hidden units proved always off dropped, the always-on ones merged into one linear unit"""
    return not backend.cuda_path


def _bias_pruned(call, backend) -> bool:
    """exact MLP: hidden units proved always off skipped, always-on units merged into one float64 linear unit"""
    return backend.cuda_path


def _mpb_tc(call, backend) -> bool:
    """bfloat16 CUDA calls without a bias or with the table bias, no extra negatives, no return_hardest, no groups,
    H a multiple of 16, on compute capability >= 8.0: the tensor-core kernels (scores never leave the SM)"""
    return (backend.cuda_path and not call.return_hardest and not call.groups and call.rows > 0 and call.cols > 0
            and call.tensor_cores(backend))


def _mrl_tc(call, backend) -> bool:
    """bfloat16 CUDA calls without extra negatives or the exact bias, level boundaries multiples of 16, on compute
    capability >= 8.0: the tensor-core kernels"""
    return backend.cuda_path and call.tensor_cores(backend)


def _calendar_v3(call, backend) -> bool:
    """float32 / float16 / bfloat16 levels of <= 32 classes (context: dim a multiple of 4 up to 128, an upstream
    gradient with unit column stride): persistent tiles with the next reads in flight"""
    return backend.cuda_path and call.v3_takes()


_GPU = GPU_CSV + ": "

DEFAULTS: Tuple[Path, ...] = (
    Path(MULTIPOS, "cpu", "fused", _mp_cpu_fused,
         "csrc/multipos_infonce/multipos_infonce_cpu.cpp", "benchmarks/results/multipos_infonce.csv"),
    Path(MULTIPOS, "cpu", "blocked", _mp_cpu_blocked,
         "tempokern/_ops/multipos_blocked.py + csrc/multipos_infonce/multipos_block_cpu.cpp",
         "benchmarks/results/multipos_infonce.csv"),
    Path(MULTIPOS, "cuda", "blocked", _cuda_blocked,
         "tempokern/_ops/multipos_blocked.py + csrc/multipos_infonce/multipos_block_cuda.cu",
         _GPU + "op=multipos_infonce; case=no bias; B=B=8192; impl=tempokern:blocked (run 2026-11-23T09:23, commit "
         "9669fb6; also B=65536, 262144, the table and the exact bias)"),
    Path(MATRYOSHKA, "cpu", "fused", _mrl_cpu_fused,
         "csrc/matryoshka_infonce/matryoshka_infonce_cpu.cpp", "benchmarks/results/matryoshka_infonce.csv"),
    Path(MATRYOSHKA, "cpu", "blocked", _mrl_cpu_blocked, "tempokern/_ops/matryoshka_blocked.py",
         "benchmarks/results/matryoshka_infonce.csv"),
    Path(MATRYOSHKA, "cuda", "levels", _mrl_levels,
         "tempokern/_ops/routing.py (_levels_path)",
         _GPU + "op=matryoshka_infonce; case=dims 64..768; B=B=8192; impl=tempokern:levels (against "
         "tempokern:fused; run 2026-11-23T09:23, commit 9669fb6)"),
    Path(MATRYOSHKA, "cuda", "fused", _mrl_fused,
         "tempokern/_ops/matryoshka_blocked.py + csrc/matryoshka_infonce/matryoshka_block_cuda.cu",
         _GPU + "op=matryoshka_infonce; case=dims 64..768; B=B=8192; impl=tempokern:fused (against the element-wise "
         "torch blocks, deleted:torch_blocks; run 2026-11-23T09:23, commit 9669fb6)"),
    Path("calendar_context", "cpu", "cpu", _every_cpu_call, "csrc/calendar/calendar_cpu.cpp",
         "benchmarks/results/calendar.csv", kernels=(("fwd", "cpu"), ("bwd", "cpu"))),
    Path("calendar_context", "cuda", "v2 forward + v1 backward", _calendar_context,
         "csrc/calendar/calendar_cuda.cu",
         _GPU + "op=calendar_context; case=fwd kernel float32 dim 64; B=rows=1048576 levels=12x32x12; "
         "impl=tempokern:v2; metric=kernel_ms (against deleted:v1; and case bwd kernel float32 dim 64: "
         "tempokern:v1 against deleted:v2; run 2026-11-23, commit f8eb810)",
         kernels=(("fwd", "groups"), ("bwd", "tiles"))),
    Path("calendar_scalar", "cpu", "cpu", _every_cpu_call, "csrc/calendar/calendar_cpu.cpp",
         "benchmarks/results/calendar.csv", kernels=(("fwd", "cpu"), ("bwd", "cpu"))),
    Path("calendar_scalar", "cuda", "v1", _calendar_scalar, "csrc/calendar/calendar_cuda.cu",
         _GPU + "op=calendar_scalar; case=fwd+bwd float32; B=rows=1048576 levels=12x32x12; impl=tempokern:v1 "
         "(against deleted:v2; run 2026-11-23T06:42, commit f8eb810; the run 2026-11-23T09:23, commit 9669fb6, "
         "timed v1 alone, in two columns)",
         kernels=(("fwd", "tiles"), ("bwd", "tiles"))),
    Path("ctd_topk", "cpu", "cpu", _topk_cpu, "csrc/ctd_topk/ctd_topk_cpu.cpp", "benchmarks/results/ctd_topk.csv"),
    Path("ctd_topk", "cuda", "serve", _topk_serve,
         "csrc/ctd_topk/ctd_topk_serve_cuda.cu",
         _GPU + "op=ctd_topk; case=exact bias; B=Q=1 N=1000000 k=10; impl=tempokern:serve (against deleted:scan; "
         "run 2026-11-23T09:23, commit 9669fb6; and the sweep rows, case ... sweep, B=Q=1 to Q=4)"),
    Path("ctd_topk", "cuda", "select", _topk_select,
         "csrc/ctd_topk/ctd_topk_cuda.cu (select_block)",
         _GPU + "op=ctd_topk; case=no bias N=1000000 k=10 bf16 sweep; B=Q=8; impl=tempokern:select (against "
         "candidate-range:serve; run 2026-11-23, commit f8eb810; and B=Q=16, the exact bias; Q=1024: case no "
         "bias, B=Q=1024 N=1000000 k=10, run 2026-11-23T09:23, commit 9669fb6)"),
    Path("offset_bias", "cpu", "merged units", _bias_cpu, "csrc/offset_bias/offset_bias_cpu.cpp",
         "benchmarks/results/offset_bias.csv"),
    Path("offset_bias", "cuda", "pruned", _bias_pruned, "csrc/offset_bias/offset_bias_kernels.cuh",
         _GPU + "op=offset_bias; case=exact fwd+bwd float32; B=8192x8192; impl=tempokern:pruned (against "
         "deleted:every_unit; run 2026-11-23T09:23, commit 9669fb6)"),
)

CANDIDATES: Tuple[Candidate, ...] = (
    Candidate("mpb_tc", (MULTIPOS,), "csrc/matryoshka_infonce/matryoshka_tc_cuda.cu", _mpb_tc, "blocked",
              "CTD loss no bias and table bias (4097) at B = 8,192 and 65,536"),
    Candidate("mrl_tc", (MATRYOSHKA,), "csrc/matryoshka_infonce/matryoshka_tc_cuda.cu", _mrl_tc,
              "levels / fused", "Matryoshka dims 64..768 at B = 8,192"),
    Candidate("calendar_v3", ("calendar_context", "calendar_scalar"), "csrc/calendar/calendar_v3_cuda.cu",
              _calendar_v3, "v2 forward + v1 backward / v1", "calendar_context and calendar_scalar at 1M rows",
              kernels=(("fwd", "v3"), ("bwd", "v3"))),
)

NAMES: Tuple[str, ...] = tuple(c.name for c in CANDIDATES)

_override: contextvars.ContextVar = contextvars.ContextVar("tempokern_experimental", default=None)
_parsed: dict = {}


def _parse(value: str) -> FrozenSet[str]:
    if value in _parsed:
        return _parsed[value]
    names = [v.strip().lower() for v in value.split(",") if v.strip()]
    if names == ["all"]:
        out = frozenset(NAMES)
    else:
        for n in names:
            if n not in NAMES:
                raise ValueError(f"{ENV} names an unknown candidate {n!r}: the candidates are "
                                 f"{', '.join(NAMES)} (or 'all')")
        out = frozenset(names)
    _parsed[value] = out
    return out


def experimental() -> FrozenSet[str]:
    """The enabled candidates: those of :func:`use` inside it, else of the environment variable."""
    o = _override.get()
    if o is not None:
        return o
    return _parse(os.environ.get(ENV, ""))


def _trace_constant(fn):
    """tempokern._util.trace_constant, repeated here: tools/gpu_decide.py reads this file without a build, so it
    imports nothing from tempokern."""
    fn._dynamo_marked_constant = True
    return fn


@_trace_constant  # fixed for a compiled region: the environment is read when it is traced
def enabled(name: str) -> bool:
    """Whether candidate ``name`` is enabled (a name not in the table is a programming error)."""
    if name not in NAMES:
        raise ValueError(f"unknown candidate {name!r}; candidates: {NAMES}")
    return name in experimental()


@contextlib.contextmanager
def use(*names: str) -> Iterator[None]:
    """Runs the block with exactly the candidates ``names`` enabled (none: only the defaults), whatever the
    environment says. For tests and benchmarks; a context variable, so other threads keep their paths."""
    token = _override.set(_parse(",".join(names)))
    try:
        yield
    finally:
        _override.reset(token)


def choose(op: str, call, backend) -> Union[Path, Candidate]:
    """The path that runs ``call`` of ``op`` on ``backend``: the first enabled candidate whose predicate takes it,
    else the first default whose predicate does (a LookupError if none: a gap in the table). The only place
    that chooses a kernel path (tests/test_dispatch.py checks that the op modules ask nothing else)."""
    for c in CANDIDATES:
        if op in c.ops and enabled(c.name) and c.predicate(call, backend):
            return c
    for p in DEFAULTS:
        if p.op == op and p.predicate(call, backend):
            return p
    raise LookupError(f"no path of {op} in tempokern/_ops/dispatch.py takes this call on the {backend.kind} backend")


def candidate(name: str) -> Candidate:
    for c in CANDIDATES:
        if c.name == name:
            return c
    raise ValueError(f"unknown candidate {name!r}; candidates: {NAMES}")


def paths_markdown() -> str:
    """The table of paths (defaults with their evidence, then the candidates) as Markdown."""
    out = ["| op | device | default path | takes | evidence |", "|---|---|---|---|---|"]
    for p in DEFAULTS:
        out.append(f"| {p.op} | {p.device} | {p.name} | {p.takes} | {p.evidence} |")
    out += ["", f"Candidates (opt-in: `{ENV}=name[,name]` or `all`; not timed on a GPU, so not a default):", "",
            "| name | op | takes when enabled | must beat | decided by |", "|---|---|---|---|---|"]
    for c in CANDIDATES:
        out.append(f"| `{c.name}` | {' / '.join(c.ops)} | {c.takes} | {c.against} | {c.decision} |")
    return "\n".join(out)


def summary_markdown() -> str:
    """One row per op: its CUDA default path(s) and its candidate, if any (the README's table)."""
    ops = []
    for p in DEFAULTS:
        if p.device == "cuda" and p.op not in ops:
            ops.append(p.op)
    out = [f"| op | CUDA default (measured) | candidate (`{ENV}=`) |", "|---|---|---|"]
    for op in ops:
        names = " / ".join(p.name for p in DEFAULTS if p.op == op and p.device == "cuda")
        cands = ", ".join(f"`{c.name}`" for c in CANDIDATES if op in c.ops) or "none"
        out.append(f"| {op} | {names} | {cands} |")
    return "\n".join(out)


#: marker name -> table generator
TABLES = {"paths-table": paths_markdown, "paths-summary": summary_markdown}


def render_into(text: str) -> str:
    """``text`` with the part between each pair of markers ``<!-- NAME:begin -->`` / ``<!-- NAME:end -->`` (NAME in
    TABLES) replaced by the generated table, markers kept. A file without any marker pair is a ValueError."""
    found = False
    for name, make in TABLES.items():
        begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
        i, j = text.find(begin), text.find(end)
        if i < 0 or j < i:
            continue
        found = True
        text = text[:i + len(begin)] + "\n" + make() + "\n" + text[j:]
    if not found:
        raise ValueError(f"no table markers ({', '.join(TABLES)}) found")
    return text


def _main(argv: Iterable[str]) -> int:
    import sys
    args = list(argv)
    if not args:
        print(paths_markdown())
        return 0
    for path in args:  # files whose marked table is rewritten in place
        with open(path, encoding="utf-8") as f:
            text = f.read()
        new = render_into(text)
        if new != text:
            with open(path, "w", encoding="utf-8") as f:
                f.write(new)
            print(f"updated {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    import sys
    raise SystemExit(_main(sys.argv[1:]))
