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


# ---- stand-ins for the TMRL losses/tagger while they are not on main (installed only when missing) -------

def _standin_spans(text):
    return [(m.start(), m.end(), "year") for m in re.finditer(r"\b(1[0-9]{3}|20[0-9]{2})\b", text)]


def _standin_token_mask(encoding, spans_per_text, *, include_cls):
    off = torch.as_tensor(encoding["offset_mapping"])
    s, e = off[..., 0], off[..., 1]
    mask = torch.zeros(off.shape[:2], dtype=torch.bool)
    for b, spans in enumerate(spans_per_text):
        for a, z, *_ in spans:
            mask[b] |= (e[b] > s[b]) & (s[b] < z) & (e[b] > a)
    if include_cls:
        mask[:, 0] = True
    return mask


class _StandinProjector(torch.nn.Module):
    def __init__(self, hidden_size, t, *, act="gelu", layer_norm_eps=1e-12, proj_hidden=None):
        super().__init__()
        h = proj_hidden or hidden_size
        self.dense, self.norm, self.out = (torch.nn.Linear(hidden_size, h), torch.nn.LayerNorm(h, eps=layer_norm_eps),
                                           torch.nn.Linear(h, t))

    def forward(self, h):
        return self.out(self.norm(torch.nn.functional.gelu(self.dense(h))))


def _standin_pool(token_states, temporal_mask, projector):
    B = token_states.shape[0]
    rows = temporal_mask.nonzero(as_tuple=True)[0]
    proj = projector(token_states[temporal_mask])
    count = temporal_mask.sum(1)
    tot = proj.new_zeros((B, proj.shape[1])).index_add(0, rows, proj)
    return tot / count.clamp_min(1).to(proj.dtype).unsqueeze(1), count > 0


class _StandinTMRLLoss(torch.nn.Module):
    """MRL as the literal per-level loop; L_Temp as Eq. 10 (masked rows dropped); dist/cka as 0."""

    def __init__(self, dims, t, *, alpha, beta=0.1, gamma=0.1, temperature=0.05, weights=None, k=10,
                 detach_teacher=True):
        super().__init__()
        self.dims, self.t, self.alpha, self.tau = tuple(dims), t, alpha, temperature

    def forward(self, q, p, neg_p=None, *, p_T=None, p_has=None, qc=None, qc_T=None, qc_has=None, q_span=None,
                d_span=None):
        F = torch.nn.functional
        cand = p if neg_p is None else torch.cat([p, neg_p])
        if q_span is not None:
            pos = q_span[0].unsqueeze(1) == d_span[0].unsqueeze(0)
        else:
            pos = torch.eye(q.shape[0], dtype=torch.bool, device=q.device)
        pos = torch.cat([pos, pos.new_zeros(q.shape[0], cand.shape[0] - p.shape[0])], 1)
        parts, mrl = {}, 0
        for m in self.dims:
            s = F.normalize(q[:, :m], dim=-1) @ F.normalize(cand[:, :m], dim=-1).T / self.tau
            lv = (torch.logsumexp(s, 1) - torch.logsumexp(s.masked_fill(~pos, float("-inf")), 1)).mean()
            parts[f"mrl@{m}"] = lv.detach()
            mrl = mrl + lv
        loss, temp = mrl, q.new_zeros(())
        if self.alpha and p_T is not None:
            t = self.t
            s1 = torch.einsum("bt,bnt->bn", F.normalize(p_T, dim=-1), F.normalize(qc[..., :t], dim=-1)) / self.tau
            l1 = torch.logsumexp(s1, 1) - s1[:, 0]
            s2 = torch.einsum("bt,bnt->bn", F.normalize(p[:, :t], dim=-1), F.normalize(qc_T, dim=-1)) / self.tau
            s2 = s2.masked_fill(~qc_has, float("-inf"))
            keep2 = qc_has[:, 0]
            l2 = torch.logsumexp(s2, 1) - s2[:, 0]
            temp = (l1[p_has].sum() / p_has.sum().clamp_min(1)
                    + torch.where(keep2, l2, torch.zeros_like(l2)).sum() / keep2.sum().clamp_min(1))
            loss = loss + self.alpha * temp
        parts.update(mrl=mrl.detach(), temp=temp.detach(), dist=q.new_zeros(()), cka=q.new_zeros(()),
                     total=loss.detach())
        return loss, parts


def install_standins(monkeypatch):
    """Use the stand-ins for whichever of the shared TMRL pieces tempokern does not have yet."""
    import tempokern.nn as tknn
    import tempokern.text as tktext
    for mod, name, obj in ((tknn, "TemporalProjector", _StandinProjector), (tknn, "temporal_pool", _standin_pool),
                           (tknn, "TMRLLoss", _StandinTMRLLoss), (tktext, "temporal_spans", _standin_spans),
                           (tktext, "temporal_token_mask", _standin_token_mask)):
        if not hasattr(mod, name):
            monkeypatch.setattr(mod, name, obj, raising=False)
