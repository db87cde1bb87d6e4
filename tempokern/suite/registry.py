"""The method registry of the English comparison suite (`tempokern benchmark --suite english`).

A method is a row of the comparison table. It registers itself from a module of
:mod:`tempokern.suite.methods` (the runner imports every module there, none is skipped silently)::

    from tempokern.suite import Method, MethodOutput, register

    def run(ctx):                       # ctx: a SuiteContext
        ...train on ctx.train_rows(); for split in ctx.eval_splits: score ctx.queries(split) over ctx.gallery(split)...
        return MethodOutput(runs={split: {qid: {doc_id: score}}}, info={"train_seconds": 12.3})

    register(Method("mymethod", family="mine", sets=("B",), run=run, needs=("peft",)))

``needs``: importable module names; when one is missing the method is reported as *skipped* (with
the reason) in results.json / results.md instead of failing the suite.

``MethodOutput``:

* ``runs`` ``{split: {qid: {doc_id: score}}}``: at least the top 100 documents per query, over the
  whole of the split's gallery ``ctx.gallery(split)``, for every split of ``ctx.eval_splits``
  (:func:`topk_runs` builds it from a score matrix). The suite computes every metric itself from the runs
  and the dataset. The real-data sets add two extra splits: ``fit`` (training questions over a training
  gallery shaped like the evaluation gallery: the time-prior rows fit their weight on it) and
  ``dev@corpus`` (the evaluation questions over the whole corpus). Encode ``ctx.all_gallery()`` once and
  take each split's rows with ``ctx.gallery_index(split)``.
* ``dim_runs`` ``{dim: runs}`` for Matryoshka methods (the per-dim curves); ``runs`` is then the
  full-dim run.
* ``info``: anything to log (train seconds, steps, losses). ``info["metrics"] = {split: {name:
  value}}`` is copied into the results as extra per-method metrics (e.g. the recency filter's stale
  rate); values must be JSON numbers.
* ``embed`` (optional) ``embed(texts: list[str]) -> Tensor (n, d)``: the method's text embedding
  (L2-normalised or not: the suite normalises). With it the suite computes the similarity-preservation
  proxy of the design notes §4.3 (Spearman between the zero-shot and this method's cosine similarities
  on random pairs of time-stripped documents). Alternatively ``pair_sims``: the method's cosine
  similarities on ``ctx.retention_pairs()`` (a list of (text_a, text_b)), computed by the method itself.
  Neither given: the proxy is reported as n/a for that method.
"""
from __future__ import annotations

import importlib.util
import random
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

__all__ = ["Method", "MethodOutput", "SuiteContext", "register", "registered", "unregister", "get_method",
           "missing_needs", "topk_runs", "SETS", "SYNTH_SETS", "REAL_SETS", "PERTURBED_SETS", "runs_on", "EVAL_SPLITS", "TRAIN_SPLIT", "Budget",
           "FIT_SPLIT", "CORPUS_SUFFIX"]

#: the synthetic English sets (tempokern.datasets.synth)
SYNTH_SETS = ("A", "B", "C")
#: real data (tempokern.suite.realdata): TimeQA, and a BEIR folder of your own
REAL_SETS = ("timeqa", "data")
#: set B with its documents perturbed (tempokern.datasets.synth.perturb): a second date / no publication date;
#: a method runs on them when it runs on their base set
PERTURBED_SETS = ("B-2date", "B-nopub")
SETS = SYNTH_SETS + PERTURBED_SETS + REAL_SETS


def runs_on(method: "Method", set_name: str) -> bool:
    """Whether ``method`` runs on ``set_name`` (a perturbed set counts as its base set)."""
    return set_name in method.sets or (set_name in PERTURBED_SETS and set_name.split("-")[0] in method.sets)
#: query splits a method is evaluated on (those a set has; "train" and "val" are never evaluated)
EVAL_SPLITS = ("test_template", "test_date", "test_year", "test_masked", "timeless")
TRAIN_SPLIT = "train"
#: the extra split of training queries ranked over a training gallery shaped like the evaluation gallery: the
#: time-prior rows fit their weight on its run (tempokern.suite.prior); never in the tables
FIT_SPLIT = "fit"
#: suffix of an extra split whose queries are an evaluation split's, ranked over the whole corpus ("dev@corpus")
CORPUS_SUFFIX = "@corpus"

Runs = Dict[str, Dict[str, Dict[str, float]]]


@dataclass
class MethodOutput:
    """What a method's ``run(ctx)`` returns (see the module doc)."""
    runs: Runs
    dim_runs: Optional[Dict[int, Runs]] = None
    info: Dict[str, Any] = field(default_factory=dict)
    embed: Optional[Callable[[Sequence[str]], Any]] = None
    pair_sims: Optional[Sequence[float]] = None

    def validate(self, eval_splits: Sequence[str], method: str = "method") -> "MethodOutput":
        if not isinstance(self.runs, Mapping):
            raise TypeError(f"{method}: MethodOutput.runs must be a dict {{split: {{qid: {{doc_id: score}}}}}}, "
                            f"got {type(self.runs).__name__}")
        missing = [s for s in eval_splits if s not in self.runs]
        if missing:
            raise ValueError(f"{method}: MethodOutput.runs lacks split(s) {missing} of ctx.eval_splits")
        if self.dim_runs is not None:
            if not isinstance(self.dim_runs, Mapping):
                raise TypeError(f"{method}: MethodOutput.dim_runs must be a dict {{dim: runs}}")
            for dim, runs in self.dim_runs.items():
                if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
                    raise ValueError(f"{method}: dim_runs keys must be positive ints, got {dim!r}")
                miss = [s for s in eval_splits if s not in runs]
                if miss:
                    raise ValueError(f"{method}: dim_runs[{dim}] lacks split(s) {miss}")
        if not isinstance(self.info, Mapping):
            raise TypeError(f"{method}: MethodOutput.info must be a dict")
        extra = self.info.get("metrics")
        if extra is not None:
            if not isinstance(extra, Mapping) or not all(isinstance(v, Mapping) for v in extra.values()):
                raise TypeError(f"{method}: info['metrics'] must be {{split: {{name: value}}}}")
        return self


@dataclass(frozen=True)
class Method:
    """A row of the comparison: ``run(ctx) -> MethodOutput`` on each set of ``sets``.

    ``family``: the group in the table ("lexical", "dense", "ctd", "tmrl", "re3", ...);
    ``needs``: module names that must be importable; ``description``: one line for results.md;
    ``seeded``: False for a deterministic method that ignores the seed (BM25, a frozen model): it runs
    once (seed 0) and that result stands for every seed; ``in_quick``: False for a row left out of
    ``--quick`` runs (reported as such) to keep the CI run under its time budget; ``quick_sets``: the
    sets a row runs on in ``--quick`` runs (None: all of ``sets``), for the same reason."""
    name: str
    family: str
    sets: Tuple[str, ...]
    run: Callable[["SuiteContext"], MethodOutput]
    needs: Tuple[str, ...] = ()
    description: str = ""
    seeded: bool = True
    in_quick: bool = True
    quick_sets: Optional[Tuple[str, ...]] = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name or any(c in self.name for c in "/\\ \t\n"):
            raise ValueError(f"Method name must be a non-empty string without '/', '\\' or spaces, got {self.name!r}")
        if isinstance(self.sets, str):
            object.__setattr__(self, "sets", (self.sets,))
        object.__setattr__(self, "sets", tuple(self.sets))
        bad = [s for s in self.sets if s not in SETS]
        if bad or not self.sets:
            raise ValueError(f"Method {self.name!r}: sets must be some of {SETS}, got {self.sets!r}")
        if self.quick_sets is not None:
            qs = (self.quick_sets,) if isinstance(self.quick_sets, str) else tuple(self.quick_sets)
            if not qs or any(x not in self.sets for x in qs):
                raise ValueError(f"Method {self.name!r}: quick_sets must be some of its sets {self.sets}, "
                                 f"got {self.quick_sets!r}")
            object.__setattr__(self, "quick_sets", qs)
        if isinstance(self.needs, str):
            object.__setattr__(self, "needs", (self.needs,))
        object.__setattr__(self, "needs", tuple(self.needs))
        if not callable(self.run):
            raise TypeError(f"Method {self.name!r}: run must be callable (ctx) -> MethodOutput")


_REGISTRY: Dict[str, Method] = {}


def register(method: Method, *, replace: bool = False) -> Method:
    """Add a method to the suite (its name must be new unless ``replace``). Returns it."""
    if not isinstance(method, Method):
        raise TypeError(f"register() takes a tempokern.suite.Method, got {type(method).__name__}")
    if method.name in _REGISTRY and not replace and _REGISTRY[method.name] is not method:
        raise ValueError(f"a method named {method.name!r} is already registered")
    _REGISTRY[method.name] = method
    return method


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def registered() -> List[Method]:
    """The registered methods, in registration order."""
    return list(_REGISTRY.values())


def get_method(name: str) -> Method:
    if name not in _REGISTRY:
        raise ValueError(f"unknown method {name!r}; registered: {', '.join(_REGISTRY) or 'none'}")
    return _REGISTRY[name]


def missing_needs(method: Method) -> List[str]:
    """The modules of ``method.needs`` that cannot be imported here."""
    out = []
    for mod in method.needs:
        try:
            found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out.append(mod)
    return out


@dataclass(frozen=True)
class Budget:
    """The training budget every method of one suite run shares (so rows are comparable).

    ``max_train_rows``: training rows used (None: all); ``epochs``; ``max_length`` tokens per text;
    ``batch_size``; ``lr`` for fine-tuning the pretrained backbone; ``hard_negatives``: None = each
    method's own recipe (the synthetic suite), an int = every trained row uses exactly that many of each
    training row's hard negatives (the real-data sets: same data for every row)."""
    max_train_rows: Optional[int] = None
    epochs: int = 1
    max_length: int = 64
    batch_size: int = 32
    lr: float = 5e-5
    eval_batch_size: int = 128
    hard_negatives: Optional[int] = None

    @classmethod
    def quick(cls) -> "Budget":
        return cls(max_train_rows=300, epochs=1, max_length=48, batch_size=32, lr=5e-5)

    @classmethod
    def full(cls) -> "Budget":
        return cls(max_train_rows=640, epochs=1, max_length=64, batch_size=32, lr=5e-5)

    @classmethod
    def real(cls, quick: bool) -> "Budget":
        """The real-data budget (TimeQA, your folder): every training row, 1 hard negative per row (the
        same page's dated paragraph on TimeQA). Full: 2 epochs, batch 32, 128 tokens (95% of TimeQA's gold
        paragraphs state the question's year within 126 tokens, 77% within 62); quick (CI): 1 epoch,
        batch 16, 48 tokens."""
        if quick:
            return cls(max_train_rows=None, epochs=1, max_length=48, batch_size=16, lr=5e-5, eval_batch_size=64,
                       hard_negatives=1)
        return cls(max_train_rows=None, epochs=2, max_length=128, batch_size=32, lr=5e-5, eval_batch_size=64,
                   hard_negatives=1)


class SuiteContext:
    """What a method's ``run`` receives. Attributes:

    ``synth`` (SynthSet), ``dataset`` (= ``synth.dataset``), ``set_name``, ``backbone_path`` (a
    directory ``transformers.AutoModel/AutoTokenizer.from_pretrained`` load offline), ``seed``,
    ``quick`` (bool), ``budget`` (:class:`Budget`), ``work_dir`` (a Path per (method, set, seed) for
    checkpoints and resume; created), ``device`` (torch.device), ``eval_splits`` (the splits to return
    runs for: each split's queries, ``queries(split)``, ranked over its own gallery, ``gallery(split)``;
    the real-data sets add the extra splits ``fit`` and ``dev@corpus``), ``table_splits`` (those of the
    tables: all but ``fit``), ``depth`` (documents per query in a run, >= 100), ``log(msg)``, ``progress(iterable,
    desc)``, ``progress_enabled`` (bool, for trainers with their own bars)."""

    def __init__(self, *, synth, backbone_path: str, seed: int, quick: bool, work_dir, device=None,
                 eval_splits: Optional[Sequence[str]] = None, budget: Optional[Budget] = None, depth: int = 100,
                 log: Optional[Callable[[str], None]] = None, progress_enabled: bool = True,
                 method_name: str = ""):
        import torch
        self.synth = synth
        self.dataset = synth.dataset
        self.set_name = getattr(synth, "name", "?")
        self.backbone_path = backbone_path
        self.seed = int(seed)
        self.quick = bool(quick)
        self.budget = budget or (Budget.quick() if quick else Budget.full())
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        have = {q.split for q in self.dataset.queries}
        base_splits = [s for s in (eval_splits or getattr(synth, "eval_splits", None) or EVAL_SPLITS) if s in have]
        ids = getattr(synth, "gallery_ids", None)
        self._gallery = None if ids is None else [self.dataset.record(i) for i in ids]
        self._eval_dataset = None
        # the set's extra splits (real data): the fit split and the whole-corpus split (module doc)
        self._extra: Dict[str, dict] = {}
        extra_recs = {r.id: r for r in (getattr(synth, "extra_records", None) or ())}
        for name, spec in (getattr(synth, "extra_splits", None) or {}).items():
            qids = spec.get("query_ids")
            qset = None if qids is None else set(qids)
            qs = [replace(q, split=name) for q in self.dataset.queries_in(spec["queries"])
                  if qset is None or q.id in qset]
            gal = [self.dataset.record(i) if i in self.dataset else extra_recs[i] for i in spec["gallery_ids"]]
            self._extra[name] = {"queries": qs, "gallery": gal, "dataset": None}
        #: the splits a method returns runs for: the reported splits, then the extra ones
        self.eval_splits = base_splits + list(self._extra)
        #: the splits of the tables (every one of ``eval_splits`` but the fit split)
        self.table_splits = [s for s in self.eval_splits if s != FIT_SPLIT]
        self._all_gallery = None
        self._gallery_index: Dict[Optional[str], List[int]] = {}
        self.depth = max(100, int(depth))
        self.method_name = method_name
        self._log = log or (lambda m: print(m, file=sys.stderr, flush=True))
        self._progress_enabled = progress_enabled
        #: whether progress bars are wanted (for trainers with their own bars)
        self.progress_enabled = bool(progress_enabled)
        self._retention: Tuple[List[str], List[Tuple[int, int]]] = ([], [])

    # -- helpers -------------------------------------------------------------------------------------
    def log(self, msg: str) -> None:
        self._log(f"[{self.method_name}/{self.set_name}/seed {self.seed}] {msg}")

    def progress(self, iterable: Iterable, desc: str = ""):
        from ..training.trainer import _progress
        return _progress(iterable, self._progress_enabled, f"{self.method_name}/{self.set_name} {desc}".strip())

    def gallery(self, split: Optional[str] = None):
        """The records split ``split``'s queries are ranked over: every record of a synthetic set; the
        held-out pages' records of TimeQA (``synth.gallery_ids``); the extra splits' own galleries (the fit
        split's training pages, the whole corpus). ``split`` None: the gallery of the set's reported
        splits."""
        if split is not None and split in self._extra:
            return self._extra[split]["gallery"]
        return self.dataset.records if self._gallery is None else self._gallery

    def all_gallery(self):
        """Every record some split ranks over, each once (the main gallery first): encode these once and
        take each split's rows with :meth:`gallery_index`."""
        if self._all_gallery is None:
            seen, out = set(), []
            for recs in [self.gallery()] + [e["gallery"] for e in self._extra.values()]:
                for r in recs:
                    if r.id not in seen:
                        seen.add(r.id)
                        out.append(r)
            self._all_gallery = out
        return self._all_gallery

    def gallery_index(self, split: Optional[str] = None) -> List[int]:
        """Positions of ``gallery(split)``'s records in :meth:`all_gallery` (in ``gallery(split)``'s order)."""
        key = split if split in self._extra else None
        if key not in self._gallery_index:
            pos = {r.id: i for i, r in enumerate(self.all_gallery())}
            self._gallery_index[key] = [pos[r.id] for r in self.gallery(key)]
        return self._gallery_index[key]

    def eval_dataset(self, split: Optional[str] = None):
        """A RetrievalDataset of ``gallery(split)`` and the set's queries (for evaluators that rank over a
        dataset's records): ``dataset`` itself when the gallery is every record. For an extra split, its
        gallery and its queries, whose ``split`` is the extra split's name (``queries_in(split)`` finds
        them)."""
        if split is not None and split in self._extra:
            e = self._extra[split]
            if e["dataset"] is None:
                from ..datasets import RetrievalDataset
                e["dataset"] = RetrievalDataset(f"{self.dataset.name}[{split}]", e["gallery"], e["queries"],
                                                self.dataset.calendar)
            return e["dataset"]
        if self._gallery is None:
            return self.dataset
        if self._eval_dataset is None:
            from ..datasets import RetrievalDataset
            self._eval_dataset = RetrievalDataset(f"{self.dataset.name}[gallery]", self._gallery,
                                                  self.dataset.queries, self.dataset.calendar)
        return self._eval_dataset

    def rows_hard_negatives(self, recipe: int) -> int:
        """Hard negatives per training row for a method whose own recipe uses ``recipe``: the budget's
        ``hard_negatives`` when it sets one (every row the same), else ``recipe``."""
        return recipe if self.budget.hard_negatives is None else int(self.budget.hard_negatives)

    def queries(self, split: str):
        """The queries of ``split`` (an extra split's: relabelled with its name)."""
        if split in self._extra:
            return list(self._extra[split]["queries"])
        return self.dataset.queries_in(split)

    def train_rows(self):
        """The set's TrainRows, cut to ``budget.max_train_rows`` by a seeded shuffle (the same rows
        for every method of a run with this seed)."""
        rows = list(self.synth.train_rows)
        n = self.budget.max_train_rows
        if n is not None and len(rows) > n:
            rng = random.Random(1000003 * self.seed + 17)
            rows = rng.sample(rows, n)
        return rows

    def retention_pairs(self) -> List[Tuple[str, str]]:
        """The (time-stripped document, time-stripped document) pairs of the similarity-preservation
        proxy (design notes §4.3), fixed for the set (not the seed): a method that gives no ``embed``
        may return its cosine similarities on these as ``MethodOutput.pair_sims``."""
        texts, pairs = self._retention
        return [(texts[i], texts[j]) for i, j in pairs]


def topk_runs(scores, query_ids: Sequence[str], doc_ids: Sequence[str], k: int = 100) -> Dict[str, Dict[str, float]]:
    """``{qid: {doc_id: score}}`` of the top ``k`` documents per row of a (Q, G) score matrix
    (torch tensor or numpy array)."""
    import torch
    s = torch.as_tensor(scores).float()
    if s.dim() != 2 or s.shape[0] != len(query_ids) or s.shape[1] != len(doc_ids):
        raise ValueError(f"scores must be (len(query_ids), len(doc_ids)) = ({len(query_ids)}, {len(doc_ids)}), "
                         f"got {tuple(s.shape)}")
    k = min(int(k), len(doc_ids))
    vals, idx = s.topk(k, dim=1) if k > 0 else (s[:, :0], s[:, :0].long())
    out = {}
    for qi, qid in enumerate(query_ids):
        out[qid] = {doc_ids[j]: float(v) for j, v in zip(idx[qi].tolist(), vals[qi].tolist())}
    return out
