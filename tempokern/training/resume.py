"""What a resumable run saves beside its weights, and the checks ``resume`` makes before continuing.

Every trainer (CTD, TMRL, Re³) writes ``last/trainer_state.pt`` inside a checkpoint directory under its
``checksums.json`` manifest (:mod:`tempokern.models.checkpoint`). The state holds only tensors and plain
containers (loaded with ``torch.load(weights_only=True)``): optimizer, scheduler, the RNG states, the
position in the data order (epoch, batches done in it), the step, the run's resolved config and a
fingerprint of its data (:func:`data_fingerprint`: per collection the count and a SHA-256 of its items in
order, and the tokenizer vocabulary's SHA-256).

``resume`` compares the saved config and fingerprint with the current ones (:func:`check_resume`) and
refuses any difference, naming it, unless ``resume_anyway`` is given. The options in
:data:`RESUME_MUTABLE` may change on resume (they do not change what one step computes)."""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import random
from pathlib import Path
from typing import Any, Dict, Iterable, Mapping, Optional

import torch

from .._util import atomic_write
from ..models.checkpoint import CheckpointError

STATE_FILE = "trainer_state.pt"
STATE_FORMAT = "tempokern-trainer-state"
STATE_VERSION = 2

#: config options that may differ between a run and its resume: progress display, where the run ends
#: (``epochs`` / ``max_steps`` / ``stop_after_epochs``; a new total re-derives the learning-rate schedule's
#: length from the resumed step on), how often ``last/`` is written (``save_every``) and Re³'s CPU thread
#: count. The device is not part of the config and may change too.
RESUME_MUTABLE = ("progress", "epochs", "max_steps", "stop_after_epochs", "save_every", "cached_threads")


class ResumeMismatch(ValueError):
    """``resume`` with settings or data other than the saved run's."""


# ---- RNG states ---------------------------------------------------------------------------------------------

def rng_state() -> dict:
    """Torch (CPU, and CUDA when available) and Python RNG states as tensors and plain containers."""
    st = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = list(torch.cuda.get_rng_state_all())
    return st


def set_rng_state(st: Mapping) -> None:
    torch.set_rng_state(st["torch"])
    v, internal, gauss = st["python"]
    random.setstate((v, tuple(internal), gauss))
    if st.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(st["cuda"]))


# ---- data fingerprint ---------------------------------------------------------------------------------------

def _canon(x):
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: _canon(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, tuple) and hasattr(x, "_fields"):   # NamedTuple
        return {k: _canon(v) for k, v in zip(x._fields, x)}
    if isinstance(x, Mapping):
        return {str(k): _canon(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_canon(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


def digest_items(items: Iterable[Any]) -> dict:
    """``{"count": n, "sha256": ...}`` of a sequence of items (records, queries, rows), order included."""
    h, n = hashlib.sha256(), 0
    for it in items:
        h.update(json.dumps(_canon(it), sort_keys=True, ensure_ascii=False).encode("utf-8"))
        h.update(b"\n")
        n += 1
    return {"count": n, "sha256": h.hexdigest()}


def tokenizer_digest(tok) -> Optional[str]:
    """SHA-256 of a tokenizer's vocabulary (token -> id), None without a tokenizer."""
    if tok is None:
        return None
    vocab = tok.get_vocab() if hasattr(tok, "get_vocab") else getattr(tok, "vocab", None)
    if vocab is None:
        return None
    text = json.dumps(sorted((str(k), int(v)) for k, v in vocab.items()), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def data_fingerprint(tokenizer=None, **collections) -> dict:
    """``{collection: {"count", "sha256"}, ..., "tokenizer_vocab": sha256 | None}``."""
    fp = {name: digest_items(items) for name, items in collections.items()}
    fp["tokenizer_vocab"] = tokenizer_digest(tokenizer)
    return fp


def dataset_fingerprint(dataset, tokenizer=None) -> dict:
    """The fingerprint of a :class:`tempokern.datasets.RetrievalDataset` (records, queries with their
    qrels and splits) and the model's tokenizer vocabulary."""
    return data_fingerprint(tokenizer, records=dataset.records,
                            queries=[(q, sorted(q.gold.items())) for q in dataset.queries])


# ---- save / load --------------------------------------------------------------------------------------------

def state_bytes(state: dict) -> bytes:
    buf = io.BytesIO()
    torch.save({"format": STATE_FORMAT, "version": STATE_VERSION, **state}, buf)
    return buf.getvalue()


#: the entries every trainer state holds (:func:`load_state`'s default check)
TRAINER_KEYS = ("config", "data", "rng", "epoch", "batch", "epoch_done", "step")


def load_state(path, required=TRAINER_KEYS) -> dict:
    """Read a trainer state written by :func:`state_bytes` (``weights_only=True``); every failure names the
    file, as does a missing entry of `required`. The caller verifies the checkpoint's manifest first (a
    flipped byte or a truncation is reported there as a checksum mismatch naming the file)."""
    path = Path(path)
    try:
        st = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:   # noqa: BLE001 - unpickling raises many kinds; each is reported with the file
        raise CheckpointError(f"{path} cannot be read as a tempokern trainer state: {type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}") from None
    if not isinstance(st, dict) or st.get("format") != STATE_FORMAT:
        raise CheckpointError(f"{path} is not a tempokern trainer state (format {STATE_FORMAT!r}); it was written "
                              "by an older tempokern: start the run again (--overwrite)")
    if st.get("version") != STATE_VERSION:
        raise CheckpointError(f"{path} has trainer-state version {st.get('version')!r}; this tempokern reads "
                              f"version {STATE_VERSION}")
    for key in required:
        if key not in st:
            raise CheckpointError(f"{path} has no {key!r} entry (not a complete trainer state)")
    return st


# ---- checks -------------------------------------------------------------------------------------------------

def _short(v) -> str:
    s = json.dumps(v, default=str) if not isinstance(v, str) else repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def config_changes(saved: Mapping, current: Mapping, defaults: Optional[Mapping] = None,
                   mutable=RESUME_MUTABLE) -> list:
    """``["key: old -> new", ...]`` for the options that differ (those in `mutable` excepted; an option the
    saved config lacks counts as its default)."""
    out = []
    defaults = defaults or {}
    norm = lambda v: json.loads(json.dumps(v, default=str))   # tuples == lists, as saved
    for k in sorted(set(saved) | set(current)):
        if k in mutable:
            continue
        old = saved.get(k, defaults.get(k, "(absent)"))
        new = current.get(k, defaults.get(k, "(absent)"))
        if norm(old) != norm(new):
            out.append(f"{k}: {_short(old)} -> {_short(new)}")
    return out


def data_changes(saved: Mapping, current: Mapping) -> list:
    out = []
    for k in sorted(set(saved) | set(current)):
        old, new = saved.get(k), current.get(k)
        if old == new:
            continue
        if k == "tokenizer_vocab":
            out.append(f"tokenizer vocabulary changed (sha256 {str(old)[:12]} -> {str(new)[:12]})")
        elif isinstance(old, Mapping) and isinstance(new, Mapping):
            d = new["count"] - old["count"]
            if d:
                out.append(f"data changed: {abs(d)} {k} {'added' if d > 0 else 'removed'} ({old['count']} -> "
                           f"{new['count']})")
            else:
                out.append(f"data changed: {k} differ in content ({old['count']} of them; sha256 "
                           f"{old['sha256'][:12]} -> {new['sha256'][:12]})")
        else:
            out.append(f"data changed: {k} {_short(old)} -> {_short(new)}")
    return out


def check_resume(state_file, state: Mapping, config, fingerprint: Mapping, *, anyway: bool = False,
                 log=print) -> None:
    """Refuse to resume from `state` with a config (a dataclass) or data fingerprint other than the saved
    ones (:class:`ResumeMismatch` listing every difference); ``anyway=True`` logs them and continues."""
    defaults = {f.name: f.default for f in dataclasses.fields(config)
                if f.default is not dataclasses.MISSING}
    changes = config_changes(state["config"], dataclasses.asdict(config), defaults)
    changes += data_changes(state["data"], fingerprint)
    if not changes:
        return
    what = "; ".join(changes)
    if anyway:
        log(f"resuming anyway (resume_anyway) although the run in {Path(state_file).parent} differs: {what}")
        return
    raise ResumeMismatch(f"cannot resume from {state_file}: the settings or data differ from the saved run's: "
                         f"{what}. Resume with the run's own settings and data, start a new run (--overwrite or "
                         f"another --out), or give --resume-anyway (resume_anyway=True) to continue regardless")


def mutable_notes(saved: Mapping, current: Mapping) -> list:
    """The :data:`RESUME_MUTABLE` options that changed (logged on resume)."""
    return [f"{k}: {_short(saved.get(k))} -> {_short(current.get(k))}" for k in RESUME_MUTABLE
            if k in saved and k in current and saved[k] != current[k] and k != "progress"]


def truncate_log(path, step: int) -> int:
    """Drop the records of ``log.jsonl`` written after the checkpoint's `step` (records with a ``step`` above
    it, and a line cut short by a kill), so that a resumed run logs each step once. Returns how many lines
    were dropped."""
    path = Path(path)
    if not path.exists():
        return 0
    keep, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            dropped += 1
            continue
        s = rec.get("step") if isinstance(rec, dict) else None
        if isinstance(s, int) and s > step:
            dropped += 1
            continue
        keep.append(line)
    if dropped:
        atomic_write(path, "".join(l + "\n" for l in keep))
    return dropped


def save_state_dir(where, state: dict) -> None:
    """Write a checkpoint directory holding only the trainer state (Re³'s ``last/``: its trainable weights
    are in the state; the suite's ``minilm_ft`` fine-tuning state) under a checksum manifest, atomically
    (built aside, swapped into place)."""
    import shutil
    import tempfile
    from .._files import tmp_prefix
    from .._util import recover_dir
    from ..models.checkpoint import check_save_target, finish_checkpoint, write_extra_files
    where = Path(where)
    where.parent.mkdir(parents=True, exist_ok=True)
    recover_dir(where)
    check_save_target(where)
    tmp = Path(tempfile.mkdtemp(prefix=tmp_prefix(where.name), dir=where.parent))
    try:
        write_extra_files(tmp, {STATE_FILE: state_bytes(state)})
        finish_checkpoint(tmp, where)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_state_dir(where, required=TRAINER_KEYS) -> dict:
    """Verify the checkpoint directory `where` against its manifest, then read its trainer state (which must
    hold the entries `required`)."""
    from ..models.checkpoint import verify_checkpoint
    where = Path(where)
    verify_checkpoint(where)
    return load_state(where / STATE_FILE, required)


def resume_or_restart(train, work_dir, log=print):
    """For a suite unit's own work folder: ``train(resume)`` with resume=True when ``work_dir/last`` holds a
    trainer state; a state that cannot be resumed (damaged, an older format, other settings or data) is logged
    and the unit trains from the start instead (its ``last/`` and ``log.jsonl`` removed first; the model is
    untouched, as the check runs before any weight is loaded). Returns ``(train's result, resumed)``."""
    import shutil
    work_dir = Path(work_dir)
    if not (work_dir / "last" / STATE_FILE).exists():
        return train(False), False
    try:
        return train(True), True
    except (CheckpointError, ResumeMismatch) as e:
        log(f"{e}; this unit trains from the start")
        shutil.rmtree(work_dir / "last", ignore_errors=True)
        (work_dir / "log.jsonl").unlink(missing_ok=True)
        return train(False), False
