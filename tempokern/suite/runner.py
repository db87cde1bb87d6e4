"""The suite runner: every (method, set, seed) unit trained and evaluated on the same splits with the
same backbone, each unit's per-query metrics saved atomically as soon as it is done (with a
checksum; a rerun skips finished units and recomputes a corrupt or incomplete one), then
results.json / results.md / plots (tempokern.suite.report)."""
from __future__ import annotations

import hashlib
import importlib
import json
import math
import os
import platform
import pkgutil
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .metrics import METRICS, spearman, split_metrics, strip_spans
from .registry import (CORPUS_SUFFIX, EVAL_SPLITS, FIT_SPLIT, PERTURBED_SETS, REAL_SETS, SETS, SYNTH_SETS, Budget, Method,
                       MethodOutput, SuiteContext, missing_needs, registered, runs_on)
from .unitcheck import unit_problem
from .._util import atomic_write

__all__ = ["load_methods", "run_suite", "unit_path", "read_unit", "UNIT_VERSION", "QUICK_SETS", "DEFAULT_SEEDS",
           "retention_sample"]

UNIT_VERSION = 1
QUICK_SETS = SYNTH_SETS
#: the suites: their sets
SUITES = {"english": SYNTH_SETS + PERTURBED_SETS, "timeqa": ("timeqa",), "data": ("data",)}
DEFAULT_SEEDS = (0, 1, 2)
#: similarity-preservation proxy: pairs drawn among a fixed pool of documents
RETENTION = {"quick": (150, 1000), "full": (500, 5000)}   # (documents, pairs)


def load_methods() -> Tuple[List[Method], Dict[str, str]]:
    """Import every module of tempokern.suite.methods; returns (registered methods, import errors)."""
    from . import methods as pkg
    errors: Dict[str, str] = {}
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
        name = f"{pkg.__name__}.{info.name}"
        try:
            importlib.import_module(name)
        except Exception as e:  # reported in results.md, not skipped silently
            errors[name] = f"{type(e).__name__}: {e}"
    return registered(), errors


# ---- unit files --------------------------------------------------------------------------------------

def unit_path(out: Path, method: str, set_name: str, seed: int) -> Path:
    return Path(out) / "units" / set_name / method / f"seed{seed}.json"


def _checksum(payload: dict) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, allow_nan=True).encode()).hexdigest()


def _jsonable(x):
    if isinstance(x, np.ndarray):
        return [None if (isinstance(v, float) and math.isnan(v)) else v for v in x.tolist()]
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, float) and math.isnan(x):
        return None
    return x


def write_unit(path: Path, payload: dict) -> None:
    payload = _jsonable(payload)
    doc = {"version": UNIT_VERSION, "payload": payload, "sha256": _checksum(payload)}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(doc))


def read_unit(path: Path, config: Optional[dict] = None) -> Optional[dict]:
    """The unit's payload, or None when the file is missing, unreadable, of another version, its
    checksum does not match, or (with ``config``) it was made under other settings (budget, backbone,
    data size or data checksum): then it is recomputed."""
    try:
        doc = json.loads(Path(path).read_text())
        payload = doc["payload"]
        if doc.get("version") != UNIT_VERSION or doc.get("sha256") != _checksum(payload):
            return None
        if payload.get("status") != "done" or "splits" not in payload:
            return None
        if config is not None and payload.get("config") != _jsonable(config):
            return None
        return payload
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _arrays(split_payload: dict) -> dict:
    out = {"qids": split_payload["qids"]}
    for m in METRICS:
        if m in split_payload:
            out[m] = np.asarray([math.nan if v is None else v for v in split_payload[m]], dtype=np.float64)
    return out


# ---- the similarity-preservation proxy ----------------------------------------------------------------

def retention_sample(dataset, n_docs: int, n_pairs: int, seed: int = 12345):
    """(texts, pairs): ``n_docs`` random time-stripped gallery documents and ``n_pairs`` random
    index pairs (i != j) among them, fixed by ``seed``."""
    import random
    recs = dataset.records
    rng = random.Random(seed)
    pick = rng.sample(range(len(recs)), min(n_docs, len(recs)))
    texts = [strip_spans(recs[i].text, (recs[i].meta or {}).get("temporal_spans")) for i in pick]
    pairs = []
    if len(texts) >= 2:
        for _ in range(n_pairs):
            i, j = rng.sample(range(len(texts)), 2)
            pairs.append((i, j))
    return texts, pairs


def pair_similarities(embed, texts, pairs) -> List[float]:
    import torch
    import torch.nn.functional as F
    e = F.normalize(torch.as_tensor(embed(texts)).float(), dim=-1)
    a = torch.tensor([p[0] for p in pairs], dtype=torch.long)
    b = torch.tensor([p[1] for p in pairs], dtype=torch.long)
    return (e[a] * e[b]).sum(-1).tolist()


# ---- the run -------------------------------------------------------------------------------------------

def _log_default(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def machine() -> str:
    import torch
    cpu = platform.processor() or platform.system()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return (f"{platform.machine()} x{os.cpu_count()} ({cpu}){gpu}, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads")


def _load() -> Optional[float]:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _duration(seconds: float) -> str:
    """A duration a person plans by: "40 s", "23 min", "8.1 h"."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class _Progress:
    """The run's plan and where it stands: ``k/N`` on every unit line and an estimate of the time left. A unit's
    estimate is the mean of its method's units measured in this run; before one is, the committed full TimeQA
    run's mean for the method (unit_seconds.json; CPU runs of that suite only) scaled by how this run's measured
    units compare with theirs, else the mean of all units measured in this run."""

    def __init__(self, plan: List[Tuple[str, str, int]], committed: Optional[Dict[str, float]]):
        self.plan, self.total, self.k = plan, len(plan), 0
        self.committed = committed or {}
        self.measured: Dict[str, List[float]] = {}
        self.finished: set = set()

    def unit(self) -> str:
        self.k += 1
        return f"{self.k}/{self.total}"

    def record(self, key, seconds: Optional[float] = None) -> None:
        self.finished.add(key)
        if seconds is not None:
            self.measured.setdefault(key[0], []).append(seconds)

    def _estimate(self, method: str) -> Optional[float]:
        if method in self.measured:
            return float(np.mean(self.measured[method]))
        if method in self.committed:
            both = [m for m in self.measured if self.committed.get(m)]
            scale = (sum(float(np.mean(self.measured[m])) for m in both) / sum(self.committed[m] for m in both)
                     if both else 1.0)
            return self.committed[method] * scale
        return None     # a row not timed yet: a row's units can take seconds (BM25) or an hour (TMRL)

    def left(self) -> Tuple[float, int, int]:
        """(estimated seconds of the units left whose row is timed, how many those are, how many are not)."""
        est = [self._estimate(u[0]) for u in self.plan if u not in self.finished]
        known = [e for e in est if e is not None]
        return float(sum(known)), len(known), len(est) - len(known)

    def eta(self) -> str:
        secs, known, unknown = self.left()
        if known + unknown == 0:
            return "no unit left"
        if not unknown:
            return f"{known} unit(s) left, about {_duration(secs)}"
        return (f"{known + unknown} unit(s) left" + (f": about {_duration(secs)} for the {known} of timed rows"
                if known else "") + f"; {unknown} of rows not timed yet")


def _committed_unit_seconds(suite: str, quick: bool, dev) -> Optional[Dict[str, float]]:
    """The committed full TimeQA run's mean seconds per unit of each method, for a CPU run of that suite."""
    if suite != "timeqa" or quick or getattr(dev, "type", "cpu") != "cpu":
        return None
    try:
        return json.loads((Path(__file__).parent / "unit_seconds.json").read_text(encoding="utf-8"))["seconds"]
    except (OSError, ValueError, KeyError):
        return None


def _real_loader(suite: str, data_dir: Optional[str], eval_split: str, on_error: str, corpus: bool = True):
    from .realdata import beir_set, timeqa_set

    def load(name, seed=0, size="full"):
        if name == "timeqa":
            return timeqa_set(size, eval_split=eval_split, corpus=corpus)
        return beir_set(data_dir, on_error=on_error)
    return load


def run_suite(out, *, suite: str = "english", quick: bool = False, sets: Optional[Sequence[str]] = None,
              methods: Optional[Sequence[str]] = None, seeds: Optional[Sequence[int]] = None, device=None,
              progress: bool = True, backbone_path: Optional[str] = None,
              synth_loader: Optional[Callable] = None, budget: Optional[Budget] = None, n_resamples: int = 1000,
              log: Callable[[str], None] = _log_default, command: Optional[str] = None,
              plots: bool = True, data_dir: Optional[str] = None, eval_split: str = "dev",
              on_error: str = "raise", report_only: bool = False, corpus: Optional[bool] = None,
              save_runs: bool = False) -> dict:
    """Run the suite into ``out`` and return the results dict (also written as results.json).

    ``suite``: ``english`` (the synthetic sets A, B, C), ``timeqa`` (TimeQA, :mod:`tempokern.suite.realdata`;
    ``eval_split`` dev or test) or ``data`` (the BEIR folder ``data_dir``); ``sets``: some of the suite's
    sets (default all); ``methods``: registered names (default every method that runs on the sets);
    ``seeds`` (default 0, 1, 2; ``quick``: 0); ``synth_loader(name, seed=, size=)`` (default ``load_synth``
    or the real-data loader) and ``backbone_path`` (default ``minilm_path()``) are for tests. ``report_only``:
    run nothing; write the results of the units already finished in ``out`` (a run still under way, or one
    stopped part-way: each row then names the seeds it has). ``corpus``: rank the evaluation questions over
    the whole corpus too (the ``<split>@corpus`` table; default: on for a full TimeQA run, off otherwise).

    A unit is reused when it was made under the same settings and has what the run's rows need: a run split of
    every table split (``dev@corpus`` when ``corpus``) and the fitted time prior when the set has a fit split
    (:mod:`tempokern.suite.prior`); otherwise it is recomputed. ``report_only`` reports such units as they
    are and names the rows they cannot give (a ``+prior`` row of units made before the fit split, a row
    missing from the whole-corpus table). ``save_runs``: also write each computed unit's runs (every split,
    the fit split included) to ``out/runs/<set>/<method>/seed<k>.json.gz`` (for refitting or analysing the
    rankings later; not needed by the report)."""
    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r}: expected one of {', '.join(SUITES)}")
    if suite == "data" and not data_dir and synth_loader is None:
        raise ValueError("suite 'data' needs data_dir (a BEIR folder)")
    import torch
    t_start = time.time()
    load_start = _load()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    all_methods, import_errors = load_methods()
    by_name = {m.name: m for m in all_methods}
    if methods:
        unknown = [m for m in methods if m not in by_name]
        if unknown:
            raise ValueError(f"unknown method(s) {unknown}; registered: {', '.join(by_name)}")
        chosen = [by_name[m] for m in methods]
    else:
        chosen = list(all_methods)
    sets = list(sets) if sets else list(QUICK_SETS if suite == "english" and quick else SUITES[suite])
    bad = [s for s in sets if s not in SUITES[suite]]
    if bad:
        raise ValueError(f"unknown set(s) {bad} for suite {suite!r}: expected some of {', '.join(SUITES[suite])}")
    seeds = list(seeds) if seeds is not None else ([0] if quick else list(DEFAULT_SEEDS))
    if not seeds:
        raise ValueError("seeds must not be empty")
    real = suite != "english"
    budget = budget or (Budget.real(quick) if real else Budget.quick() if quick else Budget.full())
    off = [m.name for m in chosen if not any(runs_on(m, s) for s in sets)]
    if off and methods:
        raise ValueError(f"method(s) {off} do not run on set(s) {sets}")
    chosen = [m for m in chosen if any(runs_on(m, s) for s in sets)]
    dev = torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    size = "quick" if quick else "full"
    if corpus is None:
        corpus = suite == "timeqa" and not quick
    if synth_loader is None and real:
        synth_loader = _real_loader(suite, data_dir, eval_split, on_error, corpus)
    elif synth_loader is None:
        from ..datasets.synth import load_synth as synth_loader
    if backbone_path is None:
        from .backbone import backbone_path as _bp
        backbone_path = _bp()
    n_docs, n_pairs = RETENTION[size]

    status: Dict[str, dict] = {}
    for m in chosen:
        miss = missing_needs(m)
        reason = f"missing module(s): {', '.join(miss)}" if miss else None
        if reason is None and quick and not m.in_quick and not methods:
            reason = "not in --quick runs (name it with --methods to run it)"
        status[m.name] = {"family": m.family, "description": m.description, "sets": list(m.sets),
                          "seeded": m.seeded, "status": "pending" if reason is None else "skipped",
                          "reason": reason, "wall_seconds": {}, "errors": {},
                          "info": {}}
        if reason:
            log(f"[suite] {m.name}: skipped ({reason})")
    units: Dict[Tuple[str, str, int], dict] = {}
    set_info: Dict[str, dict] = {}
    prog = _plan(out, sets, seeds, chosen, status, quick, methods, report_only, suite, dev, log)
    interrupted = False
    for s in sets:
        if interrupted:
            break
        todo = [m for m in chosen if status[m.name]["status"] != "skipped"
                and (s in m.quick_sets if quick and m.quick_sets and not methods and s in SYNTH_SETS else runs_on(m, s))]
        if not todo:
            continue
        t = time.time()
        if s in PERTURBED_SETS:
            from ..datasets.synth.perturb import perturb, split_name
            base, kind = split_name(s)
            synth = perturb(synth_loader(base, seed=0, size=size), kind)
        else:
            synth = synth_loader(s, seed=0, size=size)
        ds = synth.dataset
        if not corpus and getattr(synth, "extra_splits", None):
            synth.extra_splits = {k: v for k, v in synth.extra_splits.items() if not k.endswith(CORPUS_SUFFIX)}
        extra = dict(getattr(synth, "extra_splits", None) or {})
        have_q = {q.split for q in ds.queries}
        # what a unit of this set must hold to be reused (beside its settings)
        need_splits = [sp for sp in (getattr(synth, "eval_splits", None) or EVAL_SPLITS) if sp in have_q]
        need_splits += [sp for sp in extra if sp != FIT_SPLIT]
        need_prior = FIT_SPLIT in extra
        splits = sorted({q.split for q in ds.queries if q.split is not None})
        set_info[s] = {"records": len(ds.records), "queries": {sp: sum(q.split == sp for q in ds.queries) for sp in splits},
                       "gallery": len(getattr(synth, "gallery_ids", None) or ds.records),
                       "eval_splits": list(getattr(synth, "eval_splits", None) or []),
                       "train_rows": len(synth.train_rows), "info": _jsonable(dict(getattr(synth, "info", {}) or {})),
                       "extra_splits": {k: {"queries": v["queries"], "n_queries": len(v["query_ids"]) if v.get(
                           "query_ids") is not None else sum(q.split == v["queries"] for q in ds.queries),
                                            "gallery": len(v["gallery_ids"])} for k, v in extra.items()},
                       "load_seconds": round(time.time() - t, 2)}
        rep = getattr(ds, "report", None)
        if rep is not None and getattr(rep, "truncated", 0):
            set_info[s]["truncated"] = rep.truncated
            log(f"[suite] set {s}: {rep.truncation_note()}")
        if rep is not None and rep.num_skipped:   # --on-error skip: every skipped row, on stderr and in results.json
            set_info[s]["skipped"] = [f"{p}:{ln}: {why}" for p, ln, why in rep.skipped]
            log(f"[suite] set {s}: skipped {rep.num_skipped} malformed row(s) (--on-error skip):\n"
                + "\n".join("  " + x for x in set_info[s]["skipped"]))
        r_texts, r_pairs = retention_sample(ds, n_docs, n_pairs)
        # a unit is reused only when made under the same settings
        config = {"budget": dict(budget.__dict__), "backbone": str(backbone_path), "size": size,
                  "data": (getattr(synth, "info", None) or {}).get("checksum")}
        ref_sims = None
        # seed by seed (every method's seed 0 first), so that a run stopped part-way has whole seeds
        plan = [(m, seed) for seed in seeds for m in todo if m.seeded or seed == seeds[0]]
        for m, seed in plan:
            seed = seed if m.seeded else 0
            path = unit_path(out, m.name, s, seed)
            prev = read_unit(path, config)
            unfit = unit_problem(prev, ds, getattr(synth, "extra_splits", None)) if prev is not None else None
            if unfit is not None:   # named here and recomputed (not a failure later, while merging)
                log(f"[suite] {m.name} / set {s} / seed {seed}: unit file {path} does not fit the data ({unfit}): "
                    "recomputing")
                prev = None
            k = prog.unit()
            lacks = _lacks(prev, need_splits, need_prior) if prev is not None else []
            if prev is not None and (not lacks or report_only):
                log(f"[suite] {k} {m.name} / set {s} / seed {seed}: done earlier ({path}), skipped"
                    + (f" (it lacks {', '.join(lacks)}: reported as it is)" if lacks else ""))
                units[(m.name, s, seed)] = prev
                prog.record((m.name, s, seed))
                continue
            if prev is not None:
                log(f"[suite] {m.name} / set {s} / seed {seed}: unit {path} lacks {', '.join(lacks)}: recomputing")
            if report_only:
                log(f"[suite] {k} {m.name} / set {s} / seed {seed}: not finished, left out (--report-only)")
                continue
            if path.exists() and prev is None and unfit is None:
                log(f"[suite] {m.name} / set {s} / seed {seed}: unit file {path} is corrupt, incomplete or "
                    "made under other settings (budget, backbone, data): recomputing")
            if ref_sims is None and r_pairs:
                ref_sims = _reference_sims(out, s, backbone_path, budget, dev, r_texts, r_pairs, log)
            log(f"[suite] {k} {m.name} / set {s} / seed {seed}: running ({prog.eta()})")
            ctx = SuiteContext(synth=synth, backbone_path=backbone_path, seed=seed, quick=quick,
                               work_dir=out / "work" / s / m.name / f"seed{seed}", device=dev, budget=budget,
                               log=log, progress_enabled=progress, method_name=m.name)
            ctx._retention = (r_texts, r_pairs)
            t0 = time.time()
            try:
                torch.manual_seed(seed)
                res = m.run(ctx)
                if not isinstance(res, MethodOutput):
                    raise TypeError(f"{m.name}.run returned {type(res).__name__}, expected MethodOutput")
                res.validate(ctx.eval_splits, m.name)
                payload = _evaluate(m, s, seed, ctx, res, r_texts, r_pairs, ref_sims)
            except KeyboardInterrupt:   # Ctrl-C: the finished units stay; the report below is written from them
                interrupted = True
                log(f"[suite] {k} {m.name} / set {s} / seed {seed}: interrupted after {time.time() - t0:.0f} s")
                break
            except Exception as e:
                msg = f"{type(e).__name__}: {e}"
                prog.record((m.name, s, seed))
                log(f"[suite] {k} {m.name} / set {s} / seed {seed}: FAILED: {msg}")
                if os.environ.get("TEMPOKERN_DEBUG"):
                    traceback.print_exc()
                status[m.name]["errors"][f"{s}/seed{seed}"] = msg
                continue
            payload["wall_seconds"] = round(time.time() - t0, 2)
            payload["config"] = config
            if save_runs:
                _save_runs(out / "runs" / s / m.name / f"seed{seed}.json.gz", res.runs)
            write_unit(path, payload)
            units[(m.name, s, seed)] = read_unit(path, config) or _jsonable(payload)
            prog.record((m.name, s, seed), payload["wall_seconds"])
            log(f"[suite] {k} {m.name} / set {s} / seed {seed}: done in {payload['wall_seconds']:.0f} s "
                + ", ".join(f"{sp} R@1 {np.nanmean(_arrays(payload['splits'][sp])['R@1']):.3f}"
                            for sp in payload["splits"]) + f" ({prog.eta()})")
    for m in chosen:
        st = status[m.name]
        if st["status"] == "skipped":
            continue
        done = [k for k in units if k[0] == m.name]
        st["status"] = ("done" if done and not st["errors"] else ("partial" if done else
                        "pending" if (report_only or interrupted) and not st["errors"] else "failed"))
        for (name, s, seed) in done:
            st["wall_seconds"][f"{s}/seed{seed}"] = units[(name, s, seed)].get("wall_seconds")
            st["info"][f"{s}/seed{seed}"] = units[(name, s, seed)].get("info")   # training diagnostics
    from .prior import derive_prior_rows
    from .report import build_results, write_report
    fit_sets = [s for s, i in set_info.items() if FIT_SPLIT in (i.get("extra_splits") or {})]
    derived, d_status, prior_summary = derive_prior_rows(units, status, fit_sets)
    units = {**units, **derived}
    status = {**status, **d_status}
    setup = {"suite": suite, "quick": quick, "report_only": report_only,
             "data_dir": str(data_dir) if data_dir else None, "sets": sets, "seeds": seeds, "budget": budget.__dict__,
             "backbone": str(backbone_path), "device": str(dev), "machine": machine(),
             "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": command,
             "load_average_1min": {"start": load_start, "end": _load()},
             "retention": {"documents": n_docs, "pairs": n_pairs}, "bootstrap_resamples": n_resamples,
             "import_errors": import_errors, "set_info": set_info}
    results = build_results(units, status, setup, n_resamples=n_resamples)
    results["prior"] = prior_summary
    results["setup"]["seconds"] = round(time.time() - t_start, 1)
    write_report(results, out, plots=plots)
    if interrupted:
        log(f"[suite] stopped: {len(units)} of {prog.total} unit(s) finished, results.md written from them; "
            f"{prog.eta()}. To resume, run the same command again"
            + (f": {command}" if command and command.strip() != "tempokern" else "")
            + " (finished units are kept; the interrupted one continues from its last checkpoint under "
              f"{out / 'work'}, where its method keeps one)")
        raise KeyboardInterrupt
    return results


def _plan(out: Path, sets, seeds, chosen, status, quick: bool, methods, report_only: bool, suite: str, dev,
          log) -> "_Progress":
    """The run's units in order (the same order and selection as the loop of run_suite) and the plan line."""
    plan = []
    for s in sets:
        todo = [m for m in chosen if status[m.name]["status"] != "skipped"
                and (s in m.quick_sets if quick and m.quick_sets and not methods and s in SYNTH_SETS else runs_on(m, s))]
        plan += [(m.name, s, seed if m.seeded else 0) for seed in seeds for m in todo if m.seeded or seed == seeds[0]]
    prog = _Progress(plan, _committed_unit_seconds(suite, quick, dev))
    if report_only:
        return prog
    earlier = [u for u in plan if read_unit(unit_path(out, *u)) is not None]
    secs, known, unknown = _Progress([u for u in plan if u not in earlier], prog.committed).left()
    log(f"[suite] plan: {len(plan)} unit(s) ({len({u[0] for u in plan})} row(s), sets {', '.join(sets)}, seeds "
        f"{', '.join(map(str, seeds))}); {len(earlier)} done earlier in {out}; "
        + (f"estimate for the rest: about {_duration(secs)} (the committed run's unit times on 2 CPU cores; each "
           "unit line updates it)" if known and not unknown else
           "each unit line estimates the time left from the rows timed so far"))
    return prog


def _reference_sims(out: Path, s: str, backbone_path: str, budget: Budget, dev, texts, pairs, log):
    """The zero-shot backbone's cosine similarities on the retention pairs (cached per set)."""
    path = out / "units" / s / "_retention_reference.json"
    key = _checksum({"texts": texts, "pairs": pairs, "backbone": str(backbone_path), "max_length": budget.max_length})
    try:
        doc = json.loads(path.read_text())
        if doc.get("key") == key and len(doc.get("sims", ())) == len(pairs):
            return doc["sims"]
    except (OSError, ValueError):
        pass
    from .backbone import encode_texts, load_backbone
    model, tok = load_backbone(backbone_path, dev)
    sims = pair_similarities(lambda t: encode_texts(model, tok, list(t), max_length=budget.max_length,
                                                    batch_size=budget.eval_batch_size, device=dev), texts, pairs)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps({"key": key, "sims": sims}))
    log(f"[suite] set {s}: zero-shot similarities of {len(pairs)} retention pairs computed")
    return sims


def _save_runs(path: Path, runs) -> None:
    import gzip
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, gzip.compress(json.dumps(_jsonable(runs)).encode("utf-8")))


def _lacks(payload: dict, need_splits: Sequence[str], need_prior: bool) -> List[str]:
    """What a unit lacks for this run's rows: table splits, the fitted time prior."""
    out = [f"split {sp}" for sp in need_splits if sp not in payload.get("splits", {})]
    if need_prior and not payload.get("prior"):
        out.append("the fitted time prior (fit split)")
    elif need_prior:
        from .prior import prior_definition
        if payload["prior"].get("definition") != prior_definition():
            out.append("a time prior fitted under the current settings")
    return out


def _evaluate(m: Method, s: str, seed: int, ctx: SuiteContext, res: MethodOutput, r_texts, r_pairs, ref_sims) -> dict:
    from .prior import prior_payload

    def ds(sp):   # an extra split's queries and gallery live in its own dataset
        return ctx.eval_dataset(sp) if sp in ctx._extra else ctx.dataset
    splits = {sp: split_metrics(res.runs[sp], ds(sp), sp) for sp in ctx.table_splits}
    dims = {}
    for dim, runs in (res.dim_runs or {}).items():
        dims[int(dim)] = {sp: split_metrics(runs[sp], ds(sp), sp) for sp in ctx.table_splits}
    sims = None
    if res.pair_sims is not None:
        sims = [float(x) for x in res.pair_sims]
        if len(sims) != len(r_pairs):
            raise ValueError(f"{m.name}: pair_sims has {len(sims)} values for {len(r_pairs)} retention pairs")
    elif res.embed is not None and r_pairs:
        sims = pair_similarities(res.embed, r_texts, r_pairs)
    retention = None
    if sims is not None and ref_sims is not None:
        retention = spearman(ref_sims, sims)
    info = {k: v for k, v in (res.info or {}).items() if k != "metrics"}
    extra = (res.info or {}).get("metrics") or {}
    prior = prior_payload(ctx, res.runs, split_metrics)
    out = {"status": "done", "method": m.name, "set": s, "seed": seed, "splits": splits, "dims": dims,
           "retention_spearman": retention, "info": info, "extra_metrics": extra}
    if prior is not None:
        out["prior"] = prior
    return out
