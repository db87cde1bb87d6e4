import os
import sys

import pytest
import torch


# Under pytest-xdist (`pytest -n auto`) the workers share the machine's cores: each gets its share of intra-op
# threads, so two workers on two cores do not fight over four threads.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per core, at most 8 (each worker holds its own torch, models and emulator module)."""
    return max(1, min(os.cpu_count() or 1, 8))


def cuda_ok() -> bool:
    import tempokern
    return torch.cuda.is_available() and tempokern.build_info()["cuda_runtime_ok"]


# "emu": CPU tensors through the shipped CUDA kernels on the CPU emulator (tools/cuda_emu), so the CUDA
# code runs in every test run, GPU or not. TEMPOKERN_TEST_EMU=0 leaves it out.
_EMU = os.environ.get("TEMPOKERN_TEST_EMU", "1") not in ("0", "", "false")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else []) + (["emu"] if _EMU else [])


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device (none visible)")
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cuda_emu():
    """The emulated _C module (built on first use, cached under build/cuda_emu/)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(root, "tools", "cuda_emu"))
    try:
        import build as emu_build
    finally:
        sys.path.pop(0)
    return emu_build.load()


_kernel_expected = [True]


def expect_no_kernel():
    """For a test on the emulator whose inputs legitimately launch no CUDA kernel (bad input rejected in
    Python, or a case the wrapper sends to its torch fallback)."""
    _kernel_expected[0] = False


def _on_emulator(request):
    from _emu_support import cuda_emulator
    emu = request.getfixturevalue("cuda_emu")
    before = emu.emu_launch_count()
    _kernel_expected[0] = True
    with cuda_emulator(emu):
        yield torch.device("cpu")
    # a test that asks for a device launches at least one kernel: else the emulator was bypassed
    if _kernel_expected[0]:
        assert emu.emu_launch_count() > before, "the test ran no kernel on the CUDA emulator"


@pytest.fixture(params=DEVICES)
def device(request):
    if request.param != "emu":
        yield torch.device(request.param)
        return
    yield from _on_emulator(request)


# Tests of the CUDA kernels run twice: on a GPU ("cuda", skipped without one; `pytest -m cuda`) and on
# the CUDA emulator ("emu": CPU tensors through the same .cu kernels; `pytest -m emu`).
GPU_PARAMS = [pytest.param("cuda", marks=pytest.mark.cuda)] + (
    [pytest.param("emu", marks=pytest.mark.emu)] if _EMU else [])


@pytest.fixture(params=GPU_PARAMS)
def gpu(request):
    if request.param == "cuda":
        if not cuda_ok():
            pytest.skip("needs a working CUDA device")
        yield torch.device("cuda")
        return
    yield from _on_emulator(request)


def cpu_kernels():
    """Inside a `gpu` test: run the CPU kernels (the emulator is off in this block)."""
    from _emu_support import cuda_emulator
    return cuda_emulator(None)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def run_python(code: str, **env):
    """Runs code in a fresh interpreter that imports the same tempokern as this process
    (installed or in-tree), from a neutral working directory."""
    import os
    import subprocess
    import sys
    import tempfile

    import tempokern
    root = os.path.dirname(os.path.dirname(os.path.abspath(tempokern.__file__)))
    full_env = dict(os.environ, **env)
    full_env["PYTHONPATH"] = root + os.pathsep + full_env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env,
                          cwd=tempfile.gettempdir())


def _shared_data_roots() -> list:
    """Where shared/data may be, resolved from this checkout (no machine paths): $TEMPOKERN_SHARED_DATA;
    shared/data inside the checkout (the device runner carries it there) or beside it (CI); and, for a git
    worktree, beside the main checkout the worktree belongs to."""
    import os
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    roots = []
    if os.environ.get("TEMPOKERN_SHARED_DATA"):
        roots.append(os.environ["TEMPOKERN_SHARED_DATA"])
    roots += [os.path.join(repo, "shared", "data"), os.path.join(repo, "..", "shared", "data")]
    dotgit = os.path.join(repo, ".git")
    if os.path.isfile(dotgit):  # a worktree: ".git" says "gitdir: <main>/.git/worktrees/<name>"
        with open(dotgit, encoding="utf-8") as f:
            line = f.read().strip()
        if line.startswith("gitdir:"):
            gitdir = os.path.normpath(os.path.join(repo, line[len("gitdir:"):].strip()))
            common = os.path.join(gitdir, "commondir")
            main_git = gitdir
            if os.path.isfile(common):
                with open(common, encoding="utf-8") as f:
                    main_git = os.path.normpath(os.path.join(gitdir, f.read().strip()))
            roots.append(os.path.join(os.path.dirname(main_git), "..", "shared", "data"))
    return [os.path.normpath(r) for r in roots]


def data_required() -> bool:
    """Missing shared data fails loudly (instead of skipping) with TEMPOKERN_REQUIRE_DATA=1, which .ci/run sets
    whenever it finds the shared data folder (and says so in its log when it does not)."""
    import os
    return os.environ.get("TEMPOKERN_REQUIRE_DATA", "").strip().lower() not in ("", "0", "false", "no")


def shared_data(rel: str) -> str:
    """The original of a bundled data file in shared/data (see _shared_data_roots). When none of the roots
    has it: a path that does not exist (the tests that use it skip their comparison), or, with
    TEMPOKERN_REQUIRE_DATA=1, a FileNotFoundError that names every place looked at."""
    import os
    roots = _shared_data_roots()
    for root in roots:
        if os.path.exists(os.path.join(root, rel)):
            return os.path.join(root, rel)
    if data_required():
        raise FileNotFoundError(
            f"shared data file {rel!r} not found in any of {roots} (required because "
            "TEMPOKERN_REQUIRE_DATA is set; point TEMPOKERN_SHARED_DATA at the shared/data folder)")
    return os.path.join(os.sep, "nonexistent-shared-data", rel)


def by_thread_order(cuda_emu, run, seeds=(0, 1, 2), warp_serial=(0, 1)):
    """run() on the CUDA emulator under each seeded thread order, then warp-serial (each warp runs alone up to its
    next __syncthreads, which catches a missing barrier between warps at different positions) last warp first (seed
    0) and in a seeded warp order: its outputs, one entry per seed of `seeds`, then of `warp_serial`."""
    from _emu_support import cuda_emulator
    outs = []
    try:
        for serial, ss in ((False, seeds), (True, warp_serial)):
            cuda_emu.emu_set_warp_serial(serial)
            for s in ss:
                cuda_emu.emu_set_seed(s)
                with cuda_emulator(cuda_emu):
                    outs.append(run())
    finally:
        cuda_emu.emu_set_seed(0)
        cuda_emu.emu_set_warp_serial(False)
    return outs


@pytest.fixture(scope="module")
def single_thread():
    """One torch thread for a module's tests (small models: threads only add overhead and run-to-run noise)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
