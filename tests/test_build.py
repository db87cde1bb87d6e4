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


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error path")
def test_cuda_tensor_without_gpu_is_a_clear_error():
    from tempokern._ops.common import launch_args
    fake = torch.empty(0, device="meta")
    with pytest.raises(ValueError, match="CPU and CUDA"):
        launch_args(fake)


def test_openmp_threads_settable():
    n = _C.openmp_threads()
    _C.set_openmp_threads(1)
    try:
        assert _C.openmp_threads() == 1
    finally:
        _C.set_openmp_threads(n)
