"""TMRL training rows (design notes §2.1 T11, §2.2 A1) and their loaders.

A row is ``(q⁺, p, {p⁻_k}, {q⁻_k})``: a query, its positive passage, hard-negative passages and
negative queries (same passage topic, other time), each text with optional temporal-expression
character spans. Spans given by the data override the rule tagger (``None`` = tag at training time;
``[]`` = the text has no temporal expression).

Formats:

* :func:`load_temporal_contrastive` — the TMRL augmentation schema (the paper's Table 13), a JSON array
  or jsonl of objects ``{"query_id", "query", "temporal"?, "positive_passages": [{"docid", "text",
  "temporal"?, "temporal_query_type"?, "allen_relation"?}], "negative_passages": [...]}``. In that
  schema ``query`` is the split *passage* and the "passages" are generated *questions*; each positive
  question becomes one row (its query), with the object's ``query`` as the positive passage and the
  negative questions as the row's negative queries. There are no negative passages (mine them, A1).
* :func:`load_tevatron_jsonl` — Tevatron-style jsonl ``{"query_id"?, "query", "positive_passages":
  [{"docid"?, "title"?, "text"}], "negative_passages": [...], "negative_queries"?: [str]}``; one row per
  query with its first positive (Tevatron draws one positive per epoch; tempokern keeps the first).
* :func:`rows_from_synth` — the ``train_rows`` of a ``tempokern.datasets.synth`` set.

``temporal`` fields: a list whose items are ``[start, end]`` character offsets, ``{"start", "end"}``
objects, or strings (the expression's text, located left to right in the text; a string that is not
found is a data error).

Errors raise :class:`~tempokern.datasets.base.DataFormatError` naming the file and the 1-based line
(or are skipped into the report with ``on_error="skip"``).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from .base import DataFormatError, LoadReport, _check_on_error, handle, read_jsonl, read_utf8

__all__ = ["TMRLRow", "TMRLData", "load_temporal_contrastive", "load_tevatron_jsonl", "rows_from_synth",
           "rows_from_train_rows", "mine_hard_negatives", "mine_negative_queries", "rows_from_dataset",
           "one_expression_text", "one_expression_rows", "QUERY_TYPES", "ALLEN_RELATIONS", "Spans"]

Spans = Optional[List[Tuple[int, int]]]

#: temporal_query_type values of the Table 13 schema
QUERY_TYPES = ("Explicit", "Implicit", "TemporalAnswer")
#: Allen's 13 interval relations plus "Empty" (no time in the question), compared case- and
#: punctuation-insensitively ("met-by", "MetBy" and "met_by" are one relation)
ALLEN_RELATIONS = ("Before", "After", "Meets", "MetBy", "Overlaps", "OverlappedBy", "Starts", "StartedBy",
                   "During", "Contains", "Finishes", "FinishedBy", "Equals", "Empty")
_ALLEN = {re.sub(r"[^a-z]", "", a.lower()): a for a in ALLEN_RELATIONS}


@dataclass
class TMRLRow:
    """One training row of A1. ``*_spans``: character spans per text (None = run the tagger)."""
    query: str
    positive: str
    hard_negatives: List[str] = field(default_factory=list)
    negative_queries: List[str] = field(default_factory=list)
    query_id: str = ""
    query_spans: Spans = None
    positive_spans: Spans = None
    hard_negative_spans: Optional[List[Spans]] = None
    negative_query_spans: Optional[List[Spans]] = None
    meta: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.query, str) or not self.query.strip():
            raise ValueError(f"row {self.query_id!r}: query must be a non-empty string")
        if not isinstance(self.positive, str) or not self.positive.strip():
            raise ValueError(f"row {self.query_id!r}: positive must be a non-empty string")
        for name in ("hard_negatives", "negative_queries"):
            v = getattr(self, name)
            if isinstance(v, str) or not all(isinstance(t, str) and t.strip() for t in v):
                raise ValueError(f"row {self.query_id!r}: {name} must be a list of non-empty strings")
            setattr(self, name, list(v))
        for name, texts in (("hard_negative_spans", self.hard_negatives),
                            ("negative_query_spans", self.negative_queries)):
            v = getattr(self, name)
            if v is not None and len(v) != len(texts):
                raise ValueError(f"row {self.query_id!r}: {name} has {len(v)} entries for {len(texts)} texts")


@dataclass
class TMRLData:
    """Rows plus the load report (what was read, kept and skipped)."""
    rows: List[TMRLRow]
    report: LoadReport
    name: str = "tmrl"

    def __len__(self) -> int:
        return len(self.rows)


# ---- spans --------------------------------------------------------------------------------------------

def resolve_spans(value: Any, text: str) -> List[Tuple[int, int]]:
    """A ``temporal`` field -> sorted character spans inside ``text`` (ValueError says what is wrong)."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise ValueError(f"temporal must be a list, got {type(value).__name__}")
    out, pos = [], 0
    for item in value:
        if isinstance(item, str):
            if not item.strip():
                raise ValueError("temporal holds an empty string")
            i = text.find(item, pos)
            if i < 0:
                i = text.find(item)
            if i < 0:
                low = text.lower()
                i = low.find(item.lower(), pos)
                if i < 0:
                    i = low.find(item.lower())
            if i < 0:
                raise ValueError(f"temporal expression {item!r} does not occur in the text {text[:60]!r}")
            s, e = i, i + len(item)
            pos = e
        else:
            if isinstance(item, dict):
                if "start" not in item or "end" not in item:
                    raise ValueError(f"temporal item {item!r} needs 'start' and 'end'")
                s, e = item["start"], item["end"]
            elif isinstance(item, (list, tuple)) and len(item) in (2, 3):
                s, e = item[0], item[1]
            else:
                raise ValueError(f"temporal item {item!r} is not a string, [start, end] or {{start, end}}")
            if any(isinstance(x, bool) or not isinstance(x, int) for x in (s, e)):
                raise ValueError(f"temporal span {item!r} needs integer offsets")
            if not 0 <= s < e <= len(text):
                raise ValueError(f"temporal span ({s}, {e}) lies outside the text of {len(text)} characters")
        out.append((int(s), int(e)))
    return sorted(out)


def _str(obj: dict, key: str, what: str) -> str:
    v = obj.get(key)
    if not isinstance(v, str) or not v.strip():
        raise ValueError(f"{what} needs a non-empty string {key!r}, got {v!r}")
    return v


def _list(obj: dict, key: str, what: str, required: bool = True) -> list:
    if key not in obj:
        if required:
            raise ValueError(f"{what} has no {key!r} list")
        return []
    v = obj[key]
    if not isinstance(v, list):
        raise ValueError(f"{what}: {key!r} must be a list, got {type(v).__name__}")
    return v


# ---- Table 13 schema ----------------------------------------------------------------------------------

def _capped(text: str, spans: Spans, report: LoadReport) -> Tuple[str, Spans]:
    """`text` cut to tempokern.limits.MAX_TEXT_CHARS (counted in `report`) and its spans that lie wholly in
    what is kept (an expression past the cap is not read, as the date tagger reads no further)."""
    cut = report.cap(text)
    if spans is None or len(cut) == len(text):
        return cut, spans
    return cut, [(a, b) for a, b in spans if b <= len(cut)]


def _iter_json_objects(path: str, report: LoadReport, on_error: str) -> Iterator[Tuple[int, Dict[str, Any]]]:
    """(line, object) of a JSON array file or a jsonl file (detected from the first character)."""
    text = read_utf8(path)
    head = text.lstrip()
    if not head.startswith("["):
        yield from read_jsonl(path, report, on_error)
        return
    report.files.append(str(path))
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    ws = " \t\r\n"
    first = True
    while True:
        while i < n and text[i] in ws:
            i += 1
        if i < n and text[i] == "]":
            after = text[i + 1:]
            if after.strip():   # a second array, or anything else, after the top-level one
                at = i + 1 + len(after) - len(after.lstrip())
                raise DataFormatError(str(path), text.count("\n", 0, at) + 1,
                                      f"unexpected content after the JSON array ({text[at:at + 20]!r})")
            return
        if not first:
            if i >= n or text[i] != ",":
                raise DataFormatError(str(path), text.count("\n", 0, i) + 1,
                                      "invalid JSON array (expected ',' or ']')")
            i += 1
            while i < n and text[i] in ws:
                i += 1
        line = text.count("\n", 0, i) + 1
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            raise DataFormatError(str(path), e.lineno, f"invalid JSON ({e.msg} at column {e.colno})") from None
        first = False
        report.rows_read += 1
        if not isinstance(obj, dict):
            handle(DataFormatError(str(path), line, f"expected a JSON object, got {type(obj).__name__}"),
                   report, on_error)
            continue
        yield line, obj


def _question(item: Any, what: str) -> Tuple[str, Spans, dict]:
    if not isinstance(item, dict):
        raise ValueError(f"{what} must be an object, got {type(item).__name__}")
    text = _str(item, "text", what)
    spans = resolve_spans(item.get("temporal"), text) if "temporal" in item else None
    meta = {}
    qt = item.get("temporal_query_type")
    if qt is not None:
        if qt not in QUERY_TYPES:
            raise ValueError(f"{what}: temporal_query_type must be one of {QUERY_TYPES}, got {qt!r}")
        meta["temporal_query_type"] = qt
    ar = item.get("allen_relation")
    if ar is not None:
        key = re.sub(r"[^a-z]", "", str(ar).lower())
        if key not in _ALLEN:
            raise ValueError(f"{what}: allen_relation must be one of {ALLEN_RELATIONS}, got {ar!r}")
        meta["allen_relation"] = _ALLEN[key]
    if item.get("docid") is not None:
        meta["docid"] = str(item["docid"])
    return text, spans, meta


def load_temporal_contrastive(path, *, on_error: str = "raise") -> TMRLData:
    """Rows of A1 from the TMRL augmentation schema (Table 13): one row per positive question."""
    _check_on_error(on_error)
    path = str(path)
    report = LoadReport()
    rows: List[TMRLRow] = []
    for ln, obj in _iter_json_objects(path, report, on_error):
        try:
            qid = str(obj.get("query_id", f"line{ln}"))
            passage = _str(obj, "query", "object")
            p_spans = resolve_spans(obj.get("temporal"), passage) if "temporal" in obj else None
            pos = _list(obj, "positive_passages", "object")
            if not pos:
                raise ValueError("positive_passages is empty")
            negs = [_question(x, f"negative_passages[{j}]")
                    for j, x in enumerate(_list(obj, "negative_passages", "object", required=False))]
            questions = [_question(item, f"positive_passages[{j}]") for j, item in enumerate(pos)]
            # every text cut to the character cap once (tempokern.limits), after the row is known to be valid
            passage, p_spans = _capped(passage, p_spans, report)
            negs = [(*_capped(t, sp, report), m) for t, sp, m in negs]
            new = []
            for j, (text, spans, meta) in enumerate(questions):
                text, spans = _capped(text, spans, report)
                new.append(TMRLRow(query=text, positive=passage, query_id=f"{qid}/{meta.get('docid', j)}",
                                   negative_queries=[t for t, _, _ in negs], query_spans=spans,
                                   positive_spans=p_spans, negative_query_spans=[s for _, s, _ in negs],
                                   meta={**meta, "passage_id": qid,
                                         "negative_meta": [m for _, _, m in negs]}))
        except ValueError as e:
            handle(DataFormatError(path, ln, str(e)), report, on_error)
            continue
        rows.extend(new)
        report.queries += len(new)
    if not rows:
        raise ValueError(f"{path}: no training rows ({report.summary()})")
    return TMRLData(rows, report, name=path)


# ---- Tevatron jsonl -----------------------------------------------------------------------------------

def _passage(item: Any, what: str) -> Tuple[str, Spans]:
    if not isinstance(item, dict):
        raise ValueError(f"{what} must be an object, got {type(item).__name__}")
    text = _str(item, "text", what)
    title = item.get("title")
    if title is not None and not isinstance(title, str):
        raise ValueError(f"{what}: title must be a string, got {type(title).__name__}")
    spans = resolve_spans(item.get("temporal"), text) if "temporal" in item else None
    if title and title.strip():   # Tevatron joins title and text with a space
        off = len(title) + 1
        text = f"{title} {text}"
        spans = None if spans is None else [(s + off, e + off) for s, e in spans]
    return text, spans


def load_tevatron_jsonl(path, *, on_error: str = "raise") -> TMRLData:
    """Rows of A1 from Tevatron-style jsonl (one row per query, its first positive passage)."""
    _check_on_error(on_error)
    path = str(path)
    report = LoadReport()
    rows: List[TMRLRow] = []
    for ln, obj in read_jsonl(path, report, on_error):
        try:
            query = _str(obj, "query", "object")
            q_spans = resolve_spans(obj.get("query_temporal"), query) if "query_temporal" in obj else None
            pos = _list(obj, "positive_passages", "object")
            if not pos:
                raise ValueError("positive_passages is empty")
            p_text, p_spans = _passage(pos[0], "positive_passages[0]")
            negs = [_passage(x, f"negative_passages[{j}]")
                    for j, x in enumerate(_list(obj, "negative_passages", "object", required=False))]
            nq = _list(obj, "negative_queries", "object", required=False)
            nq_texts, nq_spans = [], []
            for j, x in enumerate(nq):
                if isinstance(x, str):
                    if not x.strip():
                        raise ValueError(f"negative_queries[{j}] is empty")
                    nq_texts.append(x)
                    nq_spans.append(None)
                else:
                    t, s, _ = _question(x, f"negative_queries[{j}]")
                    nq_texts.append(t)
                    nq_spans.append(s)
            # every text cut to the character cap (tempokern.limits)
            query, q_spans = _capped(query, q_spans, report)
            p_text, p_spans = _capped(p_text, p_spans, report)
            negs = [_capped(t, sp, report) for t, sp in negs]
            capped = [_capped(t, sp, report) for t, sp in zip(nq_texts, nq_spans)]
            nq_texts, nq_spans = [t for t, _ in capped], [sp for _, sp in capped]
            row = TMRLRow(query=query, positive=p_text, hard_negatives=[t for t, _ in negs],
                          negative_queries=nq_texts, query_id=str(obj.get("query_id", f"line{ln}")),
                          query_spans=q_spans, positive_spans=p_spans, hard_negative_spans=[s for _, s in negs],
                          negative_query_spans=nq_spans)
        except ValueError as e:
            handle(DataFormatError(path, ln, str(e)), report, on_error)
            continue
        rows.append(row)
        report.queries += 1
    if not rows:
        raise ValueError(f"{path}: no training rows ({report.summary()})")
    return TMRLData(rows, report, name=path)


# ---- offline synthetic sets ---------------------------------------------------------------------------

def _meta_spans(meta: Any) -> Spans:
    if not isinstance(meta, dict) or meta.get("temporal_spans") is None:
        return None
    return [(int(s), int(e)) for s, e, *_ in meta["temporal_spans"]]


def rows_from_synth(synth: Any, *, limit: Optional[int] = None) -> TMRLData:
    """TMRL rows from a ``tempokern.datasets.synth`` SynthSet (its ``train_rows``; record and query
    ``meta["temporal_spans"]`` become the rows' spans). ``limit``: keep the first ``limit`` rows."""
    train = synth.train_rows[:limit] if limit is not None else synth.train_rows
    return rows_from_train_rows(synth.dataset, train, name=f"synth-{getattr(synth, 'name', '?')}")


def rows_from_train_rows(ds: Any, train_rows: Sequence[Any], *, name: str = "synth") -> TMRLData:
    """TMRL rows from TrainRow objects (query_id, query, positive, hard_negatives, negative_queries) whose
    documents are records of the RetrievalDataset ``ds``."""
    queries = {q.id: q for q in ds.queries}
    rows = []
    for tr in train_rows:
        pos = ds.record(tr.positive)
        negs = [ds.record(d) for d in tr.hard_negatives]
        q = queries.get(tr.query_id)
        same_text = q is not None and q.text == tr.query
        rows.append(TMRLRow(query=tr.query, positive=pos.text, hard_negatives=[r.text for r in negs],
                            negative_queries=list(tr.negative_queries), query_id=str(tr.query_id),
                            query_spans=_meta_spans(q.meta) if same_text else None,
                            positive_spans=_meta_spans(pos.meta),
                            hard_negative_spans=[_meta_spans(r.meta) for r in negs],
                            negative_query_spans=None,
                            meta={"negative_kinds": list(getattr(tr, "negative_kinds", []))}))
    report = LoadReport(rows_read=len(rows), queries=len(rows))
    return TMRLData(rows, report, name=name)


# ---- mining hard negatives (A1: data sets without negative passages) -----------------------------------------

def mine_hard_negatives(data, k: int = 4, *, scorer: Any = None, chunk: int = 1024, replace: bool = False):
    """Give each row up to ``k`` hard-negative passages: the highest-scoring passages of the pool of all rows'
    positive passages under ``scorer(queries, passages) -> (Q, P) scores`` (default: BM25,
    ``tempokern.baselines.BM25Scorer``, which needs bm25s), never the row's own positive nor a passage that is
    the positive of another row with the same query text (golds excluded). Rows that already have hard
    negatives keep them unless ``replace``. The passages keep their spans. Returns the same container type
    (a TMRLData or a list of rows), with new row objects."""
    import dataclasses

    import numpy as np

    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    rows = list(data.rows if isinstance(data, TMRLData) else data)
    pool: Dict[str, int] = {}
    spans: List[Spans] = []
    for r in rows:
        if r.positive not in pool:
            pool[r.positive] = len(pool)
            spans.append(r.positive_spans)
    texts = list(pool)
    golds: Dict[str, set] = {}
    for r in rows:
        golds.setdefault(r.query, set()).add(pool[r.positive])
    if scorer is None:
        from ..baselines import BM25Scorer
        scorer = BM25Scorer()
    from types import SimpleNamespace
    gallery = [SimpleNamespace(id=str(i), text=t) for i, t in enumerate(texts)]
    todo = [i for i, r in enumerate(rows) if replace or not r.hard_negatives]
    out = list(rows)
    for s in range(0, len(todo), chunk):
        part = todo[s:s + chunk]
        sc = np.asarray(scorer([SimpleNamespace(text=rows[i].query) for i in part], gallery), dtype=np.float64)
        for j, i in enumerate(part):
            row = sc[j].copy()
            row[list(golds[rows[i].query])] = -np.inf
            n = min(k, int(np.isfinite(row).sum()))
            best = np.argsort(-row, kind="stable")[:n]
            out[i] = dataclasses.replace(rows[i], hard_negatives=[texts[b] for b in best],
                                         hard_negative_spans=[spans[b] for b in best])
    if isinstance(data, TMRLData):
        return TMRLData(out, data.report, data.name)
    return out


def mine_negative_queries(data, k: int = 4, *, group_key: str = "page", tokenizer=None):
    """Give rows without negative queries up to ``k`` of them from the other rows' queries: first those
    of the same ``meta[group_key]`` (e.g. the page: same entity, other time), then the lexically closest
    (BM25 over word tokens, bm25s) — never a query with the row's positive passage, nor the row's own
    query text. Returns the same container type with new row objects."""
    import dataclasses

    import numpy as np

    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    rows = list(data.rows if isinstance(data, TMRLData) else data)
    texts = list(dict.fromkeys(r.query for r in rows))
    pos_of: Dict[str, set] = {}
    for r in rows:
        pos_of.setdefault(r.query, set()).add(r.positive)
    by_group: Dict[Any, List[str]] = {}
    for r in rows:
        g = r.meta.get(group_key) if isinstance(r.meta, dict) else None
        if g is not None and r.query not in by_group.setdefault(g, []):
            by_group[g].append(r.query)
    todo = [i for i, r in enumerate(rows) if not r.negative_queries]
    scores = None
    if todo:
        from types import SimpleNamespace

        from ..baselines import BM25Scorer
        from .negatives import word_tokenize
        scorer = BM25Scorer(tokenizer=tokenizer or word_tokenize)
        gallery = [SimpleNamespace(id=str(i), text=t) for i, t in enumerate(texts)]
        scores = np.asarray(scorer([SimpleNamespace(text=rows[i].query) for i in todo], gallery))
    out = list(rows)
    for n, i in enumerate(todo):
        r = rows[i]
        ok = lambda t: t != r.query and not (pos_of[t] & pos_of[r.query])   # noqa: E731
        g = r.meta.get(group_key) if isinstance(r.meta, dict) else None
        picked = [t for t in by_group.get(g, ()) if ok(t)][:k] if g is not None else []
        if len(picked) < k:
            order = np.argsort(-scores[n], kind="stable")
            for j in order:
                t = texts[int(j)]
                if len(picked) >= k or scores[n][j] <= 0:
                    break
                if ok(t) and t not in picked:
                    picked.append(t)
        if picked:
            out[i] = dataclasses.replace(r, negative_queries=picked, negative_query_spans=None)
    if isinstance(data, TMRLData):
        return TMRLData(out, data.report, data.name)
    return out


def rows_from_dataset(ds, split: str = "train", *, hard_negatives: int = 4, negative_queries: int = 4,
                      name: Optional[str] = None) -> TMRLData:
    """TMRL rows from a :class:`RetrievalDataset`'s queries of ``split`` (a BEIR folder, TimeQA): one row
    per (query, gold record); hard-negative passages from the query's ``meta["neg_page"]`` /
    ``meta["neg_bm25"]`` lists when the data has them, else the same page's other records
    (``meta["page"]``), else BM25-mined; negative queries: the same page's other questions, else the
    lexically closest queries with other gold (:func:`mine_negative_queries`)."""
    from .base import LoadReport
    from .negatives import bm25_negatives, group_negatives
    qs = [q for q in ds.queries if q.split == split and q.relevant_ids()]   # score > 0 (is_relevant)
    if not qs:
        have = sorted({str(q.split) for q in ds.queries})
        raise ValueError(f"dataset {ds.name!r} has no query with gold records in split {split!r} (splits: {have})")
    negs: Dict[str, List[str]] = {}
    for q in qs:
        ids = [d for key in ("neg_page", "neg_bm25") for d in (q.meta or {}).get(key) or () if d in ds]
        negs[q.id] = list(dict.fromkeys(ids))
    if hard_negatives > 0:
        need = [q for q in qs if not negs[q.id]]
        if need:
            page = group_negatives(ds, "page", k=hard_negatives, queries=need)
            still = [q for q in need if not page.get(q.id)]
            mined = bm25_negatives(ds, hard_negatives, queries=still) if still else {}
            for q in need:
                negs[q.id] = page.get(q.id) or mined.get(q.id, [])
    rows: List[TMRLRow] = []
    for q in qs:
        hn = [ds.record(d).text for d in negs[q.id] if ds.record(d).text.strip()]
        for d in q.relevant_ids():
            if d not in ds or not ds.record(d).text.strip():
                continue
            rows.append(TMRLRow(q.text, ds.record(d).text, hard_negatives=hn, query_id=q.id,
                                meta={"page": (q.meta or {}).get("page"), "doc_id": d}))
    report = LoadReport(files=list(ds.report.files), records=len(ds.records), queries=len(qs))
    data = TMRLData(rows, report, name or ds.name)
    if negative_queries > 0:
        data = mine_negative_queries(data, negative_queries)
    return data


# ---- one date expression per passage (the paper's training passages) ------------------------------------------

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def _sentences(text: str) -> List[Tuple[int, int]]:
    """Character spans of the sentences of ``text``: cut after '.', '!' or '?' followed by whitespace (the
    whitespace belongs to no sentence). A rule, not a parser: an abbreviation such as "Jr." also ends one."""
    out, start = [], 0
    for m in _SENTENCE_END.finditer(text):
        if m.start() > start:
            out.append((start, m.start()))
        start = m.end()
    if start < len(text):
        out.append((start, len(text)))
    return out


def _years(iv) -> Tuple[int, int]:
    (s, e) = iv
    return int(s[0]), int(e[0])


def one_expression_text(text: str, when: Optional[Sequence[Tuple[int, int]]] = None, *,
                        window: int = 0) -> Tuple[str, Optional[Tuple[int, int]], str]:
    """``text`` cut to the sentence that holds one date expression, with ``window`` sentences either side.

    The expression: the first one (``tempokern.text.temporal_spans``, read by ``time_intervals``) whose years
    overlap ``when[0] = (first year, last year)``, else ``when[1]``, ... (the question's times in order of
    preference); with ``when=None`` the first dated expression. Returns ``(text', span, how)``: ``span`` the kept expression's (start, end) in ``text'``;
    ``how`` one of ``"cut"`` (a sentence window kept), ``"whole"`` (the window is the whole text), ``"no_match"``
    (no expression overlaps ``when``: the text is returned whole, span None) and ``"undated"`` (no dated
    expression at all: whole, span None). Other expressions inside the kept sentences stay (a range "from 1935 to
    1937" is one expression)."""
    from ..text.intervals import time_intervals
    from ..text.temporal import temporal_spans
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be an int >= 0, got {window!r}")
    dated = []
    for s, e, _ in temporal_spans(text):
        ivs = time_intervals(text[s:e])
        if ivs:
            dated.append((s, e, min(_years(iv)[0] for iv in ivs), max(_years(iv)[1] for iv in ivs)))
    if not dated:
        return text, None, "undated"
    if when is None:
        pick = dated[0]
    else:
        hits = [d for lo, hi in when for d in dated if d[2] <= hi and d[3] >= lo]
        if not hits:
            return text, None, "no_match"
        pick = hits[0]
    sents = _sentences(text)
    k = next(i for i, (_, b) in enumerate(sents) if pick[0] < b)    # the sentence the expression starts in
    a, b = sents[max(0, k - window)][0], sents[min(len(sents) - 1, k + window)][1]
    a = min(a, pick[0])
    b = max(b, pick[1])
    if a == 0 and b == len(text):
        return text, (pick[0], pick[1]), "whole"
    return text[a:b], (pick[0] - a, pick[1] - a), "cut"


def one_expression_rows(data, *, window: int = 0, negatives: bool = True):
    """Rows whose passages state one date expression, as the paper's training passages (TMRL builds its data
    with one temporal expression per passage): each positive cut by :func:`one_expression_text` to the
    sentence window around the first expression overlapping the question's time (the years of the query's
    own date expressions, ``tempokern.text.time_intervals``, its last expression first: a TimeQA question such
    as "The German who began his naval career in April 1935 held what position from Apr 1937 to Apr 1939?"
    asks about its last one; a query without one: the passage's first dated expression), and with ``negatives`` each hard negative cut around its first dated expression. A passage
    with no such expression is kept whole. The kept passages' spans are their kept expression (the temporal
    tokens L_Temp pools); whole passages keep theirs. Queries and negative queries are unchanged.

    Returns ``(rows, counts)``: the same container type with new row objects, and ``counts`` = how many
    positives / hard negatives were ``cut``, kept ``whole``, had ``no_match`` or were ``undated``."""
    import dataclasses

    from ..text.intervals import time_intervals
    rows = list(data.rows if isinstance(data, TMRLData) else data)
    counts = {"positives": {k: 0 for k in ("cut", "whole", "no_match", "undated")},
              "hard_negatives": {k: 0 for k in ("cut", "whole", "no_match", "undated")}}
    out = []
    for r in rows:
        when = [_years(iv) for iv in reversed(time_intervals(r.query))] or None
        pos, span, how = one_expression_text(r.positive, when, window=window)
        counts["positives"][how] += 1
        pos_spans = [span] if how == "cut" else r.positive_spans
        negs, neg_spans = list(r.hard_negatives), (list(r.hard_negative_spans)
                                                   if r.hard_negative_spans is not None else None)
        if negatives:
            for j, t in enumerate(r.hard_negatives):
                t2, sp, h = one_expression_text(t, None, window=window)
                counts["hard_negatives"][h] += 1
                if h == "cut":
                    negs[j] = t2
                    if neg_spans is None:
                        neg_spans = [None] * len(negs)
                    neg_spans[j] = [sp]
        out.append(dataclasses.replace(r, positive=pos, positive_spans=pos_spans, hard_negatives=negs,
                                       hard_negative_spans=neg_spans,
                                       meta={**r.meta, "one_expression": how}))
    if isinstance(data, TMRLData):
        return TMRLData(out, data.report, name=data.name), counts
    return out, counts
