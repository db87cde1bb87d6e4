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
from typing import FrozenSet, Iterable, Iterator, Tuple

ENV = "TEMPOKERN_EXPERIMENTAL"
GPU_CSV = "benchmarks/results/gpu.csv"


@dataclass(frozen=True)
class Path:
    """A default path (or a size regime of one) of an op on a device."""
    op: str
    device: str      # "cpu" | "cuda"
    name: str
    takes: str       # which calls it takes
    kernel: str      # where it lives
    evidence: str    # the measurement that makes it the default: file and row


@dataclass(frozen=True)
class Candidate:
    """An opt-in kernel that has not run on a GPU yet (or has not won there)."""
    name: str        # its TEMPOKERN_EXPERIMENTAL name
    ops: Tuple[str, ...]
    kernel: str
    takes: str       # which calls it takes when enabled (others keep the default)
    against: str     # the default path it must beat
    decision: str    # the gpu_check.sh cases that decide it


_GPU = GPU_CSV + ": "

DEFAULTS: Tuple[Path, ...] = (
    Path("multipos_infonce / CTDLoss", "cpu", "fused", "calls without a table bias",
         "csrc/multipos_infonce/multipos_infonce_cpu.cpp", "benchmarks/results/multipos_infonce.csv"),
    Path("multipos_infonce / CTDLoss", "cpu", "blocked", "calls with a table bias (bias_table_points)",
         "tempokern/_ops/multipos_blocked.py + csrc/multipos_infonce/multipos_block_cpu.cpp",
         "benchmarks/results/multipos_infonce.csv"),
    Path("multipos_infonce / CTDLoss", "cuda", "blocked",
         "every call: cuBLAS score blocks (float32 output) + the fused statistics / gradient passes",
         "tempokern/_ops/multipos_blocked.py + csrc/multipos_infonce/multipos_block_cuda.cu",
         _GPU + "op=multipos_infonce; case=no bias; B=B=8192; impl=tempokern:blocked (1.77 ms; also B=65536, 262144, "
         "the table and the exact bias)"),
    Path("matryoshka_infonce / TMRLLoss", "cpu", "fused", "every call",
         "csrc/matryoshka_infonce/matryoshka_infonce_cpu.cpp", "benchmarks/results/matryoshka_infonce.csv"),
    Path("matryoshka_infonce / TMRLLoss", "cuda", "levels",
         "no bias and as many candidates as anchors: one blocked multipos_infonce per level",
         "tempokern/_ops/routing.py (_levels_path)",
         _GPU + "op=matryoshka_infonce; case=dims 64..768; B=B=8192; impl=tempokern:levels (6.8 ms vs "
         "tempokern:fused 13.1 ms)"),
    Path("matryoshka_infonce / TMRLLoss", "cuda", "fused",
         "a bias, or a different number of candidates than anchors (the only CUDA path for these)",
         "tempokern/_ops/matryoshka_blocked.py + csrc/matryoshka_infonce/matryoshka_block_cuda.cu",
         _GPU + "op=matryoshka_infonce; case=dims 64..768; B=B=8192; impl=tempokern:fused (13.1 ms vs the element-wise "
         "torch blocks, deleted:torch_blocks, 47.2 ms)"),
    Path("calendar_context", "cuda", "v2 forward + v1 backward",
         "every call: warp-cooperative rows forward, thread-per-row tiles backward",
         "csrc/calendar/calendar_cuda.cu",
         _GPU + "op=calendar_context; case=fwd kernel float32 dim 64; B=rows=1048576 levels=12x32x12; "
         "impl=tempokern:v2; metric=kernel_ms (forward v2 0.88 vs deleted:v1 1.31 ms; case bwd kernel float32 dim "
         "64: backward tempokern:v1 1.15 vs deleted:v2 1.51 ms)"),
    Path("calendar_scalar", "cuda", "v1", "every call: thread-per-row tiles", "csrc/calendar/calendar_cuda.cu",
         _GPU + "op=calendar_scalar; case=fwd+bwd float32; B=rows=1048576 levels=12x32x12; impl=tempokern:v1 "
         "(0.92 vs deleted:v2 1.08 ms in the 06:42 run; the 09:23 run timed v1 in two columns, 0.84 and 1.03 ms)"),
    Path("ctd_topk", "cuda", "serve", "1 to 4 queries: one scan over the gallery, no host synchronisation",
         "csrc/ctd_topk/ctd_topk_serve_cuda.cu",
         _GPU + "op=ctd_topk; case=exact bias; B=Q=1 N=1000000 k=10; impl=tempokern:serve (1.12 vs deleted:scan "
         "2.22 ms; the sweep rows, case ... sweep, B=Q=1 to Q=4: serve faster at every Q)"),
    Path("ctd_topk", "cuda", "select", "5 or more queries: cuBLAS score tiles + the fused select",
         "csrc/ctd_topk/ctd_topk_cuda.cu (select_block)",
         _GPU + "op=ctd_topk; case=no bias N=1000000 k=10 bf16 sweep; B=Q=8; impl=tempokern:select (1.10 vs "
         "candidate-range:serve 2.94 ms; Q=16 and the exact bias likewise; Q=1024: case no bias, 6.80 ms)"),
    Path("offset_bias", "cuda", "pruned", "exact MLP: hidden units proved always off skipped, always-on units "
         "merged into one float64 linear unit", "csrc/offset_bias/offset_bias_kernels.cuh",
         _GPU + "op=offset_bias; case=exact fwd+bwd float32; B=8192x8192; impl=tempokern:pruned (16.5 vs "
         "deleted:every_unit 38.0 ms)"),
)

CANDIDATES: Tuple[Candidate, ...] = (
    Candidate("mpb_tc", ("multipos_infonce / CTDLoss",), "csrc/matryoshka_infonce/matryoshka_tc_cuda.cu",
              "bfloat16 CUDA calls without a bias or with the table bias, no extra negatives, no return_hardest, "
              "H a multiple of 16, on compute capability >= 8.0: the tensor-core kernels (scores never leave "
              "the SM)", "blocked",
              "CTD loss no bias and table bias (4097) at B = 8,192 and 65,536"),
    Candidate("mrl_tc", ("matryoshka_infonce / TMRLLoss",), "csrc/matryoshka_infonce/matryoshka_tc_cuda.cu",
              "bfloat16 CUDA calls without extra negatives or the exact bias, level boundaries multiples of 16, "
              "on compute capability >= 8.0: the tensor-core kernels", "levels / fused",
              "Matryoshka dims 64..768 at B = 8,192"),
    Candidate("calendar_v3", ("calendar_context", "calendar_scalar"), "csrc/calendar/calendar_v3_cuda.cu",
              "float32 / float16 / bfloat16 levels of <= 32 classes (context: dim a multiple of 4 up to 128, "
              "an upstream gradient with unit column stride): persistent tiles with the next reads in flight",
              "v2 forward + v1 backward / v1", "calendar_context and calendar_scalar at 1M rows"),
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
