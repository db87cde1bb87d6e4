"""Saving/loading CTDEncoder (safetensors + JSON, atomic, checksummed) and importing the
temporal modules of ChunQiuTR CTD checkpoints.

Every checkpoint directory (CTD, TMRL, Re3) carries ``checksums.json``: the SHA-256 and size of
every other file in it (config, weights, tokenizer, trainer state), written last inside the
temporary directory that is swapped into place. Loading verifies it before any file is read."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, Mapping

import torch

from .._files import tmp_prefix
from .._util import atomic_write, fsync_path, fsync_tree, recover_dir, plain_permissions, replace_dir, sha256_file  # noqa: F401
from .levels import LevelSpec, calendar_levels

FORMAT = "tempokern-ctd-encoder"
VERSION = 1
CONFIG_FILE = "tempokern_encoder.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_DIR = "tokenizer"
MANIFEST_FILE = "checksums.json"
MANIFEST_FORMAT = "tempokern-checksums"
#: the config file that marks a directory as a tempokern checkpoint, per model kind
CHECKPOINT_MARKERS = (CONFIG_FILE, "tempokern_tmrl.json", "tempokern_re3.json", MANIFEST_FILE, "trainer_state.pt")


class CheckpointError(ValueError):
    """A checkpoint directory whose files do not match its checksum manifest, or that lacks one."""




def check_save_target(path: Path) -> None:
    """Refuse to save a checkpoint onto anything but a missing path, an empty directory or an existing
    tempokern checkpoint directory (one holding a checkpoint config or a checksum manifest): a regular
    file or another directory's contents are never moved aside."""
    path = Path(path)
    if not os.path.lexists(path):
        return
    if path.is_symlink() or not path.is_dir():
        kind = "a symbolic link" if path.is_symlink() else "not a directory"
        raise FileExistsError(f"cannot save a checkpoint to {path}: it exists and is {kind} "
                              "(a checkpoint is a directory; pick another path or remove the file)")
    if any(path.iterdir()) and not any((path / m).is_file() for m in CHECKPOINT_MARKERS):
        raise FileExistsError(f"cannot save a checkpoint to {path}: it is a non-empty directory that is not a "
                              f"tempokern checkpoint (no {' / '.join(CHECKPOINT_MARKERS)}); pick an empty or new path")


def _checkpoint_files(root: Path):
    """Relative POSIX paths of every file under root, the manifest excluded, sorted."""
    out = []
    for d, dirs, files in os.walk(str(root)):
        dirs.sort()
        for f in files:
            rel = Path(d, f).relative_to(root).as_posix()
            if rel != MANIFEST_FILE:
                out.append(rel)
    return sorted(out)


def write_manifest(root, *, atomic: bool = True) -> dict:
    """Write ``checksums.json`` into the checkpoint directory `root`: SHA-256 and size of every other
    file under it. atomic=False writes it in place (for a directory not yet swapped into place, which
    becomes visible as a whole). Returns the ``files`` table."""
    root = Path(root)
    files = {rel: {"sha256": sha256_file(root / rel), "size": (root / rel).stat().st_size}
             for rel in _checkpoint_files(root)}
    text = json.dumps({"format": MANIFEST_FORMAT, "version": 1, "algorithm": "sha256", "files": files},
                      indent=1, sort_keys=True)
    if atomic:
        atomic_write(root / MANIFEST_FILE, text)
    else:
        (root / MANIFEST_FILE).write_text(text, encoding="utf-8")
    return files


def verify_checkpoint(path, *, allow_missing_manifest: bool = False, unread=()):
    """Check every file of the checkpoint directory `path` against its ``checksums.json`` before any of
    them is read: a listed file that is missing or differs, or a file that is not listed, raises
    :class:`CheckpointError` naming the file. Files named in `unread` (ones the caller does not read,
    e.g. an optional projector) must be listed but are not hashed. Returns ``{relative path: sha256}``
    of the files checked.

    A directory without ``checksums.json`` (saved by a tempokern that wrote none) raises too, unless
    ``allow_missing_manifest=True``: then it loads with a warning, only the weights' checksums in its
    config are checked, and None is returned; saving it again adds the manifest."""
    path = Path(path)
    man = path / MANIFEST_FILE
    if not man.exists():
        if allow_missing_manifest:
            import warnings
            warnings.warn(f"{path} has no {MANIFEST_FILE}: its config and tokenizer are not verified "
                          "(allow_missing_manifest=True); save it again to add the manifest", stacklevel=3)
            return None
        raise CheckpointError(f"{man} is missing: the checkpoint's config and tokenizer cannot be verified (a "
                              "checkpoint saved before checksum manifests, or a damaged one); load it with "
                              "allow_missing_manifest=True to accept it unverified, then save it again")
    try:
        meta = json.loads(man.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{man} is not valid JSON: {e}") from None
    files = meta.get("files") if isinstance(meta, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != MANIFEST_FORMAT or not isinstance(files, dict):
        raise CheckpointError(f"{man} is not a tempokern checksum manifest (format {MANIFEST_FORMAT!r} with a "
                              "'files' table)")
    digests = {}
    for rel, info in files.items():
        parts = Path(rel).parts
        if not isinstance(info, dict) or Path(rel).is_absolute() or ".." in parts or not parts:
            raise CheckpointError(f"{man}: invalid entry {rel!r}")
        f = path / rel
        if Path(rel).as_posix() in unread:
            continue
        if not f.is_file():
            raise CheckpointError(f"{f} is missing (listed in {man})")
        if f.stat().st_size != info.get("size") or sha256_file(f) != info.get("sha256"):
            raise CheckpointError(f"{f} does not match its checksum in {man} (modified, truncated or corrupted)")
        digests[Path(rel).as_posix()] = info["sha256"]
    extra = [rel for rel in _checkpoint_files(path) if rel not in files]
    if extra:
        raise CheckpointError(f"{path / extra[0]} is not listed in {man} (a file added after saving)")
    return digests


def file_digest(root: Path, rel: str, digests) -> str:
    """SHA-256 of root/rel: from a verified manifest's table when there is one, else computed."""
    if digests is not None and rel in digests:
        return digests[rel]
    return sha256_file(Path(root) / rel)


def write_extra_files(tmp: Path, extra_files) -> None:
    """Write ``{relative name: bytes}`` into a checkpoint being built (e.g. a trainer state)."""
    for name, data in (extra_files or {}).items():
        target = tmp / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)


def finish_checkpoint(tmp: Path, path: Path) -> None:
    """Seal the checkpoint built in `tmp` (manifest, fsync) and swap it into place at `path`: the
    directory appears whole, so the manifest inside it is written atomically with it."""
    write_manifest(tmp, atomic=False)
    plain_permissions(tmp)    # 0755 / 0644 (umask 022), not mkdtemp's 0700 and safetensors' 0600
    fsync_tree(tmp)
    replace_dir(tmp, path)


def require_keys(meta: dict, cfg_file: Path, keys) -> None:
    """A checkpoint config lacking an entry, or holding one of the wrong kind, is named with its file."""
    for key, kind in keys:
        if key not in meta:
            raise CheckpointError(f"{cfg_file} has no {key!r} entry (not a complete checkpoint config)")
        if not isinstance(meta[key], kind):
            raise CheckpointError(f"{cfg_file}: {key!r} must be a JSON {'object' if kind is dict else kind.__name__}, "
                                  f"got {type(meta[key]).__name__}")


def save_encoder(model, path, *, extra_files=None) -> None:
    """Write a directory: model.safetensors, tempokern_encoder.json (config + checksum), the
    tokenizer, `extra_files` ({name: bytes}) and checksums.json over all of them. Built in a temporary
    sibling directory, fsynced, then swapped into place atomically (:func:`replace_dir`), so a crash
    leaves the previous checkpoint or the new one under `path`, never none and never a half-written
    one. `path` must be new, an empty directory or a checkpoint directory (FileExistsError otherwise)."""
    from safetensors.torch import save_model
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    recover_dir(path)
    check_save_target(path)
    tmp = Path(tempfile.mkdtemp(prefix=tmp_prefix(path.name), dir=path.parent))
    try:
        save_model(model, str(tmp / WEIGHTS_FILE))
        if model.tokenizer is not None:
            model.tokenizer.save_pretrained(str(tmp / TOKENIZER_DIR))
        meta = {
            "format": FORMAT, "version": VERSION, "encoder": model.config_dict(),
            "backbone_config": model.backbone.config.to_dict(),
            "weights_sha256": sha256_file(tmp / WEIGHTS_FILE),
        }
        (tmp / CONFIG_FILE).write_text(json.dumps(meta, indent=1, ensure_ascii=False, default=str))
        write_extra_files(tmp, extra_files)
        finish_checkpoint(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_config(path) -> dict:
    path = Path(path)
    recover_dir(path)
    cfg_file = path / CONFIG_FILE
    if not path.is_dir() or not cfg_file.exists():
        raise FileNotFoundError(f"{path} is not a saved CTDEncoder (no {CONFIG_FILE}); "
                                "save one with CTDEncoder.save(dir) or `tempokern train`")
    try:
        meta = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{cfg_file} is not valid JSON: {e}") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{cfg_file} must hold a JSON object")
    if meta.get("format") != FORMAT:
        raise ValueError(f"{cfg_file} has format {meta.get('format')!r}, expected {FORMAT!r}")
    if meta.get("version") != VERSION:
        raise ValueError(f"{cfg_file} has format version {meta.get('version')!r}; this tempokern reads "
                         f"version {VERSION}")
    require_keys(meta, cfg_file, (("encoder", dict), ("backbone_config", dict)))
    if not isinstance(meta["encoder"].get("levels"), list):
        raise CheckpointError(f"{cfg_file}: 'encoder' has no 'levels' list")
    if not isinstance(meta["backbone_config"].get("model_type"), str):
        raise CheckpointError(f"{cfg_file}: 'backbone_config' has no 'model_type' string")
    return meta


def load_encoder(path, calendar: Any = None, *, cls, map_location="cpu", allow_missing_manifest: bool = False):
    """Rebuild a CTDEncoder (``cls``: CTDEncoder.load passes its class, so that this module does not import the
    encoder; tempokern.models.load_encoder is CTDEncoder.load)
    saved by save_encoder; the backbone comes from its stored config, so no model hub is contacted. Every file
    is checked against checksums.json before anything is read (:func:`verify_checkpoint`;
    allow_missing_manifest=True accepts a checkpoint saved without one)."""
    from safetensors.torch import load_model
    from transformers import AutoConfig, AutoModel, AutoTokenizer


    path = Path(path)
    recover_dir(path)
    meta = read_config(path)   # format and version first: a newer format is said as such
    digests = verify_checkpoint(path, allow_missing_manifest=allow_missing_manifest)
    weights = path / WEIGHTS_FILE
    if not weights.exists():
        raise FileNotFoundError(f"{weights} is missing")
    digest = file_digest(path, WEIGHTS_FILE, digests)
    if digest != meta.get("weights_sha256"):
        raise ValueError(f"{weights} does not match the checksum in {CONFIG_FILE} (file truncated or "
                         "corrupted)")
    enc = dict(meta["encoder"])
    try:
        levels = [tuple(l) for l in enc.pop("levels")]
    except TypeError:
        raise CheckpointError(f"{path / CONFIG_FILE}: 'encoder.levels' must be a list of [name, size] pairs") from None
    kind = enc.pop("calendar", "custom")
    backbone_name = enc.pop("backbone_name", "")
    if calendar is None:
        calendar = LevelSpec(levels, kind)
    elif [tuple(l) for l in calendar_levels(calendar)] != levels:
        raise ValueError(f"calendar levels {calendar_levels(calendar)} differ from the saved model's {levels}")
    bcfg = dict(meta["backbone_config"])
    model_type = bcfg.pop("model_type")
    try:
        config = AutoConfig.for_model(model_type, **bcfg)
        backbone = AutoModel.from_config(config)
        tok = None
        if (path / TOKENIZER_DIR).exists():
            tok = AutoTokenizer.from_pretrained(str(path / TOKENIZER_DIR))
        model = cls(backbone, calendar, tokenizer=tok, **enc)
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise CheckpointError(f"{path / CONFIG_FILE}: the model cannot be rebuilt from this config: "
                              f"{type(e).__name__}: {e}") from None
    model.backbone_name = backbone_name
    missing, unexpected = load_model(model, str(weights), strict=False, device=str(map_location))
    # AutoModel.from_config adds submodules the saved backbone was built without (BERT's pooler):
    # drop a backbone child whose parameters are all absent from the file; anything else is an error
    prefixes = {".".join(k.split(".")[:2]) for k in missing if k.startswith("backbone.")}
    for pre in prefixes:
        child = pre.split(".")[1]
        names = [f"{pre}.{n}" for n, _ in getattr(model.backbone, child).named_parameters()]
        if names and all(n in missing for n in names):
            setattr(model.backbone, child, None)
            missing = [k for k in missing if k not in names]
    if missing or unexpected:
        raise ValueError(f"{weights} does not fit the model rebuilt from {CONFIG_FILE}: missing "
                         f"{sorted(missing)[:8]}, unexpected {sorted(unexpected)[:8]}")
    return model


# ---- ChunQiuTR checkpoints -------------------------------------------------------------------------

_CQ_HEADS = ("time_head_gong", "time_head_year", "time_head_month")


def _read_state_dict(src) -> Dict[str, torch.Tensor]:
    if isinstance(src, Mapping):
        sd = dict(src)
    else:
        p = Path(src)
        if not p.exists():
            raise FileNotFoundError(f"checkpoint {p} does not exist")
        if p.suffix == ".safetensors":
            from safetensors.torch import load_file
            sd = load_file(str(p))
        else:
            sd = torch.load(str(p), map_location="cpu", weights_only=True)
        for key in ("model", "state_dict", "model_state_dict"):
            if isinstance(sd, Mapping) and key in sd and isinstance(sd[key], Mapping):
                sd = dict(sd[key])
    out = {}
    for k, v in sd.items():
        for prefix in ("module.", "_orig_mod."):
            while k.startswith(prefix):
                k = k[len(prefix):]
        out[k] = v
    return out


def chunqiu_name_map(model) -> Dict[str, str]:
    """ChunQiuTR parameter name -> CTDEncoder parameter name."""
    m = {}
    for l, name in enumerate(_CQ_HEADS[:len(model.time_heads)]):
        m[f"{name}.weight"] = f"time_heads.{l}.weight"
        m[f"{name}.bias"] = f"time_heads.{l}.bias"
    m.update({"time_ctx_proj.weight": "ctx_proj.weight", "time_ctx_proj.bias": "ctx_proj.bias",
              "time_ctx_gate": "ctx_gate", "time_rel_alpha": "offset_bias.scale"})
    for i in (0, 2):
        for p in ("weight", "bias"):
            m[f"time_rel_mlp.{i}.{p}"] = f"offset_bias.mlp.{i}.{p}"
    return m


def load_chunqiu_ctd(model, src, *, include_backbone: bool = False) -> dict:
    """Copy the temporal modules of a ChunQiuTR BertDualEncoder/QwenTimeDualEncoder checkpoint
    (`time_head_gong/year/month`, `time_ctx_proj`, `time_ctx_gate`, `time_rel_mlp`,
    `time_rel_alpha`) into `model`. Level l of the calendar takes head gong/year/month in that
    order, so the calendar must have those three levels with the checkpoint's sizes.
    include_backbone=True also loads `encoder.*` into the backbone. Returns
    {"loaded": [...], "missing": [...], "ignored": [...]}; shape mismatches raise ValueError."""
    sd = _read_state_dict(src)
    if len(model.levels) != 3 and any(k.startswith(_CQ_HEADS) for k in sd):
        raise ValueError(f"ChunQiuTR checkpoints have 3 calendar heads (gong/year/month); this model's "
                         f"calendar has {len(model.levels)} levels {model.levels}")
    names = chunqiu_name_map(model)
    own = dict(model.named_parameters())
    loaded, ignored = [], []
    updates = {}
    for k, v in sd.items():
        target = names.get(k)
        if target is None and include_backbone and k.startswith("encoder."):
            target = "backbone." + k[len("encoder."):]
            if target not in own:
                target = None
        if target is None:
            ignored.append(k)
            continue
        p = own[target]
        v = torch.as_tensor(v)
        if v.numel() == p.numel() == 1:
            v = v.reshape(p.shape)
        if tuple(v.shape) != tuple(p.shape):
            raise ValueError(f"checkpoint tensor {k} has shape {tuple(v.shape)}, but {target} in this model "
                             f"has shape {tuple(p.shape)} (check the calendar sizes, ctx_dim, bias_features, "
                             "bias_hidden and the backbone's hidden size)")
        updates[target] = v
        loaded.append(k)
    if not any(k in names for k in loaded):
        raise ValueError("no ChunQiuTR temporal weights (time_head_*, time_ctx_*, time_rel_*) found in the "
                         "checkpoint")
    with torch.no_grad():
        for target, v in updates.items():
            own[target].copy_(v.to(own[target].dtype))
    missing = [k for k in names if k not in sd]
    return {"loaded": loaded, "missing": missing, "ignored": ignored}
