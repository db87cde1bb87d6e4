"""The CUDA emulator (tools/cuda_emu) itself: it must report the faults a GPU would hit, and tempokern's
kernels must give the same numbers whatever order the emulated threads reach their barriers in (a data
race between barriers changes results under a shuffled order) and within sm_86's shared memory."""
import os
import sys

import pytest
import torch
from _emu_support import patch_kernels, patch_sm_count, real_kernels, real_sm_count  # noqa: F401

import tempokern
from tempokern import reference as ref
from _emu_support import cuda_emulator
from tempokern.nn.offset_bias import bias_params

pytestmark = pytest.mark.emu


def selftest(emu, name, arg=0):
    out = torch.full((256,), -7.0)
    emu.emu_selftest(name, out.data_ptr(), arg)
    return out


@pytest.fixture
def seed(cuda_emu):
    yield lambda s: cuda_emu.emu_set_seed(s)
    cuda_emu.emu_set_seed(0)


def test_warp_shuffle_and_ballot(cuda_emu):
    out = selftest(cuda_emu, "warp_sum")[:32]
    assert torch.equal(out, torch.full((32,), 496.0 + 11 * 1000.0))  # sum of lanes; 11 lanes with lane % 3 == 0


def test_wmma_result_and_alignment(cuda_emu):
    out = selftest(cuda_emu, "wmma_misaligned", 0)
    assert torch.equal(out, torch.full((256,), 16.0))  # ones(16x16) @ ones(16x16)
    with pytest.raises(RuntimeError, match="256-bit aligned"):
        selftest(cuda_emu, "wmma_misaligned", 1)


def test_shuffle_with_an_exited_lane_is_reported(cuda_emu):
    with pytest.raises(RuntimeError, match="exited"):
        selftest(cuda_emu, "shfl_after_exit")


def test_divergent_barriers_are_reported_not_hung(cuda_emu):
    with pytest.raises(RuntimeError, match="cannot make progress"):
        selftest(cuda_emu, "shfl_vs_syncthreads")


def test_dynamic_shared_memory_above_48k_needs_the_attribute(cuda_emu):
    with pytest.raises(RuntimeError, match="dynamic shared memory"):
        selftest(cuda_emu, "big_smem", 0)
    assert torch.equal(selftest(cuda_emu, "big_smem", 1)[:32], torch.ones(32))


def test_a_race_shows_under_shuffled_thread_orders(cuda_emu, seed):
    want = (torch.arange(64) + 1) % 64
    results = []
    for s in range(4):
        seed(s)
        assert torch.equal(selftest(cuda_emu, "race", 1)[:64], want.float())  # with __syncthreads
        results.append(selftest(cuda_emu, "race", 0)[:64])
    assert not torch.equal(results[0], want.float())  # index order: neighbours not yet written (NaN)
    assert any(not torch.equal(r, results[1]) for r in results[2:])  # and the result depends on the order


# ---- tempokern's kernels under shuffled thread orders ------------------------------------------

def _ops_under(emu):
    """Every CUDA kernel family once, float64 (float32 for the tensor-core paths), outputs and grads."""
    torch.manual_seed(3)  # OffsetBias's initialisation
    g = torch.Generator().manual_seed(3)
    r = lambda *s, dt=torch.float64: torch.randn(*s, generator=g, dtype=torch.float64).to(dt)  # noqa: E731
    outs = []
    with cuda_emulator(emu):
        # offset_bias forward + backward
        xs = [torch.rand(70, generator=g, dtype=torch.float64) * 3 - 1, torch.rand(90, generator=g, dtype=torch.float64),
              r(6, 10), r(6), r(1, 6), r(1), torch.tensor(0.7, dtype=torch.float64)]
        xs = [x.requires_grad_() for x in xs]
        o = tempokern.offset_bias(*xs)
        outs += [o, *torch.autograd.grad((o * r(70, 90)).sum(), xs)]
        # multipos_infonce with bias and extra negatives (float64: CUDA-core tiles; float16: wmma)
        for dt in (torch.float64, torch.float16):
            q, d, neg = (r(n, 40, dt=dt).requires_grad_() for n in (150, 150, 20))
            lo = torch.randint(0, 60, (150,), generator=g)
            bias = tuple(x.requires_grad_() for x in (torch.rand(150, generator=g, dtype=torch.float64),
                                                       torch.rand(150, generator=g, dtype=torch.float64),
                                                       r(5, 7), r(5), r(1, 5), r(1), torch.tensor(0.5, dtype=torch.float64)))
            loss = tempokern.multipos_infonce(q, d, (lo, lo + 3), (lo.flip(0), lo.flip(0) + 2), temperature=0.1,
                                              bias=bias, extra_neg=neg)
            outs += [loss, *torch.autograd.grad(loss, [q, d, neg, *bias])]
        # ctd_topk: semantic, exact bias (float32) and table
        qf, gf = r(70, 48, dt=torch.float32), r(1500, 48, dt=torch.float32)
        outs += list(tempokern.ctd_topk(qf, gf, 12))
        m = tempokern.nn.OffsetBias(16, 8)
        with torch.no_grad():
            m.scale.fill_(2.0)
        uq, ug = torch.rand(70, generator=g), torch.rand(1500, generator=g)
        outs += list(tempokern.ctd_topk(qf, gf, 12, bias=(uq, ug, *bias_params(m))))
        outs += list(tempokern.ctd_topk(qf, gf, 12, bias=(uq, ug, m.table())))
        # matryoshka_infonce (fused per-level passes), symmetric with spans, extra negatives and the exact bias
        q, d, neg = (r(n, 24).requires_grad_() for n in (90, 90, 7))
        lo = torch.randint(0, 40, (90,), generator=g)
        bias = tuple(x.requires_grad_() for x in (torch.rand(90, generator=g, dtype=torch.float64),
                                                   torch.rand(90, generator=g, dtype=torch.float64),
                                                   r(5, 7), r(5), r(1, 5), r(1), torch.tensor(0.5, dtype=torch.float64)))
        loss = tempokern.matryoshka_infonce(q, d, (5, 13, 24), temperature=0.1, extra_neg=neg, symmetric=True,
                                            q_span=(lo, lo + 2), d_span=(lo.flip(0), lo.flip(0) + 1), bias=bias)
        outs += [loss, *torch.autograd.grad(loss, [q, d, neg, *bias])]
        # calendar context backward
        ls = [r(50, n).requires_grad_() for n in (12, 32, 5)]
        c = tempokern.calendar_context(ls, 16, 0.5)
        outs += [c, *torch.autograd.grad((c * r(*c.shape)).sum(), ls)]
    return [o.detach() for o in outs]


def test_kernels_do_not_depend_on_thread_order(cuda_emu, seed):
    seed(0)
    base = _ops_under(cuda_emu)
    for s in (1, 2):
        seed(s)
        for i, (a, b) in enumerate(zip(base, _ops_under(cuda_emu))):
            if a.dtype == torch.int64:
                assert torch.equal(a, b), i
            else:  # atomics add in a different order: rounding only
                torch.testing.assert_close(a, b, rtol=1e-5 if a.dtype != torch.float64 else 1e-12, atol=1e-6,
                                           msg=lambda m: f"output {i}: {m}")


# ---- shared memory limits of the default build's architectures -------------------------------------

@pytest.fixture
def smem_optin():
    old = os.environ.get("TEMPOKERN_EMU_SMEM_OPTIN")

    def set_(n):
        os.environ["TEMPOKERN_EMU_SMEM_OPTIN"] = str(n)
    yield set_
    if old is None:
        os.environ.pop("TEMPOKERN_EMU_SMEM_OPTIN", None)
    else:
        os.environ["TEMPOKERN_EMU_SMEM_OPTIN"] = old


def test_float64_kernels_fit_sm86_shared_memory(cuda_emu, smem_optin):
    # sm_86 / sm_89 (in the default build) let a block opt into 99 KB, not the H100's 227 KB
    smem_optin(99 * 1024)
    g = torch.Generator().manual_seed(5)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    xs = [torch.rand(33, generator=g, dtype=torch.float64), torch.rand(45, generator=g, dtype=torch.float64),
          r(96, 64), r(96), r(1, 96), r(1), torch.tensor(0.7, dtype=torch.float64)]
    xs = [x.requires_grad_() for x in xs]
    q, d = r(100, 40).requires_grad_(), r(100, 40).requires_grad_()
    lo = torch.randint(0, 30, (100,), generator=g)
    bias = (torch.rand(100, generator=g, dtype=torch.float64), torch.rand(100, generator=g, dtype=torch.float64),
            r(5, 64), r(5), r(1, 5), r(1), torch.tensor(0.5, dtype=torch.float64))
    with cuda_emulator(cuda_emu):
        o = tempokern.offset_bias(*xs)
        got = [o, *torch.autograd.grad(o.sum(), xs)]
        loss = tempokern.multipos_infonce(q, d, (lo, lo + 2), (lo, lo + 1), temperature=0.2, bias=bias)
        got_mp = [loss, *torch.autograd.grad(loss, [q, d])]
    o = ref.offset_bias(*xs)
    want = [o, *torch.autograd.grad(o.sum(), xs)]
    loss = ref.multipos_infonce(q, d, (lo, lo + 2), (lo, lo + 1), temperature=0.2, bias=bias)
    want_mp = [loss, *torch.autograd.grad(loss, [q, d])]
    for a, b in zip(got + got_mp, want + want_mp):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_table_histogram_beyond_shared_memory_falls_back_to_global(cuda_emu, smem_optin):
    # the multipos table backward keeps its histogram in shared memory when it fits the device's opt-in
    # limit; past it (here 2,049 float64 bins, 16 KB, over a 12 KB limit) it scatters into global memory,
    # slower but the same numbers
    smem_optin(12 * 1024)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(20, 8, dtype=torch.float64, generator=g).requires_grad_()
    d = torch.randn(20, 8, dtype=torch.float64, generator=g).requires_grad_()
    lo = torch.arange(20)
    b = (torch.rand(20, dtype=torch.float64, generator=g), torch.rand(20, dtype=torch.float64, generator=g),
         torch.randn(4, 6, dtype=torch.float64, generator=g), torch.randn(4, dtype=torch.float64, generator=g),
         torch.randn(1, 4, dtype=torch.float64, generator=g), torch.randn(1, dtype=torch.float64, generator=g),
         torch.tensor(0.5, dtype=torch.float64))
    b = tuple(t.requires_grad_() for t in b)
    ins = [q, d, *b]
    from tempokern.reference import multipos_infonce as ref
    want = torch.autograd.grad(ref(q, d, (lo, lo + 1), (lo, lo), temperature=0.1, bias=b, bias_table_points=2049), ins)
    with cuda_emulator(cuda_emu):
        got = torch.autograd.grad(tempokern.multipos_infonce(q, d, (lo, lo + 1), (lo, lo), temperature=0.1, bias=b,
                                                             bias_table_points=2049), ins)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-10)


def test_emulator_switch_is_local_to_the_calling_thread(cuda_emu):
    # while one thread emulates, CPU ops in another thread keep the CPU kernels
    import threading

    from tempokern._ops import backend, common
    seen = {}

    def other():
        seen["path"] = common.on_cuda_path(torch.device("cpu"))
        seen["kernels"] = common.kernels()
        seen["sms"] = common.sm_count(torch.device("cpu"))

    with cuda_emulator(cuda_emu):
        assert common.on_cuda_path(torch.device("cpu")) and common.kernels() is cuda_emu
        assert common.sm_count(torch.device("cpu")) == backend.EMULATED_SM_COUNT
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert seen == {"path": False, "kernels": common._C, "sms": 1}
    assert not common.on_cuda_path(torch.device("cpu"))


def test_gpu_sanitize_case_runs_on_the_emulator(cuda_emu, monkeypatch):
    """tools/gpu_sanitize_case.py (what tools/gpu_check.sh runs under compute-sanitizer) with its CUDA device
    replaced by the emulator: every call it makes runs and agrees with the float64 reference, so the sanitizer run
    on a GPU does not stop at a bug of the script (a duplicate Matryoshka dim at SAN_SMALL did once)."""
    monkeypatch.setenv("SAN_SMALL", "1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "tools", "gpu_sanitize_case.py")) as f:
        src = f.read()
    assert src.count('dev = "cuda"') == 1
    with cuda_emulator(cuda_emu):
        exec(compile(src.replace('dev = "cuda"', 'dev = "cpu"'), "gpu_sanitize_case.py", "exec"),
             {"__name__": "__main__"})


# ---- warp-serial scheduling: races between warps at different barrier positions ----------------------------

_OVERLAY_BARRIER = ("        if (BWD && Smem<OT, TR, TC>::kOverlay && l == K - 1)\n"
                    "          __syncthreads();  // every warp is done with the operand stages the tile overlays\n")
_CAL_FIRST_BARRIER = ("    __syncthreads();  // the previous tile's products are done with P^T (and, the first time, "
                      "Ts is written)\n")
_REMOVED = {  # case: (source file, the barrier's lines)
    "tensor-core overlay": ("csrc/matryoshka_infonce/matryoshka_tc_cuda.cu", _OVERLAY_BARRIER),
    "calendar v3 forward": ("csrc/calendar/calendar_v3_cuda.cu", _CAL_FIRST_BARRIER),
}


def _removed_barrier_case(case, monkeypatch):
    """run() for the kernel whose barrier the case removes: the backward of a 64 x 64 tensor-core tile (whose top
    level's score tile overlays the operand stages), or calendar_context v3 on one SM (each CTA walks 11 tiles,
    rewriting P^T for the next one)."""
    import tempokern._ops.common as common
    if case == "tensor-core overlay":
        from test_matryoshka_tc import force_tile
        force_tile(monkeypatch, "64x64")
        monkeypatch.setenv("TEMPOKERN_EXPERIMENTAL", "mrl_tc")

        def run():
            g = torch.Generator().manual_seed(7)
            q, d = (torch.randn(70, 64, generator=g).bfloat16().requires_grad_() for _ in range(2))
            loss = tempokern.matryoshka_infonce(q, d, (16, 32, 64), temperature=0.1, symmetric=True)
            return [loss.detach(), *torch.autograd.grad(loss, (q, d))]
        return run
    monkeypatch.setenv("TEMPOKERN_EXPERIMENTAL", "calendar_v3")
    patch_sm_count(monkeypatch, lambda device: 1)

    def run():
        g = torch.Generator().manual_seed(5)
        xs = [3 * torch.randn(701, n, generator=g) for n in (17, 1, 12)]
        return [tempokern.calendar_context(xs, 44, 0.7)]
    return run


def _outputs(emu, run, serial, seed=0):
    emu.emu_set_warp_serial(serial)
    emu.emu_set_seed(seed)
    try:
        with cuda_emulator(emu):
            return run()
    finally:
        emu.emu_set_warp_serial(False)
        emu.emu_set_seed(0)


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("case", sorted(_REMOVED))
def test_warp_serial_mode_catches_a_removed_barrier(cuda_emu, monkeypatch, case):
    # the kernel with the barrier removed (a patched copy of its source, built beside the emulator's module): the
    # default schedule (warps advance one collective per round) and shuffled thread orders give the right
    # numbers, so only warp-serial scheduling (each warp alone up to its next __syncthreads) reports the race
    path, barrier = _REMOVED[case]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, path)) as f:
        src = f.read()
    assert src.count(barrier) == 1, "the barrier this test removes moved: update _REMOVED"
    sys.path.insert(0, os.path.join(root, "tools", "cuda_emu"))
    try:
        import build as emu_build
    finally:
        sys.path.pop(0)
    patched = emu_build.load(emu_build.build(patches={path: src.replace(barrier, "")}, quiet=True))
    run = _removed_barrier_case(case, monkeypatch)
    want = _outputs(cuda_emu, run, False)
    assert _same(_outputs(cuda_emu, run, True), want) and _same(_outputs(cuda_emu, run, True, 1), want)
    assert _same(_outputs(patched, run, False), want)  # missed by the default schedule
    caught = [not _same(_outputs(patched, run, True, s), want) for s in (0, 1)]
    assert all(caught), caught
