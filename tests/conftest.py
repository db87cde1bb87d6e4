import pytest
import torch


def cuda_ok() -> bool:
    import tempokern
    return torch.cuda.is_available() and tempokern.build_info()["cuda_runtime_ok"]


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device (none visible)")
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


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


def shared_data(rel: str) -> str:
    """The original of a bundled data file in shared/data (beside the checkout in CI, or the
    workspace copy), or a path that does not exist when neither is there."""
    import os
    here = os.path.dirname(os.path.abspath(__file__))
    for root in (os.path.join(here, "..", "..", "shared", "data"), os.path.join(here, "..", "shared", "data"),
                 "/work/shared/data"):
        if os.path.exists(os.path.join(root, rel)):
            return os.path.join(root, rel)
    return os.path.join("/nonexistent", rel)
