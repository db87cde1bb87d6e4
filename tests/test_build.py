"""The compiled module: build facts, no libtorch linkage, imports without a GPU driver."""
import os
import subprocess
import sys

import pytest
import torch

import tempokern
from conftest import run_python
from tempokern import _C


def test_build_info_fields():
    info = tempokern.build_info()
    assert set(info) >= {"version", "cuda_compiled", "cuda_archs", "cuda_runtime_ok", "device_count", "openmp_threads"}
    assert info["version"] == tempokern.__version__
    assert isinstance(info["cuda_archs"], list)
    assert info["openmp_threads"] >= 1
    if info["cuda_compiled"]:
        assert info["cuda_archs"], "a CUDA build must report its architectures"
    else:
        assert info["cuda_archs"] == [] and not info["cuda_runtime_ok"]
    if not info["cuda_runtime_ok"]:
        assert info["device_count"] == 0


def test_build_matches_ci_expectation():
    # CI builds twice (auto-detected CUDA with nvcc present, and TEMPOKERN_CUDA=OFF) and says which it expects.
    expect = os.environ.get("TEMPOKERN_EXPECT_CUDA")
    if expect is None:
        pytest.skip("TEMPOKERN_EXPECT_CUDA not set (only CI pins the expected build flavour)")
    assert tempokern.build_info()["cuda_compiled"] == (expect == "1")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ldd is Linux-only")
def test_module_does_not_link_libtorch():
    out = subprocess.run(["ldd", _C.__file__], capture_output=True, text=True).stdout
    assert out, "ldd printed nothing"
    for lib in ("libtorch", "libc10", "libcudart.so"):
        assert lib not in out, f"_C links {lib}:\n{out}"


def test_import_in_fresh_process_without_torch_cuda():
    # The module must import (and report) with no GPU driver; CUDA_VISIBLE_DEVICES="" hides any GPU too.
    code = "import tempokern, json; print(json.dumps(tempokern.build_info()))"
    res = run_python(code, CUDA_VISIBLE_DEVICES="")
    assert res.returncode == 0, res.stderr
    assert '"device_count": 0' in res.stdout


class _FakeCudaTensor:
    """Stands in for a CUDA tensor (a CPU-only torch cannot make one): launch_args reads only .device."""
    device = torch.device("cuda", 0)


class _StubC:
    def __init__(self, compiled: bool, runtime_ok: bool, msg: str = ""):
        self.cuda_compiled, self._status = compiled, (runtime_ok, int(runtime_ok), msg)

    def cuda_runtime_status(self):
        return self._status


@pytest.mark.parametrize("compiled,runtime,match", [
    (False, (False, ""), r"built without CUDA kernels, so CUDA tensors cannot be used.*TEMPOKERN_CUDA=ON pip install"),
    (True, (False, "no CUDA-capable device is detected"),
     r"CUDA runtime is unavailable: no CUDA-capable device is detected"),
])
def test_cuda_tensor_without_gpu_is_a_clear_error(monkeypatch, compiled, runtime, match):
    # Both no-GPU messages of launch_args (every op's launch goes through it): a build without CUDA kernels,
    # and a CUDA build on a machine whose runtime reports no device.
    from tempokern._ops import backend, common
    monkeypatch.setattr(backend, "_C", _StubC(compiled, *runtime))   # the backend asks the build at launch
    with pytest.raises(RuntimeError, match=match):
        common.launch_args(_FakeCudaTensor())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error path")
def test_cuda_tensor_without_gpu_real_build():
    # The same path with this machine's real _C: which message depends on how it was built.
    from tempokern._ops.common import launch_args
    ok, _, msg = _C.cuda_runtime_status()
    assert not ok and msg, "no GPU here: the runtime must say why it is unavailable"
    match = "CUDA runtime is unavailable" if _C.cuda_compiled else "built without CUDA kernels"
    with pytest.raises(RuntimeError, match=match):
        launch_args(_FakeCudaTensor())


def test_other_device_is_a_clear_error():
    from tempokern._ops.common import launch_args
    with pytest.raises(ValueError, match="CPU and CUDA tensors, got device meta"):
        launch_args(torch.empty(0, device="meta"))


def _package_copy(tmp_path, extra=None):
    """A copy of the tempokern package without its compiled _C*.so (as in an unbuilt checkout)."""
    import shutil
    src = os.path.dirname(os.path.abspath(tempokern.__file__))
    dst = tmp_path / "tempokern"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("_C*.so", "_C*.pyd", "__pycache__"))
    assert not list(dst.glob("_C*")), "the copy must not hold a built extension"
    if extra:
        (dst / extra[0]).write_bytes(extra[1])
    return dst


def _run_in(cwd, *args):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=120)


@pytest.mark.parametrize("args", [("-c", "import tempokern"), ("-m", "tempokern", "--help")])
def test_unbuilt_checkout_says_what_to_do(tmp_path, args):
    pkg = _package_copy(tmp_path)
    res = _run_in(tmp_path, *args)
    assert res.returncode != 0
    err = res.stderr
    assert "circular import" not in err and "partially initialized" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("ImportError: tempokern's compiled extension tempokern._C was not found in "), err
    assert str(pkg) in last and "has not been built" in last
    assert "pip install ." in last and "tools/dev_build.sh" in last and "docs/DEVELOPING.md" in last


def test_extension_for_another_python_is_named(tmp_path):
    pkg = _package_copy(tmp_path, ("_C.cpython-27-x86_64-linux-gnu.so", b"\x7fELF"))
    res = _run_in(tmp_path, "-c", "import tempokern")
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode != 0
    assert "_C.cpython-27-x86_64-linux-gnu.so" in last and "was built for another Python" in last, res.stderr
    assert sys.executable in last and "tools/dev_build.sh" in last


def test_extension_that_fails_to_load_is_named(tmp_path):
    import importlib.machinery
    name = "_C" + importlib.machinery.EXTENSION_SUFFIXES[0]
    _package_copy(tmp_path, (name, b"not a shared object"))
    res = _run_in(tmp_path, "-c", "import tempokern")
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode != 0
    assert "failed to load" in last and name in last and "tools/dev_build.sh" in last, res.stderr


def test_openmp_threads_settable():
    n = _C.openmp_threads()
    _C.set_openmp_threads(1)
    try:
        assert _C.openmp_threads() == 1
    finally:
        _C.set_openmp_threads(n)


def test_shared_data_resolves_from_the_checkout(monkeypatch, tmp_path):
    import conftest
    (tmp_path / "zztj").mkdir()
    (tmp_path / "zztj" / "x.jsonl").write_text("{}")
    monkeypatch.setenv("TEMPOKERN_SHARED_DATA", str(tmp_path))
    assert conftest.shared_data("zztj/x.jsonl") == str(tmp_path / "zztj" / "x.jsonl")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert os.path.normpath(os.path.join(repo, "..", "shared", "data")) in conftest._shared_data_roots()


def test_missing_shared_data_fails_loudly_when_required(monkeypatch):
    import conftest
    for k in ("CI", "TEMPOKERN_REQUIRE_DATA"):
        monkeypatch.delenv(k, raising=False)
    assert not os.path.exists(conftest.shared_data("no/such-file.json"))  # locally: a missing path, tests skip
    monkeypatch.setenv("CI", "true")  # a CI variable alone does not decide: .ci/run sets the flag when it finds data
    assert not os.path.exists(conftest.shared_data("no/such-file.json"))
    env = {"TEMPOKERN_REQUIRE_DATA": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(FileNotFoundError, match=r"'no/such-file.json' not found in any of .*TEMPOKERN_SHARED_DATA"):
        conftest.shared_data("no/such-file.json")
    monkeypatch.setenv(next(iter(env)), "0")
    assert not os.path.exists(conftest.shared_data("no/such-file.json"))
