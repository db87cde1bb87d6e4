"""Data-parallel training on two CPU processes (gloo): what torchrun does on GPUs."""
import json
import math

import torch
import torch.multiprocessing as mp

from _ctd_helpers import ddp_worker, no_dropout, small_dataset, tiny_model


def test_two_process_gloo_training_keeps_ranks_in_sync_and_is_the_single_process_objective(tmp_path):
    mp.spawn(ddp_worker, args=(2, str(tmp_path / "pg"), str(tmp_path)), nprocs=2, join=True)
    s0 = torch.load(tmp_path / "rank0.pt")
    s1 = torch.load(tmp_path / "rank1.pt")
    assert s0.keys() == s1.keys()
    for k in s0:
        assert torch.equal(s0[k], s1[k]), f"{k} differs between ranks"
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())

    from tempokern.nn import CTDLoss
    from tempokern.training import CTDConfig, CTDTrainer
    ds = small_dataset()
    # the single-process run on the concatenated batch (2 x 8 pairs), from rank 0's initial weights
    # (the trainer broadcasts them): same epoch order, same first batch
    m = no_dropout(tiny_model(ds, seed=0))
    tr = CTDTrainer(m, ds, CTDConfig(variant="full", batch_size=16, progress=False, seed=0), log=lambda *a: None)
    assert r0["steps"] == r1["steps"] == min(4, tr.num_batches())
    assert all(math.isfinite(x) for x in r0["losses"] + r1["losses"])
    # each rank scores its own queries, so the per-rank losses differ while the weights agree
    assert r0["losses"] != r1["losses"]
    (batch, negs, off), *_ = tr._epoch_batches(0)
    assert negs is None                      # no neg_comment records in this set
    m.train()
    loss_fn = CTDLoss(temperature=0.05, offset_bias=m.offset_bias, symmetric=True, normalize=False)
    with torch.no_grad():
        single = float(tr._loss(batch, negs, off, loss_fn)[0])
    # gather_mode="tempokern": the mean over ranks of the first step's loss is the single-process loss
    assert abs((r0["losses"][0] + r1["losses"][0]) / 2 - single) < 1e-4 * max(1.0, abs(single))
    assert (tmp_path / "last" / "trainer_state.pt").exists()     # rank 0 writes the checkpoint
