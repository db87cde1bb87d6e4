"""Which source files a measured path depends on, and a hash of them: every results row carries the hash of the
sources of what it measured, so a table can say whether a figure is older than the code.

The file set of an op's default path on a device: the files named in its ``kernel`` field of
``tempokern/_ops/dispatch.py`` (``DEFAULTS``; a candidate's ``CANDIDATES`` entry for ``tempokern:<name>``), for ops
without a dispatch entry on that device the kernel files of :data:`KERNELS`, in either case the op's bindings
(:data:`BINDINGS`) and Python wrappers (:data:`PYTHON`), closed over the ``#include "..."`` lines of the C++/CUDA
files (so a change in ``csrc/common`` or a shared header marks every path that includes it). A baseline
(eager, ``torch.compile``, ...) depends on the op's reference formulation (:data:`REFERENCE`).

    python benchmarks/_sources.py OP DEVICE [PROVIDER]     # the files and the hash
"""
from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

REPO = Path(__file__).resolve().parent.parent
UNKNOWN = "unknown"

#: the ops' Python layers (wrappers, routing, the nn modules a benchmark calls)
PYTHON: Dict[str, Tuple[str, ...]] = {
    "multipos_infonce": ("tempokern/_ops/multipos_infonce.py", "tempokern/_ops/multipos_blocked.py",
                         "tempokern/_ops/routing.py", "tempokern/_ops/loss_args.py", "tempokern/_ops/common.py",
                         "tempokern/_ops/offset_bias.py"),
    "matryoshka_infonce": ("tempokern/_ops/matryoshka_infonce.py", "tempokern/_ops/matryoshka_blocked.py",
                           "tempokern/_ops/routing.py", "tempokern/_ops/multipos_blocked.py",
                           "tempokern/_ops/loss_args.py", "tempokern/_ops/common.py"),
    "re3_loss": ("tempokern/nn/re3.py", "tempokern/_ops/multipos_infonce.py", "tempokern/_ops/multipos_blocked.py",
                 "tempokern/_ops/routing.py", "tempokern/_ops/loss_args.py", "tempokern/_ops/common.py"),
    "calendar_scalar": ("tempokern/_ops/calendar.py", "tempokern/_ops/common.py"),
    "calendar_context": ("tempokern/_ops/calendar.py", "tempokern/_ops/common.py"),
    "ctd_topk": ("tempokern/_ops/ctd_topk.py", "tempokern/_ops/common.py"),
    "offset_bias": ("tempokern/_ops/offset_bias.py", "tempokern/_ops/common.py"),
}
#: the ops' bindings (the registration of the kernels the wrappers call)
BINDINGS: Dict[str, Tuple[str, ...]] = {
    "multipos_infonce": ("csrc/multipos_infonce/bind.cpp", "csrc/multipos_infonce/bind_block.cpp",
                         "csrc/offset_bias/bind.cpp"),
    "matryoshka_infonce": ("csrc/matryoshka_infonce/bind.cpp", "csrc/matryoshka_infonce/bind_block.cpp",
                           "csrc/multipos_infonce/bind_block.cpp"),
    "re3_loss": ("csrc/multipos_infonce/bind.cpp", "csrc/multipos_infonce/bind_block.cpp"),
    "calendar_scalar": ("csrc/calendar/bind.cpp",),
    "calendar_context": ("csrc/calendar/bind.cpp",),
    "ctd_topk": ("csrc/ctd_topk/bind.cpp",),
    "offset_bias": ("csrc/offset_bias/bind.cpp",),
}
#: kernel files of the (op, device) pairs the dispatch table has no entry for (one path only)
KERNELS: Dict[Tuple[str, str], Tuple[str, ...]] = {
    ("re3_loss", "cpu"): ("csrc/multipos_infonce/multipos_infonce_cpu.cpp",),
    ("re3_loss", "cuda"): ("csrc/multipos_infonce/multipos_block_cuda.cu",),
    ("calendar_scalar", "cpu"): ("csrc/calendar/calendar_cpu.cpp",),
    ("calendar_context", "cpu"): ("csrc/calendar/calendar_cpu.cpp",),
    ("ctd_topk", "cpu"): ("csrc/ctd_topk/ctd_topk_cpu.cpp",),
    ("offset_bias", "cpu"): ("csrc/offset_bias/offset_bias_cpu.cpp",),
}
#: kernels an op's paths call besides their own (the exact bias of the blocked CTD loss runs the offset_bias
#: kernels; the fused CPU loss and the CPU table bias likewise)
EXTRA: Dict[Tuple[str, str], Tuple[str, ...]] = {
    ("multipos_infonce", "cpu"): ("csrc/offset_bias/offset_bias_cpu.cpp",),
    ("multipos_infonce", "cuda"): ("csrc/offset_bias/offset_bias_cuda.cu", "csrc/offset_bias/offset_bias_f32_cuda.cu",
                                   "csrc/offset_bias/offset_bias_bf16_cuda.cu",
                                   "csrc/offset_bias/offset_bias_f16_cuda.cu",
                                   "csrc/offset_bias/offset_bias_f64_cuda.cu"),
    ("offset_bias", "cuda"): ("csrc/offset_bias/offset_bias_cuda.cu", "csrc/offset_bias/offset_bias_f32_cuda.cu",
                              "csrc/offset_bias/offset_bias_bf16_cuda.cu", "csrc/offset_bias/offset_bias_f16_cuda.cu",
                              "csrc/offset_bias/offset_bias_f64_cuda.cu"),
}
#: the reference formulation a baseline runs
REFERENCE: Dict[str, Tuple[str, ...]] = {
    "multipos_infonce": ("tempokern/reference/multipos_infonce.py", "tempokern/reference/offset_bias.py"),
    "matryoshka_infonce": ("tempokern/reference/matryoshka_infonce.py", "tempokern/reference/multipos_infonce.py"),
    "re3_loss": ("tempokern/reference/re3.py", "tempokern/reference/multipos_infonce.py"),
    "calendar_scalar": ("tempokern/reference/calendar.py",),
    "calendar_context": ("tempokern/reference/calendar.py",),
    "ctd_topk": ("tempokern/reference/ctd_topk.py",),
    "offset_bias": ("tempokern/reference/offset_bias.py",),
}
#: re3_loss's default path is multipos_infonce's (Re3Loss calls it); other ops are their own
DISPATCH_OP = {"re3_loss": "multipos_infonce"}

_FILE = re.compile(r"(?:csrc|tempokern)/[\w/]+\.(?:cuh|cu|cpp|h|py)\b")
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def _dispatch():
    sys.path.insert(0, str(REPO / "tempokern" / "_ops"))
    try:   # dispatch.py imports nothing from tempokern: read without a build
        import importlib
        return importlib.import_module("dispatch")
    finally:
        sys.path.pop(0)


def _suite_op(op: str) -> str:
    return op.split(" / ")[0].strip()


def kernel_files(op: str, device: str, provider: str = "tempokern") -> List[str]:
    """The kernel files (repository paths) the dispatch table names for the op's default paths on ``device``
    (``tempokern:<candidate>``: and that candidate's), else :data:`KERNELS`."""
    d = _dispatch()
    dop = DISPATCH_OP.get(op, op)
    files: List[str] = []
    for p in d.DEFAULTS:
        if _suite_op(p.op) == dop and p.device == device:
            files += _FILE.findall(p.kernel)
    if provider.startswith("tempokern:"):
        name = provider.split(":", 1)[1]
        for c in d.CANDIDATES:
            if c.name == name:
                files += _FILE.findall(c.kernel)
    if not files:
        files = list(KERNELS.get((op, device), ()))
    files += list(EXTRA.get((op, device), ()))
    if op == "re3_loss":
        files += list(EXTRA.get((dop, device), ()))
    return list(dict.fromkeys(files))


def include_closure(files: Sequence[str], root: Path = REPO) -> List[str]:
    """``files`` and every file they include with ``#include "..."`` (relative to the including file, then to
    csrc/), transitively; files that do not exist are left out of the closure but kept in the list."""
    out: List[str] = []
    todo = list(files)
    while todo:
        f = todo.pop(0)
        if f in out:
            continue
        out.append(f)
        p = root / f
        if not p.exists() or p.suffix == ".py":
            continue
        for inc in _INCLUDE.findall(p.read_text(encoding="utf-8", errors="replace")):
            for base in (p.parent, root / "csrc"):
                cand = (base / inc).resolve()
                if cand.exists():
                    try:
                        todo.append(str(cand.relative_to(root.resolve())))
                    except ValueError:
                        pass
                    break
    return sorted(out)


def source_files(op: str, device: str, provider: str = "tempokern") -> List[str]:
    """The repository files the row of (op, device, provider) measured."""
    if provider == "tempokern" or provider.startswith("tempokern:"):
        seeds = kernel_files(op, device, provider) + list(BINDINGS.get(op, ())) + list(PYTHON.get(op, ()))
        return include_closure(seeds)
    return sorted(REFERENCE.get(op, ()))


def hash_files(files: Sequence[str], root: Path = REPO) -> str:
    """12 hex digits of sha256 over each file's path and bytes (a missing file hashes as missing)."""
    h = hashlib.sha256()
    for f in sorted(files):
        p = root / f
        h.update(f.encode() + b"\0")
        h.update(p.read_bytes() if p.exists() else b"<missing>")
        h.update(b"\0")
    return h.hexdigest()[:12]


def source_hash(op: str, device: str, provider: str = "tempokern", root: Path = REPO) -> str:
    """The hash of the sources of what (op, device, provider) measures; ``unknown`` for an op this module does not
    map (a table then marks its rows stale)."""
    if op not in PYTHON:
        return UNKNOWN
    return hash_files(source_files(op, device, provider), root)


def is_stale(row_hash: str, op: str, device: str, provider: str) -> bool:
    """Whether a row's figure is older than the sources it measured (``unknown`` or empty: stale)."""
    return not row_hash or row_hash == UNKNOWN or row_hash != source_hash(op, device, provider)


def device_kind(device_name: str) -> str:
    """'cuda' for a GPU row's device name, 'cpu' otherwise (CPU rows name an architecture and 'cpu')."""
    return "cpu" if ("cpu" in device_name.lower() or "emulator" in device_name.lower()) else "cuda"


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    op, dev = sys.argv[1], sys.argv[2]
    prov = sys.argv[3] if len(sys.argv) > 3 else "tempokern"
    for f in source_files(op, dev, prov):
        print(f)
    print(source_hash(op, dev, prov))
