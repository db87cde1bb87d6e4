"""Re3Encoder: a (by default frozen) transformers backbone + Re³'s time embedding and FiLM fusion.

``e_final = normalize((1 + α γ) ⊙ e_sem + β)``, ``(γ, β) = MLP_proj(TimeEmbedding(parse(text)))`` (Re³
Eqs. 4-9). Scores are plain inner products of ``e_final``, so ``tempokern.ctd_topk`` and
``TemporalIndex`` serve the model unchanged. With every time part unobserved the embedding is exactly the
frozen backbone's normalised pooled vector (B2) — :meth:`Re3Encoder.base_embeddings` computes that one
without the time modules, for comparison.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..nn.film import FiLM, TimeEmbedding
from ..text.time import TimeTuple, parse_time
from .encoder import POOLINGS, _field, pool

DOC_TIMES = ("content", "published", "content_or_published")
ROLES = ("query", "document")
FORMAT = "tempokern-re3-encoder"
VERSION = 1
CONFIG_FILE = "tempokern_re3.json"
TIME_FILE = "time_modules.safetensors"
BACKBONE_FILE = "backbone.safetensors"
TOKENIZER_DIR = "tokenizer"
_BACKBONE_WEIGHTS = ("model.safetensors", "pytorch_model.bin")


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def backbone_checksum(path) -> str:
    """sha256 over the weight file(s) of a transformers model directory (``model.safetensors`` or
    ``pytorch_model.bin``; sharded: every ``*.safetensors`` in name order)."""
    path = Path(path)
    files = [path / n for n in _BACKBONE_WEIGHTS if (path / n).exists()][:1]
    if not files:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no model weights (model.safetensors / pytorch_model.bin) under {path}")
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        h.update(_sha256_file(f).encode())
    return h.hexdigest()


def _as_date(x, what: str):
    if x is None:
        return None
    if isinstance(x, _dt.datetime):
        return x.date()
    if isinstance(x, _dt.date):
        return x
    if isinstance(x, str):
        try:
            return _dt.date.fromisoformat(x[:10])
        except ValueError:
            raise ValueError(f"{what}: {x!r} is not an ISO date") from None
    raise TypeError(f"{what}: expected datetime.date, ISO string or None, got {type(x).__name__}")


def resolve_times(texts: Sequence[str], *, times=None, pub=None, role: str = "query",
                  doc_time: str = "content") -> List[Optional[TimeTuple]]:
    """One ``TimeTuple | None`` per text.

    ``times`` given (a list of ``TimeTuple`` / ``datetime.date`` / ISO string / None): used as they are.
    Otherwise each text is parsed with :func:`tempokern.text.parse_time`, relative dates resolved against
    ``pub[i]`` (publication date of a document, query time of a query). For ``role="document"``,
    ``doc_time`` picks the document time (B10): ``"content"`` (parsed from the text), ``"published"``
    (``pub`` itself), ``"content_or_published"`` (parsed, else ``pub``)."""
    n = len(texts)
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    if doc_time not in DOC_TIMES:
        raise ValueError(f"doc_time must be one of {DOC_TIMES}, got {doc_time!r}")
    if pub is not None:
        pub = list(pub)
        if len(pub) != n:
            raise ValueError(f"pub: expected {n} dates (one per text), got {len(pub)}")
        pub = [_as_date(p, f"pub[{i}]") for i, p in enumerate(pub)]
    if times is not None:
        times = list(times)
        if len(times) != n:
            raise ValueError(f"times: expected {n} entries (one per text), got {len(times)}")
        out = []
        for i, t in enumerate(times):
            if t is None or isinstance(t, TimeTuple):
                out.append(t)
            else:
                out.append(TimeTuple.from_date(_as_date(t, f"times[{i}]")))
        return out
    out = []
    for i, text in enumerate(texts):
        ref = pub[i] if pub is not None else None
        if role == "document" and doc_time == "published":
            out.append(TimeTuple.from_date(ref) if ref is not None else None)
            continue
        t = parse_time(text, ref=ref)
        if (t is None or t.is_empty) and role == "document" and doc_time == "content_or_published" and ref is not None:
            t = TimeTuple.from_date(ref)
        out.append(t)
    return out


class Re3Encoder(nn.Module):
    """Re³ dual encoder (shared for queries and documents).

    backbone: a transformers model directory (loaded offline with AutoModel/AutoTokenizer; kept as the
    reference a checkpoint points to) or a built ``PreTrainedModel`` (pass ``tokenizer=``).
    ``freeze_backbone=True`` (B1, default): the backbone never trains and stays in eval mode, so its
    embeddings can be cached (:meth:`semantic`). ``lora``: a ``peft.LoraConfig`` or a dict of its
    arguments (``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules``); wraps the backbone with
    peft (imported only then) — the paper's LoRA baseline. ``use_time=False`` turns the time path off
    (every time masked: the encoder is the backbone; the LoRA baseline). ``time_parser``: ``"rules"``
    (the rule parser) — times can also be given explicitly to :meth:`encode`. ``doc_time``: B10."""

    def __init__(self, backbone: Any, *, pooling: str = "cls", freeze_backbone: bool = True, lora: Any = None,
                 time_parser: str = "rules", doc_time: str = "content", tokenizer: Any = None,
                 max_length: int = 128, year_mean: float = 2000.0, year_std: float = 10.0,
                 film_hidden: Optional[int] = None, use_time: bool = True, temperature: float = 0.05):
        super().__init__()
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        if doc_time not in DOC_TIMES:
            raise ValueError(f"doc_time must be one of {DOC_TIMES}, got {doc_time!r}")
        if time_parser not in ("rules",):
            raise ValueError(f"time_parser must be 'rules', got {time_parser!r}")
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
            raise ValueError(f"max_length must be a positive int, got {max_length!r}")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature!r}")
        self.backbone_path: Optional[str] = None
        if isinstance(backbone, (str, Path)):
            from transformers import AutoModel, AutoTokenizer
            self.backbone_path = str(Path(backbone).resolve()) if Path(backbone).exists() else str(backbone)
            if tokenizer is None:
                tokenizer = AutoTokenizer.from_pretrained(str(backbone))
            backbone = AutoModel.from_pretrained(str(backbone))
        if not isinstance(backbone, nn.Module) or not hasattr(backbone, "config"):
            raise TypeError("backbone must be a transformers model directory or a PreTrainedModel, "
                            f"got {type(backbone).__name__}")
        self.tokenizer = tokenizer
        self.pooling, self.doc_time, self.time_parser = pooling, doc_time, time_parser
        self.max_length, self.temperature, self.use_time = max_length, float(temperature), bool(use_time)
        self.freeze_backbone = bool(freeze_backbone) and lora is None
        self.lora_config = None
        self.lora_merged = False
        H = int(backbone.config.hidden_size)
        self.hidden_size = H
        if lora is not None:
            backbone = self._wrap_lora(backbone, lora)
        self.backbone = backbone
        if self.freeze_backbone:
            for p in self.backbone.parameters():
                p.requires_grad_(False)
            self.backbone.eval()
        self.time_embed = TimeEmbedding(H, year_mean=year_mean, year_std=year_std)
        self.film = FiLM(H, hidden=film_hidden)
        self._backbone_sha = None
        self._sem_cache = None

    # ---- LoRA ---------------------------------------------------------------------------------------------
    def _wrap_lora(self, backbone, lora):
        try:
            import peft
        except ImportError as e:  # pragma: no cover - optional dependency
            raise ImportError("Re3Encoder(lora=...) needs the 'peft' package (pip install tempokern[peft])") from e
        if isinstance(lora, dict):
            args = {"r": 16, "lora_alpha": 64, "lora_dropout": 0.1, "target_modules": "all-linear"}
            args.update(lora)
            cfg = peft.LoraConfig(**args)
        elif isinstance(lora, peft.LoraConfig):
            cfg = lora
        else:
            raise TypeError(f"lora must be a peft.LoraConfig or a dict of its arguments, got {type(lora).__name__}")
        self.lora_config = {k: (sorted(v) if isinstance(v, set) else v) for k, v in cfg.to_dict().items()
                            if k in ("r", "lora_alpha", "lora_dropout", "target_modules", "use_rslora")}
        return peft.get_peft_model(backbone, cfg)

    def _plain_backbone(self):
        """The backbone as a plain transformers model (LoRA merged into a copy when present)."""
        if self.lora_config is None:
            return self.backbone
        import copy
        return copy.deepcopy(self.backbone).merge_and_unload()

    # ---- modes --------------------------------------------------------------------------------------------
    def train(self, mode: bool = True):
        super().train(mode)
        if self.freeze_backbone:
            self.backbone.eval()
        return self

    @property
    def device(self) -> torch.device:
        return self.film.alpha.device

    def time_parameters(self) -> List[nn.Parameter]:
        return list(self.time_embed.parameters()) + list(self.film.parameters())

    def config_dict(self) -> dict:
        return {"pooling": self.pooling, "doc_time": self.doc_time, "time_parser": self.time_parser,
                "max_length": self.max_length, "temperature": self.temperature, "use_time": self.use_time,
                "film_hidden": self.film.hidden, "freeze_backbone": self.freeze_backbone,
                "year_mean": float(self.time_embed.year_mean), "year_std": float(self.time_embed.year_std),
                "lora": self.lora_config}

    # ---- tensors ------------------------------------------------------------------------------------------
    def semantic_from_ids(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``e_sem``: the backbone's pooled vector (B, H), not normalised."""
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return pool(hidden, attention_mask, self.pooling)

    def fuse(self, e_sem: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``e_final`` (B, H) from cached/computed ``e_sem`` and the batched times (see
        ``TimeTuple.batch``). With ``use_time=False`` the times are ignored (all masked)."""
        if not self.use_time:
            mask = torch.zeros_like(mask)
        e_time = self.time_embed(values, mask)
        return self.film(e_sem, e_time.to(e_sem.dtype))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, values: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        return self.fuse(self.semantic_from_ids(input_ids, attention_mask), values, mask)

    # ---- text API -----------------------------------------------------------------------------------------
    def tokenize(self, texts: Sequence[str]) -> dict:
        if self.tokenizer is None:
            raise ValueError("this Re3Encoder has no tokenizer: pass tokenizer= when building it from a model")
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise TypeError("texts must be a list of strings")
        enc = self.tokenizer(list(texts), padding=True, truncation=True, max_length=self.max_length,
                             return_tensors="pt")
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}

    def enable_semantic_cache(self, cache: Optional[dict] = None) -> dict:
        """Keep ``e_sem`` per text (CPU float32) so a text meets the frozen backbone once: the trainer's
        encoding pass, the gallery and the queries of an evaluation share it; pass the same ``cache`` dict
        to several encoders on the same backbone (e.g. the base / film / film_margins rows). Only with a
        frozen backbone (its ``e_sem`` never changes)."""
        if not self.freeze_backbone:
            raise ValueError("the semantic cache needs a frozen backbone (e_sem changes while LoRA trains)")
        self._sem_cache = {} if cache is None else cache
        return self._sem_cache

    def disable_semantic_cache(self) -> None:
        self._sem_cache = None

    def semantic(self, texts: Sequence[str], *, batch_size: int = 64, grad: bool = False,
                 progress=None) -> torch.Tensor:
        """``e_sem`` (N, H) for a list of texts (no gradient unless ``grad``). Without gradient the texts are
        encoded in batches of similar length (less padding) and, with :meth:`enable_semantic_cache`, each
        distinct text once."""
        dev = self.device
        if isinstance(texts, str):
            raise TypeError("texts must be a list of strings")
        texts = list(texts)
        if grad:
            outs = [self.semantic_from_ids(**{k: v.to(dev) for k, v in self.tokenize(texts[i:i + batch_size]).items()})
                    for i in range(0, len(texts), batch_size)]
            return torch.cat(outs) if outs else torch.empty(0, self.hidden_size, device=dev)
        cache = getattr(self, "_sem_cache", None)
        todo = list(dict.fromkeys(t for t in texts if cache is None or t not in cache))
        todo.sort(key=len)
        rows = {}
        it = range(0, len(todo), batch_size)
        if progress is not None:
            it = progress(it)
        else:   # the command line's progress setting (tempokern.models._batching.set_progress)
            from ._batching import progress as _progress
            it = _progress(it, len(it), "encode")
        with torch.no_grad():
            for i in it:
                chunk = todo[i:i + batch_size]
                e = self.semantic_from_ids(**{k: v.to(dev) for k, v in self.tokenize(chunk).items()})
                for t, row in zip(chunk, e):
                    rows[t] = row
        if cache is not None:
            for t, row in rows.items():
                cache[t] = row.detach().float().cpu()
            src = cache
        else:
            src = rows
        if not texts:
            return torch.empty(0, self.hidden_size, device=dev)
        dtype = self.film.alpha.dtype
        return torch.stack([src[t] for t in texts]).to(dev, dtype)

    def times(self, texts: Sequence[str], *, times=None, pub=None, role: str = "query"):
        """Batched ``(values (N, 4), mask (N, 4))`` for texts (see :func:`resolve_times`)."""
        tt = resolve_times(texts, times=times, pub=pub, role=role, doc_time=self.doc_time)
        return TimeTuple.batch(tt, device=self.device)

    @torch.no_grad()
    def encode(self, texts: Sequence[str], *, times=None, pub=None, role: str = "query",
               batch_size: int = 64) -> torch.Tensor:
        """``e_final`` (N, H) float32, in eval mode. ``times``: explicit times (else parsed from the texts,
        relative dates against ``pub``); ``role="document"`` applies ``doc_time``."""
        if isinstance(texts, str):
            raise TypeError("texts must be a list of strings")
        was = self.training
        self.eval()
        try:
            values, mask = self.times(texts, times=times, pub=pub, role=role)
            e_sem = self.semantic(texts, batch_size=batch_size)
            return self.fuse(e_sem, values, mask).float().cpu()
        finally:
            self.train(was)

    @torch.no_grad()
    def base_embeddings(self, texts: Sequence[str], *, batch_size: int = 64) -> torch.Tensor:
        """The base retriever's embeddings ``normalize(e_sem)`` (no time modules) — what :meth:`encode`
        returns for texts without any observed time (``base_equivalent``)."""
        was = self.training
        self.eval()
        try:
            return F.normalize(self.semantic(texts, batch_size=batch_size), dim=-1).float().cpu()
        finally:
            self.train(was)

    base_equivalent = base_embeddings

    def to_index(self, records: Sequence[Any], *, backend: str = "exact", batch_size: int = 64,
                 ids: Optional[Sequence[int]] = None, times=None, **index_kwargs):
        """Encode documents (dicts/objects with ``text``, optional ``published`` and an int ``id``, or pass
        ``ids=``) as ``role="document"`` into a :class:`tempokern.search.TemporalIndex` (plain inner
        product; the calendar positions are unused zeros)."""
        from ..search import TemporalIndex
        texts = [_field(r, "text") for r in records]
        pub = [_field(r, "published", None) for r in records]
        if ids is None:
            raw = [_field(r, "id", None) for r in records]
            bad = next((x for x in raw if not (isinstance(x, int) and not isinstance(x, bool))), ...)
            if bad is not ...:
                raise ValueError(f"to_index: record id {bad!r} is not an int, and TemporalIndex stores int64 ids; "
                                 "pass ids= (e.g. ids=range(len(records))) and map positions back to the records")
            ids = raw
        ids = torch.as_tensor(list(ids), dtype=torch.int64)
        if ids.numel() != len(texts):
            raise ValueError(f"ids has {ids.numel()} entries for {len(texts)} records")
        emb = self.encode(texts, times=times, pub=pub, role="document", batch_size=batch_size)
        index = TemporalIndex(self.hidden_size, backend=backend, **index_kwargs)
        index.add(ids, emb, torch.zeros(len(texts)))
        return index

    def search(self, index, texts: Sequence[str], k: int = 10, *, times=None, pub=None, **kw):
        """Encode queries and return ``index.search`` (ids (Q, k), scores (Q, k) = ⟨q, d⟩ / temperature)."""
        q = self.encode(texts, times=times, pub=pub, role="query")
        return index.search(q, torch.zeros(q.shape[0]), k, temperature=self.temperature, **kw)

    # ---- persistence --------------------------------------------------------------------------------------
    def save(self, path, *, embed_backbone: Optional[bool] = None) -> None:
        """Write a directory atomically: ``tempokern_re3.json`` (config, checksums) and
        ``time_modules.safetensors``. The frozen backbone is referenced by its directory and checksum
        (not copied) when it was loaded from a directory and is untouched; otherwise (built in memory, or
        LoRA-tuned: merged) its weights, config and tokenizer are stored too. ``embed_backbone=True``
        forces a copy."""
        from safetensors.torch import save_file

        from .checkpoint import fsync_tree, recover_dir, replace_dir
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        recover_dir(path)
        if embed_backbone is None:
            embed_backbone = self.backbone_path is None or self.lora_config is not None \
                or not Path(self.backbone_path).is_dir()
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
        try:
            sd = {k: v.detach().cpu().contiguous() for k, v in
                  list(self.time_embed.state_dict(prefix="time_embed.").items())
                  + list(self.film.state_dict(prefix="film.").items())}
            save_file(sd, str(tmp / TIME_FILE))
            meta = {"format": FORMAT, "version": VERSION, "encoder": self.config_dict(),
                    "time_sha256": _sha256_file(tmp / TIME_FILE)}
            if embed_backbone:
                bb = self._plain_backbone()
                bsd = {k: v.detach().cpu().contiguous() for k, v in bb.state_dict().items()}
                save_file(bsd, str(tmp / BACKBONE_FILE))
                meta["backbone"] = {"kind": "embedded", "config": bb.config.to_dict(),
                                    "sha256": _sha256_file(tmp / BACKBONE_FILE),
                                    "lora_merged": self.lora_config is not None, "source": self.backbone_path}
                if self.tokenizer is not None:
                    self.tokenizer.save_pretrained(str(tmp / TOKENIZER_DIR))
            else:
                if self._backbone_sha is None:
                    self._backbone_sha = backbone_checksum(self.backbone_path)
                meta["backbone"] = {"kind": "path", "path": self.backbone_path, "sha256": self._backbone_sha}
            (tmp / CONFIG_FILE).write_text(json.dumps(meta, indent=1, ensure_ascii=False, default=str))
            fsync_tree(tmp)
            replace_dir(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    @classmethod
    def load(cls, path, *, backbone_path: Optional[str] = None, map_location="cpu") -> "Re3Encoder":
        """Rebuild a saved Re3Encoder; every checksum is verified before weights are used. A referenced
        backbone is loaded from its recorded directory (or ``backbone_path``, e.g. after moving it) and must
        match the recorded checksum."""
        from safetensors.torch import load_file

        from .checkpoint import recover_dir
        path = Path(path)
        recover_dir(path)
        cfg_file = path / CONFIG_FILE
        if not cfg_file.exists():
            raise FileNotFoundError(f"{path} is not a saved Re3Encoder (no {CONFIG_FILE})")
        try:
            meta = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_file} is not valid JSON: {e}") from None
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise ValueError(f"{cfg_file}: format {meta.get('format')!r} version {meta.get('version')!r}, expected "
                             f"{FORMAT!r} version {VERSION}")
        tfile = path / TIME_FILE
        if not tfile.exists():
            raise FileNotFoundError(f"{tfile} is missing")
        if _sha256_file(tfile) != meta.get("time_sha256"):
            raise ValueError(f"{tfile} does not match the checksum in {CONFIG_FILE} (truncated or corrupted)")
        enc = dict(meta["encoder"])
        enc.pop("lora", None)
        enc.pop("freeze_backbone", None)
        b = meta["backbone"]
        if b["kind"] == "path":
            src = backbone_path or b["path"]
            if not Path(src).is_dir():
                raise FileNotFoundError(f"the backbone this Re3Encoder references, {src}, is not a directory; "
                                        "pass backbone_path= where it lives now")
            digest = backbone_checksum(src)
            if digest != b["sha256"]:
                raise ValueError(f"backbone at {src} does not match the checksum the Re3Encoder was saved with "
                                 "(a different or modified model)")
            model = cls(src, **enc)
            model._backbone_sha = digest
        elif b["kind"] == "embedded":
            from transformers import AutoConfig, AutoModel, AutoTokenizer
            bfile = path / BACKBONE_FILE
            if not bfile.exists():
                raise FileNotFoundError(f"{bfile} is missing")
            if _sha256_file(bfile) != b["sha256"]:
                raise ValueError(f"{bfile} does not match the checksum in {CONFIG_FILE} (truncated or corrupted)")
            bcfg = dict(b["config"])
            config = AutoConfig.for_model(bcfg.pop("model_type"), **bcfg)
            backbone = AutoModel.from_config(config)
            bsd = load_file(str(bfile))
            missing, unexpected = backbone.load_state_dict(bsd, strict=False)
            # AutoModel.from_config may add children the saved model was built without (BERT's pooler)
            for child in {k.split(".")[0] for k in missing}:
                names = [f"{child}.{n}" for n, _ in getattr(backbone, child).named_parameters()]
                if names and all(n in missing for n in names) and not any(k.startswith(child + ".") for k in bsd):
                    setattr(backbone, child, None)
                    missing = [k for k in missing if k not in names]
            if missing or unexpected:
                raise ValueError(f"{bfile} does not fit its config: missing {sorted(missing)[:8]}, unexpected "
                                 f"{sorted(unexpected)[:8]}")
            tok = AutoTokenizer.from_pretrained(str(path / TOKENIZER_DIR)) if (path / TOKENIZER_DIR).exists() else None
            model = cls(backbone, tokenizer=tok, **enc)
            model.backbone_path = b.get("source")
        else:
            raise ValueError(f"{cfg_file}: unknown backbone kind {b['kind']!r}")
        sd = load_file(str(tfile))
        own = {**model.time_embed.state_dict(prefix="time_embed."), **model.film.state_dict(prefix="film.")}
        if set(sd) != set(own):
            raise ValueError(f"{tfile} does not fit the time modules: missing {sorted(set(own) - set(sd))[:8]}, "
                             f"unexpected {sorted(set(sd) - set(own))[:8]}")
        model.time_embed.load_state_dict({k[len("time_embed."):]: v for k, v in sd.items() if k.startswith("time_embed.")})
        model.film.load_state_dict({k[len("film."):]: v for k, v in sd.items() if k.startswith("film.")})
        return model.to(map_location)


__all__ = ["Re3Encoder", "resolve_times", "backbone_checksum", "DOC_TIMES"]
