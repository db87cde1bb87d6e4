"""TimeQA (Chen, Wang and Wang, NeurIPS 2021 Datasets and Benchmarks; BSD 3-Clause) as a temporal
retrieval task: the human-annotated training pages, packaged compressed in ``tempokern/data`` with the
licence notice (``LICENSE-TimeQA``), so :func:`load_timeqa` works offline.

* Gallery: every paragraph of every page (``paras[0]`` is the title, short items are section headers;
  both stay, as distractors). Pages listed twice (two relations of one Wikipedia page) hold the same
  paragraphs; each paragraph is one record, id ``"<page>:<n>"`` (``"Newton_D._Baker_House:18"``).
* Queries: the human-written questions, id ``"<page>#<relation>:q<n>"``; gold = the paragraphs holding
  one of the question's answers.
* Times (no field in the source: read from the text by :func:`tempokern.text.time_intervals`, every
  date expression): ``meta["times"]`` lists each expression's ``[start, end]`` (date prefixes as
  ``"YYYY"`` / ``"YYYY-MM"`` / ``"YYYY-MM-DD"``), and ``interval`` is their hull on a year/month
  Gregorian calendar spanning the years found; a question's range ("from 2004 to 2005") is its interval.
  Query ``family``: ``range`` / ``point`` (a single date) / ``implicit`` (no date in the question).
* Splits by page, never by question (a page's paragraphs are shared by its questions): a page's split
  is fixed by the sha256 of its link, ``train`` / ``dev`` / ``test`` at 70 / 15 / 15 per cent, so it is
  the same on every machine and a page never moves when other pages are added or removed.
* Hard negatives: :func:`timeqa_hard_negatives` (same-page paragraphs: the temporal confounders; and
  BM25-mined ones from the whole gallery); :func:`export_beir` writes the set as a BEIR folder.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import os
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from .._resources import data_path
from .._util import sha256_file
from ..calendar import Calendar
from ..limits import cap_texts
from .base import DataFormatError, LoadReport, Query, Record, RetrievalDataset, _check_on_error, handle

__all__ = ["load_timeqa", "timeqa_page_split", "timeqa_hard_negatives", "export_beir", "TIMEQA_SPLITS",
           "format_prefix", "select_splits"]

TIMEQA_FILE = "timeqa_human_annotated_train.json.gz"
#: split names and their per-cent shares of the pages
TIMEQA_SPLITS = (("train", 70), ("dev", 15), ("test", 15))


def timeqa_page_split(link: str, shares: Sequence[Tuple[str, int]] = TIMEQA_SPLITS) -> str:
    """The split of a page: its link's sha256 taken modulo the shares' total."""
    total = sum(s for _, s in shares)
    b = int(hashlib.sha256(link.encode("utf-8")).hexdigest(), 16) % total
    for name, s in shares:
        if b < s:
            return name
        b -= s
    raise AssertionError("unreachable")


def format_prefix(p: Sequence[int]) -> str:
    """``(2019,)`` -> ``"2019"``, ``(2019, 5)`` -> ``"2019-05"``, ``(2019, 5, 4)`` -> ``"2019-05-04"``."""
    return "-".join([f"{p[0]:04d}"] + [f"{x:02d}" for x in p[1:]])


def _items(path: str, report: LoadReport, on_error: str) -> Iterator[Tuple[int, int, Any]]:
    """(1-based line, 0-based item index, item) of a JSON array file (gzip when it ends in .gz)."""
    report.files.append(str(path))
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        ln = data.count(b"\n", 0, e.start) + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise DataFormatError(str(path), ln, f"not valid UTF-8 (byte 0x{data[e.start]:02x} at column {col})") \
            from None
    dec = json.JSONDecoder()
    i = len(text) - len(text.lstrip())
    if not text.startswith("[", i):
        raise DataFormatError(str(path), text.count("\n", 0, i) + 1, "expected a JSON array of pages")
    i += 1
    n = 0
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text):
            raise DataFormatError(str(path), text.count("\n") + 1, "unterminated JSON array")
        if text[i] == "]":
            rest = i + 1 + (len(text) - i - 1 - len(text[i + 1:].lstrip()))
            if rest < len(text):   # a second array, or anything else, after the top-level one
                raise DataFormatError(str(path), text.count("\n", 0, rest) + 1,
                                      f"unexpected content after the JSON array ({text[rest:rest + 20]!r}): a TimeQA "
                                      "file holds one array of pages")
            return
        ln = text.count("\n", 0, i) + 1
        try:
            obj, j = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:   # nothing after a broken item can be read back reliably
            raise DataFormatError(str(path), e.lineno, f"invalid JSON in item {n} ({e.msg} at column {e.colno})") \
                from None
        report.rows_read += 1
        yield ln, n, obj
        i, n = j, n + 1


def _check_item(path: str, ln: int, n: int, obj: Any) -> Tuple[str, str, str, List[str], list]:
    where = f"item {n}"
    if not isinstance(obj, dict):
        raise DataFormatError(path, ln, f"{where}: expected a JSON object, got {type(obj).__name__}")
    index, link = obj.get("index"), obj.get("link")
    if not isinstance(index, str) or not index:
        raise DataFormatError(path, ln, f"{where}: missing string field 'index'")
    where = f"item {n} ({index})"
    if not isinstance(link, str) or not link:
        link = index.split("#")[0]
    paras = obj.get("paras")
    if not isinstance(paras, list) or not paras or not all(isinstance(p, str) for p in paras):
        raise DataFormatError(path, ln, f"{where}: 'paras' must be a non-empty list of strings")
    qs = obj.get("questions")
    if not isinstance(qs, list):
        raise DataFormatError(path, ln, f"{where}: 'questions' must be a list")
    for k, q in enumerate(qs):
        if (not isinstance(q, list) or len(q) != 2 or not isinstance(q[0], str) or not q[0].strip()
                or not isinstance(q[1], list) or not q[1]):
            raise DataFormatError(path, ln, f"{where}: question {k} must be [text, [answer, ...]] with a "
                                            "non-empty text and at least one answer")
        for a in q[1]:
            p = a.get("para") if isinstance(a, dict) else None
            if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < len(paras):
                raise DataFormatError(path, ln, f"{where}: question {k}: answer paragraph {p!r} is not an index "
                                                f"into its {len(paras)} paragraphs")
    return index, link, str(obj.get("type") or ""), paras, qs


def _tagger_version() -> str:
    """sha256 of the tagger's sources: a cache of text times is valid for one version of the rules."""
    from ..text import intervals, temporal, time as _time
    h = hashlib.sha256()
    for m in (intervals, temporal, _time):
        with open(m.__file__, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def _text_times(texts: Sequence[str], data_sha: Optional[str], cache: bool) -> List[list]:
    """:func:`time_intervals` of every text; with ``cache`` and a data hash, kept in
    ``$TEMPOKERN_CACHE/timeqa`` (default ``~/.cache/tempokern/timeqa``) keyed by the data's sha256 and the
    tagger's sources, so the tagging runs once per data and tagger version."""
    from ..text.intervals import time_intervals
    path = None
    if cache and data_sha:
        from .synth._common import cache_root
        path = cache_root().parent / "timeqa" / f"times-{data_sha[:16]}-{_tagger_version()}.json"
        try:
            got = json.loads(path.read_text(encoding="utf-8"))
            if len(got) == len(texts):
                return [[(tuple(a), tuple(b)) for a, b in ivs] for ivs in got]
        except (OSError, ValueError):
            pass
    from ..models._batching import progress
    step = 500
    chunks = [texts[i:i + step] for i in range(0, len(texts), step)]
    out = []
    for chunk in progress(chunks, len(chunks), "tagging dates"):   # the command line shows progress
        out += [time_intervals(t) for t in chunk]
    if path is not None:
        try:
            from ..models.checkpoint import atomic_write
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, json.dumps([[[list(a), list(b)] for a, b in ivs] for ivs in out]))
        except OSError:
            pass
    return out


def _slug(s: str) -> str:
    return s[len("/wiki/"):] if s.startswith("/wiki/") else s.lstrip("/")


def load_timeqa(path: Optional[str] = None, *, on_error: str = "raise", name: str = "timeqa",
                cache: bool = True) -> RetrievalDataset:
    """TimeQA's human-annotated pages as a retrieval set (module docstring). ``path``: a TimeQA JSON
    file (``human_annotated_train.json``, or gzipped); default the packaged copy. Malformed pages raise
    :class:`DataFormatError` naming the file and line, or with ``on_error="skip"`` are left out and
    listed in ``dataset.report`` (a file that is not valid JSON stops the load either way: nothing after the
    break can be read back reliably). The text times are cached (``cache``; see :func:`_text_times`): the
    first load of a file tags ~17k texts (tens of seconds), later loads read the cache."""
    from ..text.intervals import hull
    _check_on_error(on_error)
    report = LoadReport()
    if path is None:
        with data_path(TIMEQA_FILE) as p:
            items = list(_items(str(p), report, on_error))
            data_sha = sha256_file(str(p))
        report.files[-1] = f"tempokern/data/{TIMEQA_FILE}"
        src = report.files[-1]
    else:
        if not os.path.exists(path):
            raise FileNotFoundError(f"TimeQA file {path} does not exist")
        items = list(_items(str(path), report, on_error))
        data_sha = sha256_file(str(path))
        src = str(path)
    pages: Dict[str, List[str]] = {}
    rows, seen_index = [], set()
    for ln, n, obj in items:
        try:
            index, link, rel, paras, qs = _check_item(src, ln, n, obj)
            if index in seen_index:
                raise DataFormatError(src, ln, f"item {n}: duplicate page entry {index!r}")
            if link in pages and pages[link] != cap_texts(paras):
                raise DataFormatError(src, ln, f"item {n} ({index}): page {link} was listed before with other "
                                               "paragraphs")
        except DataFormatError as e:
            handle(e, report, on_error)
            continue
        if link not in pages:
            paras = [report.cap(p) for p in paras]   # before the date tagger (tempokern.limits)
        qs = [[report.cap(q[0]), *q[1:]] for q in qs]
        pages.setdefault(link, paras)
        seen_index.add(index)
        rows.append((ln, index, link, rel, qs))

    all_texts = [p for paras in pages.values() for p in paras] + [q[0] for *_, qs in rows for q in qs]
    tagged = iter(_text_times(all_texts, data_sha if not report.skipped else None, cache))
    raw_records = []
    for link, paras in pages.items():
        page = _slug(link)
        for i, p in enumerate(paras):
            raw_records.append((f"{page}:{i}", p, page, link, i, next(tagged)))
    raw_queries = []
    for ln, index, link, rel, qs in rows:
        page = _slug(link)
        for k, (text, answers) in enumerate(qs):
            qid = f"{_slug(index)}:q{k}"
            gold = {f"{page}:{a['para']}": 1 for a in answers}
            raw_queries.append((qid, text.strip(), page, link, rel, gold, next(tagged), answers))
    years = [p[0] for *_, ivs in raw_records for iv in ivs for p in iv]
    years += [p[0] for q in raw_queries for iv in q[6] for p in iv]
    if not years:
        raise ValueError(f"{src}: no date found in any paragraph or question")
    cal = Calendar.gregorian(min(years), max(years), resolution="month")

    def interval(ivs):
        h = hull(ivs)
        return None if h is None else cal.interval(h[0][:2], h[1][:2])

    def times(ivs):
        return [[format_prefix(a), format_prefix(b)] for a, b in ivs]

    title = {link: paras[0] for link, paras in pages.items()}
    records = [Record(rid, text, interval=interval(ivs), title=title[link],
                      meta={"page": page, "para": i, "times": times(ivs)})
               for rid, text, page, link, i, ivs in raw_records]
    queries = []
    for qid, text, page, link, rel, gold, ivs, answers in raw_queries:
        fam = "implicit" if not ivs else "range" if any(a != b for a, b in ivs) else "point"
        queries.append(Query(qid, text, interval=interval(ivs), family=fam, gold=gold,
                             split=timeqa_page_split(link),
                             meta={"page": page, "relation": rel, "times": times(ivs),
                                   "answers": [a.get("answer") for a in answers]}))
    report.records, report.queries = len(records), len(queries)
    report.notes.append(f"{len(pages)} pages, {len(rows)} (page, relation) entries; splits by page: "
                        + ", ".join(f"{s} {sum(q.split == s for q in queries)} queries" for s, _ in TIMEQA_SPLITS))
    return RetrievalDataset(name, records, queries, cal, report)




def select_splits(dataset, splits: Sequence[str]) -> RetrievalDataset:
    """The pages of ``splits`` only: their paragraphs and their questions (a page's split is fixed, so a
    training folder and a held-out folder written this way share no paragraph)."""
    known = {s for s, _ in TIMEQA_SPLITS}
    bad = [s for s in splits if s not in known]
    if bad or not splits:
        raise ValueError(f"splits must be some of {', '.join(sorted(known))}, got {list(splits)}")
    qs = [q for q in dataset.queries if q.split in splits]
    pages = {(q.meta or {}).get("page") for q in qs}
    recs = [r for r in dataset.records if (r.meta or {}).get("page") in pages]
    return RetrievalDataset(f"{dataset.name}[{','.join(splits)}]", recs, qs, dataset.calendar, dataset.report)


def timeqa_hard_negatives(dataset, k: int = 4, *,
                          kinds: Sequence[str] = ("page", "bm25")) -> Dict[str, Dict[str, List[str]]]:
    """``{kind: {query id: [record id, ...]}}`` with up to ``k`` per query: ``page`` = the same page's
    other paragraphs that carry a date (the temporal confounders: same entity, other time), then undated
    ones; ``bm25`` = the lexically closest non-gold paragraphs of the whole gallery (bm25s)."""
    from .negatives import bm25_negatives, group_negatives
    out: Dict[str, Dict[str, List[str]]] = {}
    for kind in kinds:
        if kind == "page":
            out[kind] = group_negatives(dataset, "page", k=k)
        elif kind == "bm25":
            out[kind] = bm25_negatives(dataset, k)
        else:
            raise ValueError(f"unknown hard-negative kind {kind!r}: expected 'page' or 'bm25'")
    return out


def export_beir(dataset, out_dir: str, *, negatives: Optional[Dict[str, Dict[str, List[str]]]] = None,
                license_text: Optional[str] = None) -> Dict[str, Any]:
    """Write ``dataset`` as a BEIR folder: ``corpus.jsonl`` (``_id``, ``title``, ``text``, ``start`` /
    ``end`` = the hull of the text's dates, ``times`` = every date expression, ``page``),
    ``queries.jsonl`` (``_id``, ``text``, ``start`` / ``end``, ``times``, ``family``, ``page``, and each
    kind of hard negatives as ``neg_<kind>``), ``qrels/<split>.tsv`` per query split, and ``LICENSE``
    when given. Returns counts."""
    os.makedirs(os.path.join(out_dir, "qrels"), exist_ok=True)
    cal = dataset.calendar
    # an export into a used folder replaces what an export owns: no stale split or licence stays behind
    splits = sorted({q.split for q in dataset.queries if q.split})
    removed = [os.path.join("qrels", f) for f in sorted(os.listdir(os.path.join(out_dir, "qrels")))
               if f.endswith(".tsv") and f[:-4] not in splits]
    if not license_text and os.path.isfile(os.path.join(out_dir, "LICENSE")):
        removed.append("LICENSE")
    for rel in removed:
        os.unlink(os.path.join(out_dir, rel))

    def span(iv):
        if iv is None or cal is None:
            return {}
        a, b = cal.key_at(iv.start), cal.key_at(iv.end)
        return {"start": format_prefix(a), "end": format_prefix(b)}

    with open(os.path.join(out_dir, "corpus.jsonl"), "w", encoding="utf-8") as f:
        for r in dataset.records:
            row = {"_id": r.id, "title": r.title, "text": r.text, **span(r.interval)}
            row.update({k: v for k, v in (r.meta or {}).items() if k in ("times", "page")})
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    with open(os.path.join(out_dir, "queries.jsonl"), "w", encoding="utf-8") as f:
        for q in dataset.queries:
            row = {"_id": q.id, "text": q.text, **span(q.interval), "family": q.family}
            row.update({k: v for k, v in (q.meta or {}).items() if k in ("times", "page")})
            for kind, negs in (negatives or {}).items():
                row[f"neg_{kind}"] = negs.get(q.id, [])
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    counts: Dict[str, Any] = {"records": len(dataset.records), "queries": len(dataset.queries)}
    if removed:
        counts["removed"] = removed
    for s in splits:
        with open(os.path.join(out_dir, "qrels", f"{s}.tsv"), "w", encoding="utf-8") as f:
            f.write("query-id\tcorpus-id\tscore\n")
            n = 0
            for q in dataset.queries:
                if q.split == s:
                    for d, rel in q.gold.items():
                        f.write(f"{q.id}\t{d}\t{rel}\n")
                    n += 1
        counts[s] = n
    if license_text:
        with open(os.path.join(out_dir, "LICENSE"), "w", encoding="utf-8") as f:
            f.write(license_text)
    return counts
