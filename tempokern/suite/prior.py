"""The time-prior rows of the real-data suites: every row with :class:`tempokern.rerank.TimePrior` on top.

A row ``<method>+prior`` is derived from ``<method>``'s unit, with no extra training:

* when the unit is computed, the method's run of the ``fit`` split (training questions over a training
  gallery shaped like the evaluation gallery, :mod:`tempokern.suite.realdata`) fits the prior's weight ``c``
  for each match of :data:`tempokern.rerank.time_prior.MATCHES`, and the prior with that ``c`` reranks the
  method's run of every table split (``dev``, ``dev@corpus``); the unit keeps, per match, ``c``, the fit
  objective and the reranked runs' per-query metrics (``payload["prior"]``; every metric for the match with
  the best fit-split nDCG@10, :data:`SUMMARY_METRICS` for the others), not the runs;
* at report time, :func:`derive_prior_rows` adds the row ``<method>+prior``, whose match is the one with the
  best fit-split nDCG@10 (chosen without looking at the evaluation queries); every match's numbers stay in
  results.json (``prior[set][method]``) and in the time-prior table of results.md.

A trained row's fit-split run ranks the questions it was trained on: its fitted ``c`` is conservative (the
trained scores already separate those questions' gold, so the prior has less to add there than on dev).
Units made before the fit split have no ``payload["prior"]``: their ``+prior`` rows are reported as
unavailable (``--report-only``) and a run recomputes them.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from .registry import FIT_SPLIT, REAL_SETS

__all__ = ["prior_payload", "derive_prior_rows", "prior_baseline", "prior_definition", "PRIOR_SUFFIX",
           "UNTRAINED_BASES"]

PRIOR_SUFFIX = "+prior"
#: rows whose fit-split run is not biased by training on its questions: the candidates for the prior baseline
#: column of the paired tables
UNTRAINED_BASES = ("minilm_zeroshot", "bm25_ties_last")
#: the per-query metrics a unit keeps for a match the row did not choose
SUMMARY_METRICS = ("R@1", "MRR@10", "nDCG@10")


def prior_definition() -> dict:
    """The suite's prior settings, kept in each unit: a unit whose prior was fitted under other settings is
    recomputed (the runner compares them)."""
    from ..rerank.time_prior import GRID_MULTIPLIERS, MATCHES, TimePrior
    tp = TimePrior()
    return {"matches": list(MATCHES), "relation": tp.relation, "granularity": tp.granularity,
            "grid_multipliers": list(GRID_MULTIPLIERS), "kde": [tp.kde_topk, tp.kde_sigma, tp.kde_unit],
            "objective": "nDCG@10"}


def prior_payload(ctx, runs, split_metrics) -> Optional[dict]:
    """``{"fit_queries", "fit_gallery", "chosen", "matches": {match: {"c", "fit", "splits": {split:
    per-query metrics}}}}`` for a method's ``runs`` on ``ctx`` (None when the set has no fit split)."""
    from ..rerank.time_prior import MATCHES, TimePrior
    if FIT_SPLIT not in runs or FIT_SPLIT not in ctx.eval_splits:
        return None
    fit_q = ctx.queries(FIT_SPLIT)
    fit_docs = ctx.gallery(FIT_SPLIT)
    out = {"fit_queries": len(fit_q), "fit_gallery": len(fit_docs), "matches": {}, "definition": prior_definition()}
    best: Tuple[float, str] = (-1.0, MATCHES[0])
    for match in MATCHES:
        tp = TimePrior(match).fit(runs[FIT_SPLIT], fit_q, fit_docs)
        rep = tp.fit_report
        splits = {}
        for sp in ctx.table_splits:
            ds = ctx.eval_dataset(sp) if sp in ctx._extra else ctx.dataset
            rr = tp.rerank(runs[sp], ctx.queries(sp), ctx.gallery(sp))
            splits[sp] = split_metrics(rr, ds, sp)
        out["matches"][match] = {"c": tp.c, "fit": {"nDCG@10": rep["objective_best"], "nDCG@10_c0": rep["objective_c0"],
                                                    "scale": rep["scale"], "queries": rep["queries"]},
                                 "splits": splits}
        if rep["objective_best"] > best[0] + 1e-12:
            best = (rep["objective_best"], match)
    out["chosen"] = best[1]
    # the other matches keep the summary metrics only (the unit stays small; the row uses the chosen one)
    for m, v in out["matches"].items():
        if m != best[1]:
            v["splits"] = {sp: {k: x[k] for k in ("qids",) + SUMMARY_METRICS if k in x} for sp, x in v["splits"].items()}
    return out


def derive_prior_rows(units: Dict[Tuple[str, str, int], dict], status: Dict[str, dict],
                      fit_sets: Optional[Sequence[str]] = None
                      ) -> Tuple[Dict[Tuple[str, str, int], dict], Dict[str, dict], dict]:
    """(derived units, their status entries, ``{set: {method: summary}}``) of the ``+prior`` rows from the
    base units that carry ``payload["prior"]``, on the sets of ``fit_sets`` (those with a fit split; None: every
    set a unit with a prior is on). A base row with units there but none with a prior gets a status entry
    ``unavailable`` (its units were made before the fit split)."""
    derived: Dict[Tuple[str, str, int], dict] = {}
    st: Dict[str, dict] = {}
    summary: Dict[str, Dict[str, dict]] = {}
    if fit_sets is None:
        fit_sets = {k[1] for k, u in units.items() if u.get("prior")}
    fit_sets = set(fit_sets)
    for name in list(status):
        base = status[name]
        keys = sorted(k for k in units if k[0] == name and k[1] in fit_sets)
        if not keys or base.get("family") == "prior":
            continue
        row = name + PRIOR_SUFFIX
        with_prior = [k for k in keys if units[k].get("prior")]
        if not with_prior:
            st[row] = {"family": "prior", "description": f"`{name}` + the time prior",
                       "sets": [x for x in base.get("sets", []) if x in REAL_SETS],
                       "seeded": base.get("seeded", True), "status": "unavailable",
                       "reason": "its units were made before the fit split (no fitted prior): rerun without "
                                 "--report-only to compute them", "wall_seconds": {}, "errors": {}, "info": {}}
            continue
        chosen_by_unit, cs = {}, {}
        for k in with_prior:
            p = units[k]["prior"]
            m = p["chosen"]
            chosen_by_unit[k] = m
            cs.setdefault(m, []).append(p["matches"][m]["c"])
            derived[(row, k[1], k[2])] = {"status": "done", "method": row, "set": k[1], "seed": k[2],
                                          "splits": p["matches"][m]["splits"], "dims": {},
                                          "retention_spearman": units[k].get("retention_spearman"),
                                          "info": {"match": m, "c": p["matches"][m]["c"]},
                                          "extra_metrics": {}, "wall_seconds": 0.0}
            s = summary.setdefault(k[1], {}).setdefault(name, {"seeds": {}})
            s["seeds"][str(k[2])] = {"chosen": m, "fit_queries": p.get("fit_queries"),
                                     "fit_gallery": p.get("fit_gallery"),
                                     "matches": {mm: {"c": v["c"], "fit": v["fit"],
                                                      "means": {sp: _means(v["splits"][sp]) for sp in v["splits"]}}
                                                 for mm, v in p["matches"].items()}}
        desc = "; ".join(f"match {m}, c {', '.join(f'{c:.3g}' for c in v)}" for m, v in cs.items())
        missing = [f"{k[1]}/seed{k[2]}" for k in keys if k not in chosen_by_unit]
        st[row] = {"family": "prior", "sets": [x for x in base.get("sets", []) if x in REAL_SETS], "seeded": base.get("seeded", True),
                   "description": f"`{name}` reranked by the time prior fitted on the fit split ({desc}; "
                                  "match chosen on the fit split)", "status": "done",
                   "reason": (f"units without a fitted prior: {', '.join(missing)}" if missing else None),
                   "wall_seconds": {f"{k[1]}/seed{k[2]}": 0.0 for k in with_prior}, "errors": {},
                   "info": {f"{k[1]}/seed{k[2]}": {"match": chosen_by_unit[k],
                                                   "c": units[k]["prior"]["matches"][chosen_by_unit[k]]["c"]}
                            for k in with_prior}}
    return derived, st, summary


def _means(split_payload: dict) -> dict:
    out = {}
    for m in SUMMARY_METRICS:
        v = [x for x in split_payload.get(m, []) if x is not None]
        if v:
            out[m] = sum(v) / len(v)
    return out


def prior_baseline(units: Dict[Tuple[str, str, int], dict], set_name: str) -> Optional[str]:
    """The ``+prior`` row every row is paired against on ``set_name``: among the untrained bases
    (:data:`UNTRAINED_BASES`, whose fit-split runs are not biased by training), the one whose prior reaches the
    best fit-split nDCG@10 (never the evaluation queries). None when neither has a fitted prior."""
    best: Optional[Tuple[float, str]] = None
    for name in UNTRAINED_BASES:
        vals: List[float] = []
        for k, u in units.items():
            if k[0] == name and k[1] == set_name and u.get("prior"):
                p = u["prior"]
                vals.append(p["matches"][p["chosen"]]["fit"]["nDCG@10"])
        if vals:
            v = sum(vals) / len(vals)
            if best is None or v > best[0]:
                best = (v, name + PRIOR_SUFFIX)
    return None if best is None else best[1]
