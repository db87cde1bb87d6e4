"""Data-parallel training on two CPU processes (gloo): what torchrun does on GPUs."""
import json
import math

import torch
import torch.multiprocessing as mp

from _ctd_helpers import ddp_worker


def test_two_process_gloo_training_keeps_ranks_in_sync(tmp_path):
    mp.spawn(ddp_worker, args=(2, str(tmp_path / "pg"), str(tmp_path)), nprocs=2, join=True)
    s0 = torch.load(tmp_path / "rank0.pt")
    s1 = torch.load(tmp_path / "rank1.pt")
    assert s0.keys() == s1.keys()
    for k in s0:
        assert torch.equal(s0[k], s1[k]), f"{k} differs between ranks"
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    assert r0["steps"] == r1["steps"] == 4
    assert all(math.isfinite(x) for x in r0["losses"] + r1["losses"])
    # each rank scores its own queries, so the per-rank losses differ while the weights agree
    assert r0["losses"] != r1["losses"]
    assert (tmp_path / "last" / "trainer_state.pt").exists()     # rank 0 writes the checkpoint
