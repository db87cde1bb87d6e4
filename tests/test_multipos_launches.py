"""Launches and torch ops per fwd+bwd step of the blocked multi-positive InfoNCE (the CUDA path, on the
emulator): an upper bound per configuration, so that a change that adds glue ops or kernel launches fails.

The count: a TorchDispatchMode around `tempokern.multipos_infonce(...)` + `backward()` (every aten op that
reaches the dispatcher below autograd; views, allocations without a fill, and ops that launch work counted
apart) and the emulator's launch counter (tempokern kernels, including those inside tempokern's custom ops).
`python tests/test_multipos_launches.py` prints the table of docs/multipos_infonce.md ("Launches and torch ops per
step").
"""
from __future__ import annotations

import collections
import os
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tempokern  # noqa: E402
from test_multipos_infonce import make  # noqa: E402

ALLOC = {"empty", "new_empty", "empty_like", "empty_strided", "new_empty_strided"}


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)] += 1
        return func(*args, **(kwargs or {}))


def classify(ops: collections.Counter):
    views = allocs = launch = 0
    for name, n in ops.items():
        base = name.split(".")[0]
        op = getattr(torch.ops.aten, base, None)
        is_view = False
        if op is not None:
            try:
                is_view = any(o._schema.returns and o._schema.returns[0].alias_info is not None
                              and not o._schema.returns[0].alias_info.is_write
                              for o in (getattr(op, ov) for ov in op.overloads()))
            except Exception:  # noqa: BLE001
                is_view = False
        if base in ALLOC:
            allocs += n
        elif is_view:
            views += n
        else:
            launch += n
    return views, allocs, launch


MODES = ("none", "table", "exact")


def count_step(emu, B: int, mode: str, *, block_rows: int = 0, N: int = 0, symmetric: bool = True):
    """(aten ops, views, allocations, launching ops, tempokern kernel launches, Counter) of one fwd+bwd step."""
    from tempokern._ops.loss_args import span_bounds
    from tempokern._ops.multipos_infonce import blocked_multipos
    q, d, sp, neg, b = make(B, 16, N=N, bias=mode != "none", dtype=torch.float32, seed=1)
    pts = 257 if mode == "table" else None
    (qlo, qhi), (dlo, dhi) = span_bounds(sp[0]), span_bounds(sp[1])
    w = 0.5 if symmetric else 1.0

    def step():
        return blocked_multipos(q, d, qlo, qhi, dlo, dhi, temperature=0.07, bias=b, extra_neg=neg, row_weight=w,
                                col_weight=w if symmetric else 0.0, bias_table_points=pts, block_rows=block_rows)

    step().backward()  # warm-up (lazy module state, the out_dtype probes)
    k0 = emu.emu_launch_count()
    with OpCounter() as c:
        loss = step()
        loss.backward()
    k = emu.emu_launch_count() - k0
    total = sum(c.ops.values())
    v, a, launch = classify(c.ops)
    return total, v, a, launch, k, c.ops


# upper bounds of the blocked path's glue kernels: (B, block_rows, mode) -> (launching aten ops, tempokern launches)
# B = 300 is one block; block_rows = 128 gives three blocks.
BOUNDS = {  # = the counts of 2026-11-23 (float32, emulator); the table in docs/multipos_infonce.md
    (300, 0, "none"): (8, 4),
    (300, 0, "table"): (55, 5),
    (300, 0, "exact"): (60, 6),
    (300, 128, "none"): (21, 10),
    (300, 128, "table"): (68, 13),
    (300, 128, "exact"): (110, 19),
}


@pytest.mark.emu
@pytest.mark.parametrize("B,rows,mode", list(BOUNDS))
def test_fused_glue_op_and_launch_counts(cuda_emu, monkeypatch, B, rows, mode):
    from _emu_support import cuda_emulator
    with cuda_emulator(cuda_emu):
        total, v, a, launch, k, ops = count_step(cuda_emu, B, mode, block_rows=rows)
    max_launch, max_k = BOUNDS[(B, rows, mode)]
    assert launch <= max_launch, f"{launch} launching aten ops (bound {max_launch}): {dict(ops)}"
    assert k <= max_k, f"{k} tempokern launches (bound {max_k})"


def _main():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "cuda_emu"))
    import build as emu_build
    from _emu_support import cuda_emulator
    emu = emu_build.load()
    print("| B | blocks | bias | aten ops | views | allocs | launching | tempokern launches |")
    print("|---|---|---|---|---|---|---|---|")
    for rows in (0, 128):
        for mode in MODES:
            with cuda_emulator(emu):
                total, v, a, launch, k, ops = count_step(emu, 300, mode, block_rows=rows)
            nb = 1 if rows == 0 else -(-300 // rows)
            print(f"| 300 | {nb} | {mode} | {total} | {v} | {a} | {launch} | {k} |")
            if os.environ.get("VERBOSE"):
                print("   ", dict(ops))


if __name__ == "__main__":
    _main()
