"""RecencyFilter (Re³ Eq. 14 with B9/B11/B12/B13), its extractors and the filter metrics (design notes §3.7)."""
import datetime as dt
import json
import random
import warnings

import pytest

from tempokern.eval.recency import (apply_recency, compare_evidence, count_tokens, evidence_lists, filtered_run,
                                    recency_metrics, version_truth)
from tempokern.rerank import (Candidate, Extraction, Fact, LLMExtractor, MetadataExtractor, RecencyFilter,
                              RuleExtractor, build_prompt, date_parts, default_equal, find_dates, normalize_text,
                              parse_facts_json, parse_number)

D = dt.date


def cand(i, value, pub, head="Seattle", rel="high on 2014-03-05", score=1.0, text=None):
    facts = [] if value is ... else [{"head": head, "relation": rel, "value": value}]
    return Candidate(i, text or f"document {i}", pub, score, {"facts": facts})


def run(cands, policy="conflict", mode="filter", w=1.0):
    return RecencyFilter(MetadataExtractor(), policy=policy, mode=mode, recency_weight=w)("q", cands)


def ids(cs):
    return [c.id for c in cs]


# ---- the §3.7 cases -------------------------------------------------------------------------------------

def test_single_document_group_is_kept_with_plus_one():
    r = run([cand("a", "12 C", D(2014, 3, 1)), cand("b", "7", D(2014, 3, 2), head="Portland")])
    assert r.votes == {"a": 1, "b": 1} and ids(r.kept) == ["a", "b"] and r.removed == [] and r.ok
    assert {g["status"] for g in r.groups.values()} == {"single"}


def test_null_values_vote_zero_and_are_kept():
    r = run([cand("a", None, D(2014, 3, 5)), cand("b", "NULL", D(2014, 3, 6)), cand("c", "12", D(2014, 3, 1)),
             cand("d", ..., D(2014, 3, 9))])
    assert r.votes == {"a": 0, "b": 0, "c": 1, "d": 0} and ids(r.kept) == ["a", "b", "c", "d"]


def test_same_value_older_is_kept_and_different_value_older_is_removed():
    r = run([cand("old_same", "12.0 °C", D(2014, 3, 3)), cand("new", "12 C", D(2014, 3, 5)),
             cand("old_diff", "11 C", D(2014, 3, 4))])
    assert r.votes == {"old_same": 1, "new": 1, "old_diff": -1}
    assert ids(r.kept) == ["old_same", "new"] and ids(r.removed) == ["old_diff"]
    g = next(iter(r.groups.values()))
    assert g["winner"] == "12 C" and g["latest"] == "2014-03-05" and g["status"] == "ok"


def test_tie_on_latest_date_with_different_values_removes_nobody():
    cs = [cand("a", "12", D(2014, 3, 5)), cand("b", "13", D(2014, 3, 5)), cand("c", "9", D(2014, 3, 1))]
    r = run(cs)
    assert r.removed == [] and set(r.votes.values()) == {0}
    assert next(iter(r.groups.values()))["status"] == "tie" and any("B9" in x for x in r.reasons)
    # a tie that agrees is no tie: the older different value goes
    r = run([cand("a", "12", D(2014, 3, 5)), cand("b", "12.0", D(2014, 3, 5)), cand("c", "9", D(2014, 3, 1))])
    assert r.votes == {"a": 1, "b": 1, "c": -1}


def test_missing_publication_date_is_the_oldest_with_a_warning():
    cs = [cand("undated", "12", None), cand("dated", "13", D(2000, 1, 1))]
    with pytest.warns(RuntimeWarning, match="without a publication date"):
        r = run(cs)
    assert r.votes == {"undated": -1, "dated": 1} and any("oldest" in x for x in r.reasons)
    # every member undated and disagreeing: a tie at "the oldest" (B9), nobody removed
    with pytest.warns(RuntimeWarning):
        r = run([cand("a", "12", None), cand("b", "13", None)])
    assert r.removed == []
    # an undated document alone in its group: no warning (its date decides nothing)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = run([cand("a", "12", None)])
    assert r.votes == {"a": 1}


def test_two_heads_are_independent_groups():
    cs = [cand("s_old", "10", D(2014, 3, 1)), cand("p_new", "20", D(2014, 3, 9), head="Portland"),
          cand("s_new", "11", D(2014, 3, 2)), cand("p_old", "21", D(2014, 3, 3), head="Portland")]
    r = run(cs)
    assert r.votes == {"s_old": -1, "p_new": 1, "s_new": 1, "p_old": -1} and len(r.groups) == 2
    # head and relation match after normalisation (case, whitespace)
    r = run([cand("a", "1", D(2014, 1, 1), head="  seattle "), cand("b", "2", D(2014, 1, 2), rel="HIGH  on 2014-03-05")])
    assert len(r.groups) == 1 and r.votes == {"a": -1, "b": 1}


def test_survivors_keep_their_order():
    rng = random.Random(0)
    cs = [cand(f"d{i}", str(rng.randint(0, 2)), D(2014, 1, 1) + dt.timedelta(days=rng.randint(0, 30)),
               score=rng.random()) for i in range(12)]
    r = run(cs)
    assert ids(r.kept) == [c.id for c in cs if r.votes[c.id] >= 0]
    assert ids(r.removed) == [c.id for c in cs if r.votes[c.id] < 0]
    assert [c.score for c in r.kept] == [c.score for c in cs if r.votes[c.id] >= 0]


def test_latest_only_keeps_one_per_group():
    cs = [cand("a", "12", D(2014, 3, 3)), cand("b", "12", D(2014, 3, 5)), cand("c", "11", D(2014, 3, 4)),
          cand("p", "5", D(2014, 3, 1), head="Portland"), cand("p2", "5", D(2014, 3, 2), head="Portland")]
    conflict = run(cs)
    assert ids(conflict.kept) == ["a", "b", "p", "p2"]
    r = run(cs, policy="latest_only")
    assert ids(r.kept) == ["b", "p2"] and r.votes == {"a": -1, "b": 1, "c": -1, "p": -1, "p2": 1}
    # B13's NOAA case: 48 vs 49 one day apart, both kept by the paper's policy, only the latest by latest_only
    cs = [cand("v1", "48 °F", D(2020, 5, 1)), cand("v2", "49 °F", D(2020, 5, 2))]
    assert ids(run(cs).kept) == ["v2"] and ids(run(cs, policy="latest_only").kept) == ["v2"]
    cs = [cand("v1", "49 °F", D(2020, 5, 1)), cand("v2", "49 F", D(2020, 5, 2))]
    assert ids(run(cs).kept) == ["v1", "v2"] and ids(run(cs, policy="latest_only").kept) == ["v2"]


def test_rerank_mode_adds_weighted_votes_and_removes_nothing():
    cs = [cand("old", "11", D(2014, 3, 4), score=0.9), cand("null", None, D(2014, 3, 9), score=0.5),
          cand("new", "12", D(2014, 3, 5), score=0.4)]
    r = run(cs, mode="rerank", w=0.3)
    assert r.removed == [] and r.votes == {"old": -1, "null": 0, "new": 1}
    new = {c.id: c.score for c in r.kept}
    assert new == pytest.approx({"old": 0.9 - 0.3, "null": 0.5, "new": 0.4 + 0.3})
    assert ids(r.kept) == ["new", "old", "null"]          # sorted by the new score
    r0 = run(cs, mode="rerank", w=0.0)
    assert ids(r0.kept) == ["old", "null", "new"] and [c.score for c in r0.kept] == [0.9, 0.5, 0.4]


class Boom:
    def __call__(self, query, docs):
        raise RuntimeError("model offline")


@pytest.mark.parametrize("extractor, why", [
    (Boom(), "raised RuntimeError: model offline"),
    (lambda q, d: "not a list", "malformed"),
    (lambda q, d: [Fact(7, "h", "r", "v")], "doc_index 7"),
    (lambda q, d: [{"doc_index": 0}], "not a Fact"),
    (lambda q, d: [Fact(0, "h", "r", 3.5)], "value is float"),
    (LLMExtractor(lambda p: "I cannot answer that."), "no JSON"),
    (LLMExtractor(lambda p: '[{"doc_index": 0, "head": "a", '), "no complete item"),
    (MetadataExtractor(), "must be a list"),
])
def test_extractor_failure_removes_nothing_and_records_why(extractor, why):
    cs = [cand("a", "1", D(2014, 1, 1)), cand("b", "2", D(2014, 1, 2))]
    if isinstance(extractor, MetadataExtractor):
        cs[0] = Candidate("a", "x", D(2014, 1, 1), 1.0, {"facts": "oops"})
    for mode in ("filter", "rerank"):
        r = RecencyFilter(extractor, mode=mode)("q", cs)
        assert not r.ok and r.removed == [] and ids(r.kept) == ["a", "b"] and set(r.votes.values()) == {0}
        assert any(why in x for x in r.reasons), r.reasons
        assert [c.score for c in r.kept] == [1.0, 1.0]


# ---- Eq. 14 against a literal transcription, random instances ---------------------------------------------

def eq14_reference(facts, pubs, policy):
    """Literal: group by (head, relation); v* = value of the latest d_pub (undated = oldest); tie with
    different values -> nobody -1; s_rec +1 supports v*, -1 other value, 0 otherwise; a document with
    several groups: -1 if any, else +1 if any, else 0. latest_only: older members -1."""
    votes = {i: [] for i in range(len(pubs))}
    groups = {}
    for i, h, r, v in facts:
        if v is not None:
            groups.setdefault((h.lower(), r.lower()), []).append((i, v))
    for mem in groups.values():
        p = {i: pubs[i] or D.min for i, _ in mem}
        last = max(p.values())
        tops = {float(v) for i, v in mem if p[i] == last}
        for i, v in mem:
            if policy == "latest_only":
                votes[i].append(-1 if p[i] < last else (1 if len(tops) == 1 else 0))
            elif len(tops) > 1:
                votes[i].append(0)
            else:
                votes[i].append(1 if float(v) in tops else -1)
    return {i: (-1 if -1 in vs else 1 if 1 in vs else 0) for i, vs in votes.items()}


@pytest.mark.parametrize("policy", ["conflict", "latest_only"])
def test_eq14_matches_literal_transcription_on_random_instances(policy):
    rng = random.Random(1)
    for trial in range(300):
        n = rng.randint(1, 8)
        pubs = [None if rng.random() < 0.1 else D(2020, 1, 1) + dt.timedelta(days=rng.randint(0, 4)) for _ in range(n)]
        facts = []
        for i in range(n):
            for _ in range(rng.choice([0, 1, 1, 1, 2])):
                facts.append((i, rng.choice(["A", "B"]), rng.choice(["r", "s"]),
                              None if rng.random() < 0.15 else str(rng.randint(0, 2))))
        cs = [Candidate(f"d{i}", "t", pubs[i], 0.0, {"facts": [{"head": h, "relation": r, "value": v}
                                                              for j, h, r, v in facts if j == i]}) for i in range(n)]
        dedup, seen = [], set()        # the filter keeps one value per candidate and group (the first)
        for i, h, r, v in facts:
            if v is not None and (i, h, r) in seen:
                continue
            if v is not None:
                seen.add((i, h, r))
            dedup.append((i, h, r, v))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = RecencyFilter(MetadataExtractor(), policy=policy)("q", cs)
        ref = eq14_reference(dedup, pubs, policy)
        assert res.votes == {f"d{i}": ref[i] for i in range(n)}, (trial, facts, pubs)
        assert ids(res.kept) == [f"d{i}" for i in range(n) if ref[i] >= 0]


# ---- values (B11) ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("a, b, eq", [
    ("Rain", " rain ", True), ("New  York", "new york", True), ("cafe\u0301", "caf\u00e9", True),
    ("12", "12.0", True), ("12 °C", "12C", True), ("1,200 jobs", "1200", True), ("$3.20", "3.2 dollars", True),
    ("\u22124", "-4", True), ("48 °F", "49 °F", False), ("rain", "drizzle", False), ("12", "twelve", False),
    ("12 C", "12 C.", True), ("0.5", ".5", True),
])
def test_default_equal(a, b, eq):
    assert default_equal(a, b) is eq and default_equal(b, a) is eq


def test_parse_number_and_normalize():
    assert parse_number("12.5 mm") == (12.5, "mm") and parse_number("-3") == (-3.0, "")
    assert parse_number("12 and 13") is None and parse_number("rain") is None and parse_number("1e400") is None
    assert normalize_text("  Hello\tWORLD. ") == "hello world"


def test_custom_values_equal():
    eq = lambda a, b: abs(float(a) - float(b)) <= 1.0      # noqa: E731  tolerate one degree
    cs = [cand("v1", "48", D(2020, 5, 1)), cand("v2", "49", D(2020, 5, 2)), cand("v0", "45", D(2020, 4, 1))]
    r = RecencyFilter(MetadataExtractor(), values_equal=eq)("q", cs)
    assert r.votes == {"v1": 1, "v2": 1, "v0": -1}


# ---- bad input --------------------------------------------------------------------------------------------

def test_bad_arguments():
    with pytest.raises(ValueError, match="policy"):
        RecencyFilter(MetadataExtractor(), policy="newest")
    with pytest.raises(ValueError, match="mode"):
        RecencyFilter(MetadataExtractor(), mode="drop")
    with pytest.raises(ValueError, match="recency_weight"):
        RecencyFilter(MetadataExtractor(), recency_weight=float("nan"))
    with pytest.raises(TypeError, match="extractor"):
        RecencyFilter("llm")
    f = RecencyFilter(MetadataExtractor())
    with pytest.raises(ValueError, match="duplicate id 'a'"):
        f("q", [cand("a", "1", None), cand("a", "2", None)])
    with pytest.raises(TypeError, match=r"candidates\[0\]"):
        f("q", [{"id": "a"}])
    with pytest.raises(TypeError, match="published"):
        f("q", [Candidate("a", "t", "2014-01-01")])
    with pytest.raises(TypeError, match="query"):
        f(None, [])
    r = f("q", [])
    assert r.kept == [] and r.votes == {} and r.ok


# ---- LLMExtractor -----------------------------------------------------------------------------------------

DOCS = [Candidate("a", "NYC had 120 collisions on May 3, 2024.", D(2024, 5, 4)),
        Candidate("b", "New York City: 131 collisions on 3 May 2024 (revised).", D(2024, 5, 10)),
        Candidate("c", "Boston weather report.", None)]


def test_prompt_is_listwise_with_dates():
    p = build_prompt("How many collisions in NYC on May 3, 2024?", DOCS)
    assert "Question: How many collisions in NYC on May 3, 2024?" in p
    assert "[0] (published 2024-05-04) NYC had 120" in p and "[2] (published unknown) Boston" in p
    assert '"doc_index"' in p and "NULL" in p and "JSON array" in p
    assert p.index("[0]") < p.index("[1]") < p.index("[2]")
    assert "..." in build_prompt("q", DOCS, max_chars=5)


def fake(answer):
    calls = []

    def generate(prompt):
        calls.append(prompt)
        return answer
    generate.calls = calls
    return generate


GOOD = [{"doc_index": 0, "head": "New York City", "relation": "collisions on 2024-05-03", "value": "120"},
        {"doc_index": 1, "head": "New York City", "relation": "collisions on 2024-05-03", "value": 131},
        {"doc_index": 2, "head": "Boston", "relation": "collisions on 2024-05-03", "value": "NULL"}]


def test_llm_extractor_plain_and_code_fenced_json():
    for text in (json.dumps(GOOD), "Here you go:\n```json\n" + json.dumps(GOOD, indent=2) + "\n```\nHope it helps!",
                 "Result: " + json.dumps(GOOD) + " -- the second document is newer.",
                 json.dumps({"facts": GOOD})):
        g = fake(text)
        r = RecencyFilter(LLMExtractor(g))("How many collisions in NYC on May 3, 2024?", DOCS)
        assert len(g.calls) == 1 and r.ok
        assert r.votes == {"a": -1, "b": 1, "c": 0} and ids(r.kept) == ["b", "c"]
        assert r.facts[1].value == "131" and r.facts[2].value is None


def test_llm_extractor_truncated_output_keeps_complete_items():
    text = json.dumps(GOOD)[:-30]            # cut inside the third object
    ex = parse_facts_json(text, 3)
    assert [f.doc_index for f in ex.facts] == [0, 1]
    assert any("truncated" in n for n in ex.notes) and any("[2]" in n for n in ex.notes)
    r = RecencyFilter(LLMExtractor(fake(text)))("q", DOCS)
    assert r.votes == {"a": -1, "b": 1, "c": 0} and any("truncated" in x for x in r.reasons)


def test_llm_extractor_wrong_indices_are_ignored_with_a_note():
    bad = [dict(GOOD[0], doc_index=5), dict(GOOD[1], doc_index="1"), dict(GOOD[0], doc_index=1),
           dict(GOOD[0], doc_index=-1), dict(GOOD[0], doc_index=True), "junk", dict(GOOD[0], doc_index=0, head=None)]
    ex = parse_facts_json(json.dumps(bad), 3)
    assert [(f.doc_index, f.value) for f in ex.facts] == [(1, "131")]
    notes = " | ".join(ex.notes)
    for s in ("doc_index 5", "duplicate doc_index 1", "doc_index -1", "doc_index True", "item 5 is not an object",
              "head/relation missing", "no fact for document(s) [0, 2]"):
        assert s in notes, (s, notes)
    r = RecencyFilter(LLMExtractor(fake(json.dumps(bad))))("q", DOCS)
    assert r.ok and r.removed == [] and any("doc_index 5" in x for x in r.reasons)


def test_llm_extractor_generate_must_return_text():
    r = RecencyFilter(LLMExtractor(lambda p: None))("q", DOCS)
    assert not r.ok and r.removed == [] and any("expected str" in x for x in r.reasons)
    with pytest.raises(TypeError, match="generate"):
        LLMExtractor("llama")


# ---- RuleExtractor ----------------------------------------------------------------------------------------

FC = [Candidate("f1", "Forecast issued March 3, 2014 for Seattle on March 5, 2014: high of 12.3 °C, low of 5 °C, rain.",
                D(2014, 3, 3)),
      Candidate("f2", "Seattle forecast for 2014-03-05 (issued 2014-03-04): a high of 12.8 °C and a low of 5 °C, rain.",
                D(2014, 3, 4)),
      Candidate("obs", "On March 5, 2014, Seattle recorded a high of 12.8°C and a low of 4 °C with drizzle.",
                D(2014, 3, 5)),
      Candidate("next", "Forecast issued March 5, 2014 for Seattle on March 6, 2014: high of 10 °C, rain.",
                D(2014, 3, 5)),
      Candidate("pdx", "Portland on March 5, 2014: high of 11 °C, sun.", D(2014, 3, 5))]


def test_rule_extractor_numbers_with_units_and_time_check():
    q = "What was the high temperature in Seattle on March 5, 2014?"
    facts = RuleExtractor()(q, FC)
    assert [(f.head, f.relation) for f in facts] == [("Seattle", "temp_max @ 2014-03-05")] * 3 + \
        [("Seattle", "temp_max")] * 2                                            # NULL: not about March 5
    assert [f.value for f in facts] == ["12.3 °c", "12.8 °c", "12.8°c", None, None]
    r = RecencyFilter(RuleExtractor())(q, FC)
    assert r.votes == {"f1": -1, "f2": 1, "obs": 1, "next": 0, "pdx": 0}
    q = "What was the low in Seattle on 03/05/2014?"
    assert [f.value for f in RuleExtractor()(q, FC)] == ["5 °c", "5 °c", "4 °c", None, None]
    assert RecencyFilter(RuleExtractor())(q, FC).votes == {"f1": -1, "f2": -1, "obs": 1, "next": 0, "pdx": 0}


def test_rule_extractor_keeps_different_days_apart():
    days = [Candidate(f"d{i}", f"On March {i}, 2014, Seattle recorded a high of {10 + i} °C.", D(2014, 3, i))
            for i in (3, 4, 5)] + [Candidate("v", "Forecast for Seattle on March 4, 2014: high of 9 °C.", D(2014, 3, 2))]
    # no date in the query: each day is its own fact; only day 4's old forecast conflicts with its observation
    r = RecencyFilter(RuleExtractor())("What was the high in Seattle?", days)
    assert r.votes == {"d3": 1, "d4": 1, "d5": 1, "v": -1}
    assert ("seattle", "temp_max @ 2014-03-04") in r.groups and len(r.groups) == 3
    # a month-level query: every March document addresses it, still one fact per day
    r = RecencyFilter(RuleExtractor())("What was the high in Seattle in March 2014?", days)
    assert r.votes == {"d3": 1, "d4": 1, "d5": 1, "v": -1}
    assert all(f.value is None for f in RuleExtractor()("What was the high in Seattle in April 2014?", days))
    # a monthly document does not answer a daily question
    monthly = [Candidate("m", "In March 2014, Seattle's average high was 11 °C.", D(2014, 4, 1))]
    assert RuleExtractor()("High in Seattle on March 4, 2014?", monthly)[0].value is None
    # without the qualification (qualify_by_date=False) all days compete: the latest one wins
    r = RecencyFilter(RuleExtractor(qualify_by_date=False))("What was the high in Seattle?", days)
    assert r.votes == {"d3": -1, "d4": -1, "d5": 1, "v": -1}


def test_rule_extractor_attribute_siblings_are_not_versions():
    docs = [Candidate("a", "06/2014: the United States counted 21,895 thousand jobs in government.", D(2014, 7, 19)),
            Candidate("b", "Monthly employment, nondurable goods manufacturing, United States, 08/2014: 4,508 thousand.",
                      D(2014, 9, 19)),
            Candidate("c", "The government sector of the United States employed 21,863 thousand people in 2014-08.",
                      D(2014, 9, 6)),
            Candidate("c2", "08/2014: the United States counted 21,800 thousand jobs in government (first estimate).",
                      D(2014, 9, 1))]
    q = "What was employment in government in the United States in 08/2014?"
    facts = RuleExtractor()(q, docs)
    assert [f.value for f in facts] == [None, None, "21,863 thousand", "21,800 thousand"]   # a: June; b: no "government"
    assert facts[2].relation == facts[3].relation == "employment @ 2014-08-?"
    assert RecencyFilter(RuleExtractor())(q, docs).votes == {"a": 0, "b": 0, "c": 1, "c2": -1}
    # without the term check the nondurable-goods series would be taken for a newer version
    assert RecencyFilter(RuleExtractor(match_terms=False))(q, docs).votes == {"a": 0, "b": 1, "c": -1, "c2": -1}


def test_rule_extractor_categories_aliases_and_relative_dates():
    q = "What was the weather like in Seattle on 5 March 2014?"
    assert [f.value for f in RuleExtractor()(q, FC)] == ["rain", "rain", "drizzle", None, None]
    docs = [Candidate("a", "Tomorrow in the Big Apple: sunny, high of 20 C.", D(2024, 5, 2)),
            Candidate("b", "Big Apple today: showers, high of 18 C.", D(2024, 5, 3)),
            Candidate("c", "Big Apple on May 4, 2024: foggy.", D(2024, 5, 1))]
    q = "What is the weather in NYC on May 3, 2024?"
    assert [f.value for f in RuleExtractor()(q, docs)] == [None, None, None]     # alias unknown: no head match
    ex = RuleExtractor({"New York City": ["Big Apple"]})
    facts = ex(q, docs)
    assert [f.head for f in facts] == ["New York City"] * 3
    assert [f.value for f in facts] == ["sun", "rain", None]                     # tomorrow/today resolved
    assert RecencyFilter(ex)(q, docs).votes == {"a": -1, "b": 1, "c": 0}


def test_rule_extractor_differing_span_and_query_relation():
    docs = [Candidate("a", "Acme Corp reported 1,200 employees and 3 offices.", D(2020, 1, 1)),
            Candidate("b", "Acme Corp reported 1,350 employees and 3 offices.", D(2021, 1, 1)),
            Candidate("c", "Acme Corp is a company.", D(2019, 1, 1))]
    ex = RuleExtractor({"Acme Corp": ["Acme"]})
    facts = ex("How big is Acme?", docs)
    assert {f.relation for f in facts} == {"how big is acme"}                   # no metric: the query itself
    assert [f.value for f in facts] == ["1,200 employees; 3 offices", "1,350 employees; 3 offices", "acme corp is a company"]
    docs = docs[:2]
    facts = ex("How big is Acme?", docs)
    assert [f.value for f in facts] == ["1,200 employees", "1,350 employees"]   # only the differing span
    # no entity in the query: nothing is stated, nothing removed
    assert all(f.value is None for f in RuleExtractor()("How big is it?", docs))
    assert [f.value for f in RuleExtractor(require_entity=False)("How big is it?", docs)] == \
        ["1,200 employees", "1,350 employees"]


def test_rule_extractor_bad_arguments():
    with pytest.raises(TypeError, match="aliases"):
        RuleExtractor({"NYC": "New York"})
    with pytest.raises(ValueError, match="metrics"):
        RuleExtractor(metrics={"x": (["x"], "words")})


def test_date_parts():
    t = "on 2014-02-30, March 5, in May 2014, 2014-07 and 1999; may be tomorrow"
    got = date_parts(t, ref=D(2014, 12, 31))
    assert [p for _, _, p in got] == [(2014, 2, None), (None, 3, 5), (2014, 5, None), (2014, 7, None), (1999, None, None),
                                      (2015, 1, 1)]
    assert date_parts("tomorrow")[0][2] == (None, None, None)


def test_find_dates():
    t = "issued today, March 5 2014, 03/04/2014, 5 March 2014, May 2014, 2014-02-30, may be, in 2015"
    got = find_dates(t, ref=D(2014, 1, 1))
    assert [d for _, _, d in got] == [D(2014, 1, 1), D(2014, 3, 5), D(2014, 3, 4), D(2014, 3, 5), None, None, None]
    assert [t[s:e] for s, e, _ in got][-3:] == ["May 2014", "2014-02-30", "2015"]
    assert find_dates("today")[0][2] is None


# ---- evaluation ------------------------------------------------------------------------------------------

class _Rec:
    def __init__(self, id, text, published, facts):
        self.id, self.text, self.published, self.meta = id, text, published, {"facts": facts}


def test_filter_metrics_hand_computed():
    before = {"q1": ["v1", "v2", "x"], "q2": ["y", "z"]}
    after = {"q1": ["v2", "x"], "q2": ["y", "z"]}
    texts = {"v1": "a b c", "v2": "a b", "x": "a", "y": "a b c d", "z": "e"}
    vals = {"v1": "10", "v2": "12", "x": None, "y": "rain", "z": "sun"}
    kw = dict(outdated={"v1"}, latest={"q1": ["v2"], "q2": ["z"]}, gold_value={"q1": "12.0", "q2": "sun"},
              doc_value=lambda q, d: vals[d], texts=texts)
    m = recency_metrics(before, **kw)
    assert m["stale_rate"] == pytest.approx(1 / 5) and m["version_accuracy"] == 0.0 and m["answer_proxy"] == 0.0
    assert m["evidence_docs"] == 2.5 and m["evidence_tokens"] == pytest.approx((3 + 2 + 1 + 4 + 1) / 2)
    c = compare_evidence(before, after, **kw)
    assert c["after"]["stale_rate"] == 0.0 and c["after"]["version_accuracy"] == 0.5
    assert c["after"]["answer_proxy"] == 0.5
    assert c["removed"] == 1 and c["queries_with_removals"] == 1 and c["removed_per_query"] == 0.5
    assert c["evidence_tokens_change"] == pytest.approx(8 / 11 - 1)
    with pytest.raises(ValueError, match="same queries"):
        compare_evidence(before, {"q1": []}, **kw)
    assert count_tokens("a b", lambda t: [1, 2, 3]) == 3 and count_tokens("a b c") == 3


def test_apply_recency_end_to_end_and_neutral_without_versions():
    recs = [_Rec("v1", "Seattle high 10", D(2014, 3, 1), [{"head": "Seattle", "relation": "high", "value": "10"}]),
            _Rec("v2", "Seattle high 12", D(2014, 3, 4), [{"head": "Seattle", "relation": "high", "value": "12"}]),
            _Rec("p", "Portland high 9", D(2014, 3, 4), [{"head": "Portland", "relation": "high", "value": "9"}]),
            _Rec("deep", "Seattle high 8", D(2014, 2, 1), [{"head": "Seattle", "relation": "high", "value": "8"}])]
    run_ = {"q": {"v1": 0.9, "v2": 0.8, "p": 0.7, "deep": 0.1}}
    res = apply_recency(run_, recs, RecencyFilter(MetadataExtractor()), {"q": "Seattle high?"}, k=3)
    assert ids(res["q"].kept) == ["v2", "p"] and ids(res["q"].removed) == ["v1"]
    assert filtered_run(run_, res) == {"q": {"v2": 0.8, "p": 0.7, "deep": 0.1}}
    b, a = evidence_lists(res)
    assert b == {"q": ["v1", "v2", "p"]} and a == {"q": ["v2", "p"]}
    # no outdated versions among the candidates: nothing removed
    res = apply_recency({"q": {"v2": 0.9, "p": 0.5}}, recs, RecencyFilter(MetadataExtractor()), {"q": "?"})
    assert res["q"].removed == []
    with pytest.raises(KeyError, match="not in records"):
        apply_recency({"q": {"nope": 1.0}}, recs, RecencyFilter(MetadataExtractor()), {"q": "?"})
    with pytest.raises(ValueError, match="k must"):
        apply_recency(run_, recs, RecencyFilter(MetadataExtractor()), {"q": "?"}, k=0)


def test_version_truth_from_records():
    from tempokern.datasets import Query, Record, RetrievalDataset
    f = lambda v: [{"head": "Seattle", "relation": "high 03-05", "value": v}]   # noqa: E731
    recs = [Record("v1", "t", meta={"facts": f("10")}, published=D(2014, 3, 1)),
            Record("v2", "t", meta={"facts": f("12")}, published=D(2014, 3, 4)),
            Record("o", "t", meta={"facts": [{"head": "Portland", "relation": "high", "value": "3"}]},
                   published=D(2014, 3, 1))]
    ds = RetrievalDataset("c", recs, [Query("q", "?", gold={"v1": 1, "v2": 1}),
                                      Query("q2", "?", gold={"o": 1}, meta={"answer": "3.0"})])
    t = version_truth(ds)
    assert t["outdated"] == {"v1"} and t["latest"] == {"q": ["v2"], "q2": ["o"]}
    assert t["gold_value"] == {"q": "12", "q2": "3.0"}
    assert t["doc_value"]("q", "v1") == "10" and t["doc_value"]("q", "o") is None
    m = recency_metrics({"q": ["v1", "v2"], "q2": ["o"]}, outdated=t["outdated"], latest=t["latest"],
                        gold_value=t["gold_value"], doc_value=t["doc_value"])
    assert m["stale_rate"] == pytest.approx(1 / 3) and m["version_accuracy"] == 0.5 and m["answer_proxy"] == 0.5


# ---- CLI: eval --recency, index/search --recency (a tiny CTD model on a Re²-style file) --------------------

def _versioned_re2(path):
    """20 days of Seattle highs: the observation (published that day, the gold) and 3 earlier forecasts
    (published 3, 2, 1 days before, each with another value)."""
    rows = []
    for day in range(1, 21):
        d = D(2014, 3, day)
        obs = 8.0 + day / 4
        negs = []
        for lag in (3, 2, 1):
            pub = d - dt.timedelta(days=lag)
            v = obs + lag * 0.7
            negs.append({"id": f"fc-{day}-{lag}", "kind": "outdated", "time": d.isoformat(), "published": pub.isoformat(),
                         "text": f"Forecast issued {pub:%B} {pub.day}, 2014 for Seattle on {d:%B} {d.day}, 2014: "
                                 f"high of {v:.1f} °C.",
                         "facts": [{"head": "Seattle", "relation": f"temp_max {d}", "value": f"{v:.1f} °C"}]})
        rows.append({"id": f"q{day}", "query": f"What was the high temperature in Seattle on {d:%B} {d.day}, 2014?",
                     "answer": f"{obs:.1f} °C", "split": "train" if day <= 12 else "val" if day <= 15 else "test",
                     "positive": {"id": f"obs-{day}", "time": d.isoformat(), "published": d.isoformat(),
                                  "text": f"On {d:%B} {d.day}, 2014 Seattle recorded a high of {obs:.1f} °C.",
                                  "facts": [{"head": "Seattle", "relation": f"temp_max {d}", "value": f"{obs:.1f} °C"}]},
                     "negatives": negs})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def re2_model(tmp_path_factory):
    from tempokern.cli import main
    tmp = tmp_path_factory.mktemp("recency_cli")
    data = _versioned_re2(tmp / "c.jsonl")
    rc = main(["train", "--data", data, "--format", "re2", "--epochs", "1", "--max-steps", "2", "--batch-size", "4",
               "--out", str(tmp / "run"), "--tiny-hidden", "32", "--tiny-layers", "1", "--max-length", "32",
               "--no-progress"])
    assert rc == 0
    return tmp, data


def test_cli_eval_recency_postprocess(re2_model, monkeypatch, capsys):
    import tempokern.cli as cli
    tmp, data = re2_model
    # a fixed run (the tiny model is untrained): q16's top 5 = two outdated forecasts, the gold, another day
    fixed = {"q16": {"fc-16-3": 5.0, "fc-16-1": 4.0, "obs-16": 3.0, "obs-17": 2.0, "fc-17-2": 1.0, "obs-1": 0.5},
             "q17": {"obs-17": 5.0, "obs-1": 4.0}}
    import tempokern.training as training
    real = training.evaluate_model

    def fixed_run(model, ds, split, **kw):   # the table of the real ranking, the filter on the fixed one
        table, _ = real(model, ds, split, **kw)
        return table, fixed
    monkeypatch.setattr(training, "evaluate_model", fixed_run)
    out = tmp / "e.json"
    base = ["eval", "--model", str(tmp / "run" / "best"), "--data", data, "--format", "re2", "--split", "test"]
    assert cli.main(base + ["--recency", "metadata", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())["recency"]
    assert "stale_rate" in capsys.readouterr().out
    # the oracle states every fact of a candidate: q16's two forecasts and fc-17-2 (older than obs-17) go
    assert rep["removed"] == 3 and rep["queries_with_removals"] == 1 and rep["failures"] == 0
    b, a = rep["before"], rep["after"]
    assert b["stale_rate"] == pytest.approx(3 / 7) and a["stale_rate"] == 0.0
    assert b["version_accuracy"] == 0.5 and a["version_accuracy"] == 1.0
    assert b["answer_proxy"] == 0.5 and a["answer_proxy"] == 1.0
    assert b["evidence_docs"] == 3.5 and a["evidence_docs"] == 2.0
    assert rep["retrieval"]["before"]["R@1"] == 0.5 and rep["retrieval"]["after"]["R@1"] == 1.0
    assert rep["retrieval"]["before"]["MRR"] == pytest.approx((1 / 3 + 1) / 2)
    assert rep["retrieval"]["after"]["MRR"] == 1.0
    assert cli.main(base + ["--recency", "metadata", "--recency-policy", "latest_only", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["recency"]["removed"] == 3
    # rule extractor: the time check keeps the other day's documents out of q16's question (NULL, kept)
    assert cli.main(base + ["--recency", "rule", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())["recency"]
    assert rep["removed"] == 2 and rep["after"]["stale_rate"] == pytest.approx(1 / 5)
    assert cli.main(base + ["--recency", "rule", "--recency-k", "0"]) == 2
    assert "--recency-k must be >= 1" in capsys.readouterr().err


def test_cli_eval_recency_filters_the_evaluated_ranking(re2_model):
    """Without a fixed run, the filter's "before" retrieval metrics are those of the table's own ranking."""
    import tempokern.cli as cli
    tmp, data = re2_model
    out = tmp / "e2.json"
    assert cli.main(["eval", "--model", str(tmp / "run" / "best"), "--data", data, "--format", "re2", "--split", "test",
                     "--recency", "metadata", "--out", str(out)]) == 0
    pay = json.loads(out.read_text())
    row = next(r for r in pay["rows"] if r["name"] == "all")
    before = pay["recency"]["retrieval"]["before"]
    assert before["R@1"] == pytest.approx(row["R@1"]) and before["R@5"] == pytest.approx(row["R@5"])
    assert before["MRR"] == pytest.approx(row["MRR"])


def test_cli_search_recency_rule(re2_model, capsys):
    from tempokern.cli import main
    tmp, data = re2_model
    idx = tmp / "c.idx"
    assert main(["index", "--model", str(tmp / "run" / "best"), "--data", data, "--format", "re2",
                 "--out", str(idx)]) == 0
    side = json.loads((tmp / "c.idx.records.json").read_text())
    assert side["published"][side["ids"].index("fc-16-3")] == "2014-03-13" and side["facts"][0]
    capsys.readouterr()
    q = "What was the high temperature in Seattle on March 16, 2014?"
    assert main(["search", "--model", str(tmp / "run" / "best"), "--index", str(idx), "--query", q, "-k", "80",
                 "--json", "--recency", "rule"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # all 80 documents are candidates: exactly March 16's three forecasts disagree with its observation
    assert sorted(h["id"] for h in line["removed"]) == ["fc-16-1", "fc-16-2", "fc-16-3"]
    assert len(line["hits"]) == 77 and {h["recency"] for h in line["removed"]} == {-1}
    assert next(h for h in line["hits"] if h["id"] == "obs-16")["recency"] == 1
    assert main(["search", "--model", str(tmp / "run" / "best"), "--index", str(idx), "--query", q, "-k", "80",
                 "--recency", "rule", "--recency-policy", "latest_only"]) == 0
    assert capsys.readouterr().out.count("removed (outdated)") == 3
    assert side["fact_dates"] == [None] * 80                 # the Re2 rows carry no meta["date"]
    # the metadata oracle compares every fact of the 80 hits: each day's 3 forecasts are outdated
    assert main(["search", "--model", str(tmp / "run" / "best"), "--index", str(idx), "--query", q, "-k", "80",
                 "--json", "--recency", "metadata"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(line["removed"]) == 60 and all(h["id"].startswith("fc-") for h in line["removed"])


def test_metadata_qualifiers_keep_days_apart():
    """Set C's facts name the metric only ("high temperature"); the record's meta["date"] qualifies it, so
    different days are different facts, and versions of one day compete."""
    def rec(i, day, v, pub):
        return Candidate(i, "t", pub, 0.0, {"date": day, "facts": [{"head": "Seattle", "relation": "high", "value": v}]})
    cs = [rec("d5-old", "2014-03-05", "12", D(2014, 3, 3)), rec("d5", "2014-03-05", "13", D(2014, 3, 5)),
          rec("d6", "2014-03-06", "9", D(2014, 3, 6))]
    r = RecencyFilter(MetadataExtractor())("q", cs)
    assert r.votes == {"d5-old": -1, "d5": 1, "d6": 1} and len(r.groups) == 2
    assert ("seattle", "high @ date=2014-03-05") in r.groups
    r = RecencyFilter(MetadataExtractor(qualifiers=()))("q", cs)          # unqualified: one group, d6 wins
    assert r.votes == {"d5-old": -1, "d5": -1, "d6": 1}
    from tempokern.datasets import Query, Record, RetrievalDataset
    ds = RetrievalDataset("c", [Record(c.id, c.text, meta=c.meta, published=c.published) for c in cs],
                          [Query("q", "?", gold={"d5": 1})])
    assert version_truth(ds)["outdated"] == {"d5-old"}
    assert version_truth(ds, qualifiers=())["outdated"] == {"d5-old", "d5"}
