"""The call path of the two loss modules' forward (tests/_call_path.py): the distinct tempokern modules a call
moves through and its re-entries into a module it had already left, on the CPU kernels and on the CUDA
emulator. The bounds are the measured numbers of the current layout: a change that lengthens the path fails
here (lower them when a change shortens it)."""
import pytest
import torch

from _call_path import call_path
from tempokern.nn import CTDLoss, MatryoshkaInfoNCE

#: (entry, backend) -> (most distinct modules, most re-entries)
BOUNDS = {
    ("CTDLoss", "cpu"): (7, 68),
    ("CTDLoss", "emu"): (8, 71),
    ("MatryoshkaInfoNCE", "cpu"): (7, 64),
    ("MatryoshkaInfoNCE", "emu"): (9, 100),
}


def _calls():
    B, H = 8, 32
    q, d = torch.randn(B, H), torch.randn(B, H)
    s = torch.arange(B)
    ctd = CTDLoss(temperature=0.05)
    mat = MatryoshkaInfoNCE(dims=[16, 32], temperature=0.05)
    return {"CTDLoss": lambda: ctd(q, d, (s, s), (s, s)), "MatryoshkaInfoNCE": lambda: mat(q, d)}


@pytest.mark.parametrize("entry", ["CTDLoss", "MatryoshkaInfoNCE"])
def test_call_path_length(device, entry):
    kind = "emu" if device.type == "cpu" and _emulated() else "cpu"
    if device.type == "cuda":
        pytest.skip("measured on the CPU kernels and the emulator")
    fn = _calls()[entry]
    fn()  # first call: imports and caches
    stops, modules, reentries = call_path(fn)
    assert stops[0].startswith("tempokern.nn.") and any("_ops" in s for s in stops)
    most_modules, most_reentries = BOUNDS[(entry, kind)]
    assert modules <= most_modules and reentries <= most_reentries, (modules, reentries, " > ".join(stops))


def _emulated() -> bool:
    from tempokern._ops import backend
    return backend.resolve(torch.device("cpu")).emulated
