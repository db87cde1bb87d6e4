"""Half-precision score blocks of the blocked multi-positive InfoNCE (TEMPOKERN_MPB_SCORES=half: cuBLAS's
product of fp16 / bf16 operands kept in the operands' dtype, as torch's own q @ d.T, instead of float32) on the
CUDA emulator: the kernels receive half scores, the loss and every gradient keep the 2x-torch rule (no bias,
table and exact bias, extra negatives, several row blocks), float32 operands are unaffected, and the switch
validates its value (f32 stays the default until a GPU has measured the half blocks)."""
import pytest
import torch

import tempokern._ops.multipos_blocked as mpb

from test_multipos_blocked import assert_all_close, assert_two_x_rule, launch_spy, run_pair
from test_multipos_infonce import make


@pytest.fixture
def half(monkeypatch):
    return launch_spy(monkeypatch, "TEMPOKERN_MPB_SCORES", "half", record=lambda op, S: S.dtype)


def test_switch_default_and_validation(monkeypatch):
    monkeypatch.delenv("TEMPOKERN_MPB_SCORES", raising=False)
    assert mpb.scores_variant() == "f32"
    monkeypatch.setenv("TEMPOKERN_MPB_SCORES", "HALF")
    assert mpb.scores_variant() == "half"
    monkeypatch.setenv("TEMPOKERN_MPB_SCORES", "fp8")
    with pytest.raises(ValueError, match="TEMPOKERN_MPB_SCORES"):
        mpb.scores_variant()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", ["none", "table", "exact"])
def test_half_scores_two_x_torch_rule(gpu, half, dtype, mode):
    # the same rule and floors as test_multipos_blocked.test_two_x_torch_rule, with the score blocks in `dtype`
    assert_two_x_rule(gpu, dtype, mode, seeds=(11, 12, 13) if mode != "none" else (11, 12))
    assert half and all(t == dtype for t in half)  # every pass read half scores


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_scores_several_blocks_and_extra_negatives(gpu, half, dtype):
    # several row blocks (statistics merged across blocks, the scores recomputed in pass 2) against the
    # single-block run of the same half scores: identical products, so the same numbers up to float32 sums
    q, d, sp, neg, b = make(150, 16, N=7, bias=True, dtype=dtype, device=gpu, seed=3)
    one, _ = run_pair(q, d, sp, neg, b, pts=65)
    many, _ = run_pair(q, d, sp, neg, b, pts=65, block_rows=32)
    assert_all_close(many, one, rtol=2e-3, atol=2e-3)
    assert half and all(t == dtype for t in half)


def test_float32_operands_keep_float32_scores(gpu, half):
    q, d, sp, neg, b = make(64, 8, N=3, bias=False, dtype=torch.float32, device=gpu, seed=4)
    got, want = run_pair(q, d, sp, neg, b)
    assert_all_close(got, want, rtol=1e-4, atol=1e-5)
    assert half and all(t == torch.float32 for t in half)
