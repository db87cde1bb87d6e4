"""How large is TMRL's auxiliary gradient on the real backbone, and how cheap is the suite's diagnostic?

On all-MiniLM-L6-v2 with the suite's TMRL recipe (tempokern/suite/methods/tmrl.py: LoRA r 4, dims 32..384,
t 32, alpha 0.25, beta = gamma = 0.1, 2 hard negatives + 2 negative queries per row) and batches of set B
(quick size), for the first few batches of the untrained model: the embedding-space ratio
||grad(beta L_Dist + gamma L_CKA)|| / ||grad L_total|| that the suite records (TMRLTrainer.grad_diagnostics),
the exact ratio on the LoRA parameters (diagnose_params), and the seconds of each against one plain step.

    PYTHONPATH=$PWD python benchmarks/tmrl_aux_grad_probe.py [--batches 3] [--batch-size 32]
"""
import argparse
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--mrl-anchor", default="query")
    a = ap.parse_args()
    from tempokern.datasets.synth import load_synth
    from tempokern.datasets.tmrl import rows_from_synth
    from tempokern.models.tmrl import TMRLEncoder
    from tempokern.suite.backbone import backbone_path
    from tempokern.suite.methods.tmrl import DIMS_MINILM, RECIPE
    from tempokern.training.tmrl import TMRLConfig, TMRLTrainer
    torch.manual_seed(0)
    rows = rows_from_synth(load_synth("B", seed=0, size="quick"), limit=a.batch_size * a.batches)
    model = TMRLEncoder(backbone_path(), pooling="mean", max_length=48, dims=DIMS_MINILM, t=RECIPE["t"],
                        temperature=RECIPE["temperature"])
    cfg = TMRLConfig(variant="tmrl", t=RECIPE["t"], alpha=RECIPE["alpha"], beta=RECIPE["beta"], gamma=RECIPE["gamma"],
                     temperature=RECIPE["temperature"], batch_size=a.batch_size, hard_negatives=2, negative_queries=2,
                     progress=False, mrl_anchor=a.mrl_anchor)
    tr = TMRLTrainer(model, rows, cfg, device="cpu", log=lambda *x: None)
    model.train()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, mrl_anchor {a.mrl_anchor}")
    print("| batch | plain step s | proxy s | proxy + exact s | ratio (embeddings) | cos | ratio (LoRA params) | cos |")
    print("|---|---|---|---|---|---|---|---|")
    for bi, batch in enumerate(tr.epoch_batches(0)[:a.batches]):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        tr.backward_batch(batch)
        t_plain = time.perf_counter() - t0
        model.zero_grad(set_to_none=True)
        tr.diagnose_params = False
        t0 = time.perf_counter()
        tr.backward_batch(batch, diagnose=True)
        t_proxy = time.perf_counter() - t0
        d = tr.last_diagnostics
        model.zero_grad(set_to_none=True)
        tr.diagnose_params = True
        t0 = time.perf_counter()
        tr.backward_batch(batch, diagnose=True)
        t_exact = time.perf_counter() - t0
        e = tr.last_diagnostics
        p = e["params"]
        print(f"| {bi} | {t_plain:.2f} | {t_proxy:.2f} (diag {d['seconds']:.3f}) | {t_exact:.2f} | "
              f"{d['aux_grad_ratio']:.4f} | {d['aux_grad_cos']:.3f} | {p['aux_grad_ratio']:.4f} | {p['aux_grad_cos']:.3f} |")


if __name__ == "__main__":
    main()
