"""Tiny TMRL data, a WordPiece tokenizer from a tiny vocabulary and tiny encoders for the TMRL tests."""
from __future__ import annotations

import re

import torch

PEOPLE = ["alice", "bruno", "chen", "dara", "emil", "fatima"]
PRIZES = ["chess", "poetry", "rowing", "physics", "violin", "sailing"]
YEARS = [1999, 2003, 2008, 2012, 2017]


def tiny_rows(n_people: int = 6, years=YEARS, hard: int = 2, negq: int = 2):
    """Rows of A1: who won which prize in which year; hard negatives and negative queries are the same
    person in other years (time-mismatched)."""
    from tempokern.datasets.tmrl import TMRLRow
    rows = []
    for i, who in enumerate(PEOPLE[:n_people]):
        for j, y in enumerate(years):
            prize = PRIZES[(i + j) % len(PRIZES)]
            others = [yy for yy in years if yy != y]
            q = f"what prize did {who} win in {y}?"
            p = f"in {y} {who} won the {prize} prize."
            hn = [f"in {yy} {who} won the {PRIZES[(i + years.index(yy)) % len(PRIZES)]} prize." for yy in others[:hard]]
            nq = [f"what prize did {who} win in {yy}?" for yy in others[-negq:]] if negq else []
            rows.append(TMRLRow(query=q, positive=p, hard_negatives=hn, negative_queries=nq, query_id=f"{who}-{y}"))
    return rows


def wordpiece_tokenizer(texts, extra=()):
    """A fast BERT WordPiece tokenizer whose vocabulary is the corpus' words, every character and its
    '##' continuation (so any word splits into known pieces)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    words, chars = set(), set()
    for t in list(texts) + list(extra):
        for w in re.findall(r"\w+|[^\w\s]", t.lower()):
            words.add(w)
            chars.update(w)
    vocab = {tok: i for i, tok in enumerate(special)}
    for c in sorted(chars):
        vocab.setdefault(c, len(vocab))
        vocab.setdefault("##" + c, len(vocab))
    for w in sorted(words):
        if not w.isdigit():   # numbers split into digit pieces: exercises alignment across WordPiece splits
            vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]")


def rows_texts(rows):
    out = []
    for r in rows:
        out += [r.query, r.positive, *r.hard_negatives, *r.negative_queries]
    return out


def tiny_encoder(rows, *, hidden: int = 32, layers: int = 1, seed: int = 0, dims=(8, 16, 32), t=8,
                 lora=False, pooling="cls", dtype=torch.float32, dropout: bool = True, max_length: int = 32, **kw):
    from tempokern.models import tiny_bert
    from tempokern.models.tmrl import TMRLEncoder
    tok = wordpiece_tokenizer(rows_texts(rows), extra=kw.pop("extra_texts", ()))
    bb = tiny_bert(len(tok), hidden=hidden, layers=layers, heads=2, intermediate=2 * hidden, max_position=64,
                   seed=seed)
    if not dropout:
        bb.config.hidden_dropout_prob = bb.config.attention_probs_dropout_prob = 0.0
        for m in bb.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
    bb = bb.to(dtype)
    torch.manual_seed(seed + 1)
    m = TMRLEncoder(bb, tokenizer=tok, dims=dims, t=t, lora=lora, pooling=pooling, max_length=max_length, **kw)
    return m.to(dtype)


def no_dropout(model):
    for mod in model.modules():
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.0
    return model



def tmrl_ddp_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """One rank of the CPU gloo test of the TMRL trainer: a few data-parallel steps, then its weights."""
    import json
    import os
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        from tempokern.training.tmrl import TMRLConfig, train_tmrl
        rows = tiny_rows()
        m = tiny_encoder(rows, seed=rank)          # other initial weights per rank: rank 0's are broadcast
        cfg = TMRLConfig(batch_size=6, epochs=1, lr=3e-3, t=8, alpha=0.25, hard_negatives=2, negative_queries=2,
                         progress=False, max_steps=3)
        res = train_tmrl(m, rows, cfg, out_dir if rank == 0 else None, log=lambda *a: None)
        torch.save({k: v.detach().clone() for k, v in m.state_dict().items()}, os.path.join(out_dir, f"rank{rank}.pt"))
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"steps": res.steps, "losses": [h["loss"] for h in res.history]}, f)
    finally:
        dist.destroy_process_group()


def tiny_config(**kw):
    """A TMRLConfig for the tiny rows and encoders above (one short epoch, t = 8), updated by ``kw``."""
    from tempokern.training.tmrl import TMRLConfig
    base = dict(batch_size=6, epochs=1, lr=3e-3, hard_negatives=2, negative_queries=2, t=8, alpha=0.25,
                progress=False, warmup_ratio=0.0, seed=0)
    base.update(kw)
    return TMRLConfig(**base)
