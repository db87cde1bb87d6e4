"""How sensitive is TMRL retrieval to beta = gamma (the weights of L_Dist and L_CKA), under the two scalings?

TMRL's Tables 3-4 report that beta = gamma = 0.5 collapses retrieval while 0.1 helps. With
``aux_scale="mean"`` (L_Dist averaged over its N*k neighbour pairs) the auxiliary terms are a small fraction
of the gradient at any of these weights; with ``aux_scale="literal"`` (Eq. 11 summed over the pairs, as
printed) they are not. This script trains the same small model on the same **synthetic** rows (tempokern's
synthetic set, ``load_synth(set, size="quick")``) for each (aux_scale, beta = gamma) and reports nDCG@10
at every nested dim on one test split, plus the last step's embedding-space ratio
||grad(beta L_Dist + gamma L_CKA)|| / ||grad L_total||.

Model: a randomly initialised 2-layer BERT (hidden 64) with a word-level tokenizer built from the set's
texts, full fine-tuning (no pretrained weights: the point is the relative effect of beta / gamma under each
scaling, not absolute quality), dims (8, 16, 32, 64), t = 8, alpha = 0.1, lr 3e-3, the same seed everywhere.

    PYTHONPATH=$PWD python benchmarks/tmrl_beta_gamma.py [--set B] [--rows 256] [--epochs 3] \
        [--weights 0 0.1 0.5] [--scales mean literal] [--split test_date]
"""
import argparse
import re
import time

import torch


def word_tokenizer(texts):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {t: i for i, t in enumerate(special)}
    for t in texts:
        for w in re.findall(r"\w+|[^\w\s]", t.lower()):
            vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--set", default="B")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--weights", type=float, nargs="+", default=[0.0, 0.1, 0.5])
    ap.add_argument("--scales", nargs="+", default=["mean", "literal"])
    ap.add_argument("--split", default="test_date")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    from tempokern.datasets.synth import load_synth
    from tempokern.datasets.tmrl import rows_from_synth
    from tempokern.models import tiny_bert
    from tempokern.models.tmrl import TMRLEncoder
    from tempokern.training.tmrl import TMRLConfig, evaluate_dims, train_tmrl
    synth = load_synth(a.set, seed=0, size="quick")
    rows = rows_from_synth(synth, limit=a.rows)
    texts = [r.text for r in synth.dataset.records] + [q.text for q in synth.dataset.queries]
    for r in rows.rows:
        texts += [r.query, r.positive, *r.hard_negatives, *r.negative_queries]
    tok = word_tokenizer(texts)
    dims = (8, 16, 32, 64)
    print(f"synthetic set {a.set} (quick), {len(rows)} training rows, {a.epochs} epochs, batch {a.batch_size}, "
          f"split {a.split}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| aux_scale | beta = gamma | " + " | ".join(f"nDCG@10 @{m}" for m in dims)
          + " | aux grad ratio | final L_Dist | final L_CKA | s |")
    print("|---|---|" + "---|" * len(dims) + "---|---|---|---|")
    for scale in a.scales:
        for w in a.weights:
            if w == 0 and scale != a.scales[0]:
                continue              # beta = gamma = 0: both scalings are the same run
            torch.manual_seed(a.seed)
            bb = tiny_bert(len(tok), hidden=64, layers=2, heads=2, intermediate=128, max_position=64, seed=a.seed)
            model = TMRLEncoder(bb, tokenizer=tok, pooling="mean", dims=dims, t=8, lora="full", max_length=48,
                                temperature=0.05)
            cfg = TMRLConfig(variant="tmrl", alpha=0.1, beta=w, gamma=w, aux_scale=scale, lr=3e-3, lora="full",
                             batch_size=a.batch_size, epochs=a.epochs, hard_negatives=2, negative_queries=2,
                             seed=a.seed, progress=False, warmup_ratio=0.1)
            t0 = time.time()
            res = train_tmrl(model, rows, cfg, log=lambda *x: None)
            ev = {r["dim"]: r["nDCG@10"] for r in evaluate_dims(model, synth.dataset, a.split, dims)}
            last = res.history[-1] if res.history else {}
            ratio = (res.diagnostics or {}).get("aux_grad_ratio")
            print(f"| {scale if w else '-'} | {w:g} | " + " | ".join(f"{ev[m]:.3f}" for m in dims)
                  + f" | {ratio if ratio is None else round(ratio, 4)} | {last.get('dist', float('nan')):.4g} | "
                  f"{last.get('cka', float('nan')):.4g} | {time.time() - t0:.0f} |", flush=True)


if __name__ == "__main__":
    main()
