"""TMRLEncoder: a transformers backbone with LoRA (peft, optional), nested (Matryoshka) embedding
prefixes and TMRL's temporal projector (design notes §2.1 T1, T4, T5, T10; §2.4 "Model wrapper").

peft is an optional dependency (``pip install tempokern[peft]``), imported only when a LoRA model is
built or loaded; ``lora=False`` (frozen backbone) and ``lora="full"`` (full fine-tuning) do not need it."""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .._files import tmp_prefix
from ..limits import cap_texts
from ..nn import TemporalProjector, temporal_pool
from ..search import TemporalIndex
from ..text import temporal_spans, temporal_token_mask
from ._batching import length_sorted_batches, progress as _progress
from .encoder import POOLINGS, ROLES, _field, check_role, pool
from .checkpoint import CheckpointError, check_save_target, file_digest, finish_checkpoint, recover_dir, require_keys, sha256_file, verify_checkpoint, write_extra_files

FORMAT = "tempokern-tmrl-encoder"
VERSION = 1
CONFIG_FILE = "tempokern_tmrl.json"
BACKBONE_FILE = "backbone.safetensors"
PROJECTOR_FILE = "projector.safetensors"
TOKENIZER_DIR = "tokenizer"

#: LoRA defaults of TMRL §A.2 (A7): rank 4, "scaling factor 4" as peft's scaling lora_alpha / r = 4, so
#: lora_alpha = 16; the other reading (lora_alpha = 4, scaling 1) is ``lora={"lora_alpha": 4}``.
LORA_SCALING = 4
LORA_DEFAULTS = dict(r=4, lora_alpha=16, lora_dropout=0.1, target_modules="all-linear")
_LORA_FIELDS = ("r", "lora_alpha", "lora_dropout", "target_modules", "use_rslora", "bias", "modules_to_save")
PEFT_HINT = "LoRA needs the optional 'peft' package: pip install 'tempokern[peft]' (or pip install peft)"


def require_peft():
    try:
        import peft
    except ImportError as e:
        raise ImportError(f"{PEFT_HINT} ({e})", name="peft") from None
    return peft


class TMRLOutput(NamedTuple):
    """emb: raw pooled embeddings (B, d); temporal: the projected mean of the temporal tokens (B, t) or
    None (no temporal mask / no projector); has_temporal: (B,) bool, rows that have a temporal token."""
    emb: torch.Tensor
    temporal: Optional[torch.Tensor]
    has_temporal: Optional[torch.Tensor]


def _lora_dict(lora: Any) -> dict:
    """A plain JSON-able dict of LoRA settings from a dict or a peft.LoraConfig."""
    if isinstance(lora, dict):
        unknown = sorted(set(lora) - set(_LORA_FIELDS) - {"task_type"})
        if unknown:
            raise ValueError(f"lora: unknown LoRA option(s) {unknown}; known: {list(_LORA_FIELDS)}")
        d = {**LORA_DEFAULTS, **{k: v for k, v in lora.items() if k != "task_type"}}
        if lora.get("lora_alpha") is None and "r" in lora:   # keep the paper's scaling 4 at any rank
            d["lora_alpha"] = LORA_SCALING * d["r"] if isinstance(d["r"], int) else d["r"]
    else:
        d = {k: getattr(lora, k) for k in _LORA_FIELDS if hasattr(lora, k)}
    tm = d.get("target_modules")
    if isinstance(tm, (set, frozenset, tuple)):
        d["target_modules"] = sorted(tm)
    if d.get("modules_to_save") is not None:
        d["modules_to_save"] = list(d["modules_to_save"])
    r = d.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"lora: r must be a positive int, got {r!r}")
    if not d.get("lora_alpha", 0) > 0:
        raise ValueError(f"lora: lora_alpha must be > 0, got {d.get('lora_alpha')!r}")
    if not 0 <= d.get("lora_dropout", 0.0) < 1:
        raise ValueError(f"lora: lora_dropout must be in [0, 1), got {d.get('lora_dropout')!r}")
    return d


def _wrap_lora(backbone: nn.Module, settings: dict) -> nn.Module:
    peft = require_peft()
    cfg = peft.LoraConfig(task_type="FEATURE_EXTRACTION",
                          **{k: v for k, v in settings.items() if v is not None or k == "modules_to_save"})
    return peft.get_peft_model(backbone, cfg)


def _check_dims(dims, t, H) -> Tuple[Tuple[int, ...], Optional[int]]:
    if dims is None:
        dims = (H,)
    if isinstance(dims, int) or not all(isinstance(m, int) and not isinstance(m, bool) for m in dims):
        raise ValueError(f"dims must be a sequence of ints, got {dims!r}")
    dims = tuple(dims)
    if not dims or any(m < 1 or m > H for m in dims):
        raise ValueError(f"dims must be non-empty with every entry in 1..{H} (the hidden size), got {dims!r}")
    if any(b <= a for a, b in zip(dims, dims[1:])):
        raise ValueError(f"dims must be strictly increasing, got {dims!r}")
    if t is not None and (isinstance(t, bool) or not isinstance(t, int) or not 1 <= t <= H):
        raise ValueError(f"t must be None or an int in 1..{H}, got {t!r}")
    return dims, t


class TMRLEncoder(nn.Module):
    """Dual encoder for TMRL on any transformers backbone.

    backbone: a model name/path (AutoModel/AutoTokenizer) or a built PreTrainedModel (pass tokenizer=).
    pooling: "cls" | "mean" | "last" (:func:`tempokern.models.encoder.pool`); with "cls" the [CLS] token is a
    temporal token of every text (T4). dims: the nested prefix sizes (default: the full size only); t: the
    temporal-subspace size (None: no projector). lora: None = the TMRL default LoRA (r 4, lora_alpha 16,
    dropout 0.1, all linear layers; needs peft), a dict of LoRA options or a ``peft.LoraConfig``,
    False = frozen backbone (only the projector trains), "full" = full fine-tuning. A7: the paper's
    "scaling factor 4" is peft's scaling lora_alpha / r = 4 (lora_alpha 16 at r 4);
    ``lora={"lora_alpha": 4}`` is the other reading (scaling 1). temperature: the backbone's InfoNCE τ
    (TMRL Table 5: 0.05 for contriever / nomic, 0.02 for gte / bge / gte1.5 / bge-m3); the trainer reads it.
    query_prefix / passage_prefix: prepended to the texts of each role, "query" and "document" (Table 5).
    projector: build the TemporalProjector (P: h -> W2 LN(act(W1 h + b1)) + b2, act and LN eps from the
    backbone's config, A3) when t is given."""

    def __init__(self, backbone: Any, *, pooling: str = "cls", dims: Optional[Sequence[int]] = None,
                 t: Optional[int] = None, temperature: float = 0.05, lora: Any = None, query_prefix: str = "",
                 passage_prefix: str = "", max_length: int = 128, tokenizer: Any = None,
                 proj_hidden: Optional[int] = None, projector: bool = True):
        super().__init__()
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
            raise ValueError(f"max_length must be a positive int, got {max_length!r}")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature!r}")
        for name, v in (("query_prefix", query_prefix), ("passage_prefix", passage_prefix)):
            if not isinstance(v, str):
                raise TypeError(f"{name} must be a string, got {type(v).__name__}")
        if isinstance(backbone, str):
            from transformers import AutoModel, AutoTokenizer
            self.backbone_name = backbone
            if tokenizer is None:
                tokenizer = AutoTokenizer.from_pretrained(backbone)
            backbone = AutoModel.from_pretrained(backbone)
        else:
            self.backbone_name = getattr(getattr(backbone, "config", None), "_name_or_path", "") or ""
        if not isinstance(backbone, nn.Module) or not hasattr(backbone, "config"):
            raise TypeError("backbone must be a transformers model name/path or a PreTrainedModel, "
                            f"got {type(backbone).__name__}")
        self.backbone_config = backbone.config
        H = int(backbone.config.hidden_size)
        self.hidden_size = H
        self.dims, self.t = _check_dims(dims, t, H)
        self.pooling, self.temperature, self.max_length = pooling, float(temperature), max_length
        self.query_prefix, self.passage_prefix = query_prefix, passage_prefix
        self.tokenizer = tokenizer
        self.proj_hidden = proj_hidden
        # LoRA / full / frozen
        if lora is None:
            lora = dict(LORA_DEFAULTS)
        if lora is False:
            self.lora_mode, self.lora_settings = "none", None
            for p in backbone.parameters():
                p.requires_grad_(False)
        elif lora == "full":
            self.lora_mode, self.lora_settings = "full", None
            for p in backbone.parameters():
                p.requires_grad_(True)
        elif isinstance(lora, str) or isinstance(lora, bool):
            raise ValueError(f"lora must be None, False, 'full', a dict or a peft.LoraConfig, got {lora!r}")
        else:
            self.lora_mode, self.lora_settings = "lora", _lora_dict(lora)
            backbone = _wrap_lora(backbone, self.lora_settings)
        self.backbone = backbone
        self.projector = None
        if projector and self.t is not None:
            cfg = self.backbone_config
            act = getattr(cfg, "hidden_act", "gelu")
            self.projector = TemporalProjector(H, self.t, act=act if isinstance(act, str) else "gelu",
                                               layer_norm_eps=float(getattr(cfg, "layer_norm_eps", 1e-12)),
                                               proj_hidden=proj_hidden)

    # ---- configuration ------------------------------------------------------------------------------
    def config_dict(self) -> dict:
        return {"pooling": self.pooling, "dims": list(self.dims), "t": self.t, "temperature": self.temperature,
                "max_length": self.max_length, "query_prefix": self.query_prefix,
                "passage_prefix": self.passage_prefix, "proj_hidden": self.proj_hidden,
                "lora_mode": self.lora_mode, "lora": self.lora_settings, "backbone_name": self.backbone_name}

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def base_model(self) -> nn.Module:
        """The transformers model under the LoRA wrapper (the backbone itself without LoRA)."""
        if self.lora_mode == "lora":
            return self.backbone.get_base_model()
        return self.backbone

    def prefix(self, role: str) -> str:
        """The prefix of a role's texts: ``query_prefix`` for "query", ``passage_prefix`` for "document"."""
        check_role(role)
        return self.query_prefix if role == "query" else self.passage_prefix

    def check_dim(self, dim: Optional[int]) -> int:
        if dim is None:
            return self.hidden_size
        if isinstance(dim, bool) or not isinstance(dim, int) or not 1 <= dim <= self.hidden_size:
            raise ValueError(f"dim must be None or an int in 1..{self.hidden_size}, got {dim!r}")
        return dim

    # ---- forward ------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                temporal_mask: Optional[torch.Tensor] = None, **extra) -> TMRLOutput:
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, **extra)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        emb = pool(hidden, attention_mask, self.pooling)
        if temporal_mask is None or self.projector is None:
            return TMRLOutput(emb, None, None)
        if temporal_mask.shape != attention_mask.shape:
            raise ValueError(f"temporal_mask must have shape {tuple(attention_mask.shape)}, "
                             f"got {tuple(temporal_mask.shape)}")
        x_t, has = temporal_pool(hidden, temporal_mask.bool() & attention_mask.bool(), self.projector)
        return TMRLOutput(emb, x_t, has)

    # ---- text API -----------------------------------------------------------------------------------
    def tokenize(self, texts: Sequence[str], *, role: str = "query", temporal: bool = False,
                 spans: Optional[Sequence[Optional[Sequence[Tuple[int, int]]]]] = None) -> dict:
        """Token ids and attention mask of the role's prefixed texts; with temporal=True also the (B, L)
        temporal-token mask from character spans (per text: a list of (start, end) in the unprefixed
        text, or None to run the rule tagger ``tempokern.text.temporal_spans``)."""
        if self.tokenizer is None:
            raise ValueError("this TMRLEncoder has no tokenizer: pass tokenizer= when building it "
                             "from a PreTrainedModel")
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise TypeError("texts must be a list of strings")
        pre = self.prefix(role)
        full = [pre + t for t in texts]
        if not temporal:
            enc = self.tokenizer(cap_texts(full), padding=True, truncation=True, max_length=self.max_length,
                                 return_tensors="pt")
            return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
        if not getattr(self.tokenizer, "is_fast", False):
            raise ValueError("temporal token masks need a fast tokenizer (character offsets)")
        if spans is None:
            spans = [None] * len(texts)
        if len(spans) != len(texts):
            raise ValueError(f"spans has {len(spans)} entries for {len(texts)} texts")
        shifted = []
        for t, s in zip(texts, spans):
            if s is None:
                s = [(a, b) for a, b, *_ in temporal_spans(t)]
            shifted.append([(a + len(pre), b + len(pre)) for a, b, *_ in s])
        enc = self.tokenizer(cap_texts(full), padding=True, truncation=True, max_length=self.max_length,
                             return_tensors="pt", return_offsets_mapping=True)
        tmask = temporal_token_mask(enc, shifted, include_cls=self.pooling == "cls")
        tmask = torch.as_tensor(tmask, dtype=torch.bool) & enc["attention_mask"].bool()
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "temporal_mask": tmask}

    def encode(self, texts: Sequence[str], *, role: str = "query", dim: Optional[int] = None,
               batch_size: int = 64, device=None, progress: Optional[bool] = None) -> torch.Tensor:
        """L2-normalised embeddings (N, dim) float32 of the role's prefixed texts, first `dim`
        coordinates (default: all), in eval mode under ``torch.inference_mode``, in length-sorted batches
        each padded to its longest text (results in input order). ``progress``: show progress (default:
        :func:`tempokern.models._batching.set_progress`)."""
        dim = self.check_dim(dim)
        self.prefix(role)
        if isinstance(texts, str):
            raise TypeError("texts must be a list of strings")
        texts = list(texts)
        device = torch.device(device) if device is not None else self.device
        out = torch.empty(len(texts), dim)
        was_training = self.training
        self.eval()
        batches = length_sorted_batches(texts, batch_size)
        try:
            with torch.inference_mode():
                for idx in _progress(batches, len(batches), f"encode {role}s", progress):
                    batch = {k: v.to(device) for k, v in self.tokenize([texts[i] for i in idx], role=role).items()}
                    emb = self(**batch).emb
                    out[torch.as_tensor(idx)] = F.normalize(emb[:, :dim].float(), dim=-1).cpu()
        finally:
            self.train(was_training)
        return out

    def to_index(self, records: Sequence[Any], *, dim: Optional[int] = None, backend: str = "exact",
                 batch_size: int = 64, ids: Optional[Sequence[int]] = None, **index_kwargs):
        """Encode records (dicts or objects with `text`, and an int `id` unless `ids=` is given) as
        documents, truncated to `dim` and normalised, into a TemporalIndex (inner product = cosine;
        u = 0, no bias)."""
        dim = self.check_dim(dim)
        texts = [_field(r, "text") for r in records]
        if ids is None:
            raw = [_field(r, "id", None) for r in records]
            bad = next((x for x in raw if not (isinstance(x, int) and not isinstance(x, bool))), ...)
            if bad is not ...:
                raise ValueError(f"to_index: record id {bad!r} is not an int, and TemporalIndex stores int64 ids; "
                                 "pass ids= (e.g. ids=range(len(records))) and keep the records' own ids")
            ids = raw
        ids = torch.as_tensor(list(ids), dtype=torch.int64)
        if ids.numel() != len(texts):
            raise ValueError(f"ids has {ids.numel()} entries for {len(texts)} records")
        emb = self.encode(texts, role="document", dim=dim, batch_size=batch_size)
        index = TemporalIndex(dim, backend=backend, **index_kwargs)
        index.add(ids, emb, torch.zeros(len(texts)))
        return index

    def search(self, index, texts: Sequence[str], k: int = 10, *, dim: Optional[int] = None, **kw):
        """Top-k (ids, cosine scores) of query texts in an index built by :meth:`to_index` at `dim`."""
        dim = self.check_dim(dim if dim is not None else index.dim)
        if index.dim != dim:
            raise ValueError(f"the index holds {index.dim}-dim embeddings, dim is {dim}")
        q = self.encode(texts, role="query", dim=dim)
        return index.search(q, torch.zeros(q.shape[0]), k, **kw)

    # ---- LoRA ---------------------------------------------------------------------------------------
    def merge_lora(self) -> "TMRLEncoder":
        """Fold the LoRA updates into the base weights (peft ``merge_and_unload``, T10); a no-op without
        LoRA. The merged model saves and loads without peft."""
        if self.lora_mode == "lora":
            self.backbone = self.backbone.merge_and_unload()
            self.lora_mode = "merged"
        return self

    def trainable_parameters(self) -> List[Tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.named_parameters() if p.requires_grad]

    # ---- persistence --------------------------------------------------------------------------------
    def save(self, path, *, extra_files=None) -> None:
        """A directory: backbone.safetensors (with the LoRA weights, unmerged), projector.safetensors,
        tempokern_tmrl.json (config, backbone config, LoRA settings, SHA-256 of both weight files), the
        tokenizer, `extra_files` ({name: bytes}) and checksums.json over every file; written in a
        temporary sibling and swapped in atomically. `path` must be new, an empty directory or a
        checkpoint directory (FileExistsError otherwise)."""
        from safetensors.torch import save_model
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        recover_dir(path)
        check_save_target(path)
        tmp = Path(tempfile.mkdtemp(prefix=tmp_prefix(path.name), dir=path.parent))
        try:
            save_model(self.backbone, str(tmp / BACKBONE_FILE))
            sums = {BACKBONE_FILE: sha256_file(tmp / BACKBONE_FILE)}
            if self.projector is not None:
                save_model(self.projector, str(tmp / PROJECTOR_FILE))
                sums[PROJECTOR_FILE] = sha256_file(tmp / PROJECTOR_FILE)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(str(tmp / TOKENIZER_DIR))
            meta = {"format": FORMAT, "version": VERSION, "encoder": self.config_dict(),
                    "backbone_config": self.backbone_config.to_dict(), "sha256": sums,
                    "dtype": str(next(self.backbone.parameters()).dtype).replace("torch.", "")}
            (tmp / CONFIG_FILE).write_text(json.dumps(meta, indent=1, ensure_ascii=False, default=str))
            write_extra_files(tmp, extra_files)
            finish_checkpoint(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    @classmethod
    def load(cls, path, *, map_location="cpu", projector: bool = True,
             allow_missing_manifest: bool = False) -> "TMRLEncoder":
        """Rebuild a TMRLEncoder written by :meth:`save` (no model hub: the backbone comes from its stored
        config). Every file is verified against checksums.json first (allow_missing_manifest=True accepts
        a checkpoint saved without one, with a warning). projector=False skips the projector (inference;
        a saved model without one loads either way). A LoRA (unmerged) model needs peft: ImportError with
        the install hint otherwise."""
        return load_tmrl(path, map_location=map_location, projector=projector,
                         allow_missing_manifest=allow_missing_manifest)


def read_tmrl_config(path) -> dict:
    path = Path(path)
    recover_dir(path)
    cfg_file = path / CONFIG_FILE
    if not path.is_dir() or not cfg_file.exists():
        raise FileNotFoundError(f"{path} is not a saved TMRLEncoder (no {CONFIG_FILE})")
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
    require_keys(meta, cfg_file, (("encoder", dict), ("backbone_config", dict), ("sha256", dict)))
    for key in ("lora_mode", "lora"):
        if key not in meta["encoder"]:
            raise CheckpointError(f"{cfg_file}: 'encoder' has no {key!r} entry")
    if not isinstance(meta["backbone_config"].get("model_type"), str):
        raise CheckpointError(f"{cfg_file}: 'backbone_config' has no 'model_type' string")
    return meta


def is_tmrl_dir(path) -> bool:
    return (Path(path) / CONFIG_FILE).exists()


def _drop_absent_children(model: nn.Module, saved: set) -> None:
    """AutoModel.from_config may add submodules the saved backbone was built without (BERT's pooler):
    drop a child whose parameters are all absent from the saved names."""
    for name, child in list(model.named_children()):
        names = [f"{name}.{n}" for n, _ in child.named_parameters()]
        if names and not any(n in saved for n in names):
            setattr(model, name, None)


def load_tmrl(path, *, map_location="cpu", projector: bool = True, allow_missing_manifest: bool = False) -> TMRLEncoder:
    from safetensors import safe_open
    from safetensors.torch import load_model
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    path = Path(path)
    recover_dir(path)
    meta = read_tmrl_config(path)   # format and version first: a newer format is said as such
    # projector=False does not read the projector, so it is not hashed either
    digests = verify_checkpoint(path, allow_missing_manifest=allow_missing_manifest,
                                unread=() if projector else (PROJECTOR_FILE,))
    enc = dict(meta["encoder"])
    mode, settings = enc.pop("lora_mode"), enc.pop("lora")
    if mode == "lora":
        require_peft()
    sums = meta.get("sha256", {})
    files = [BACKBONE_FILE] + ([PROJECTOR_FILE] if projector and PROJECTOR_FILE in sums else [])
    for f in files:
        if not (path / f).exists():
            raise FileNotFoundError(f"{path / f} is missing")
        if file_digest(path, f, digests) != sums.get(f):
            raise ValueError(f"{path / f} does not match the checksum in {CONFIG_FILE} (file truncated or corrupted)")
    try:
        bcfg = dict(meta["backbone_config"])
        model_type = bcfg.pop("model_type")
        config = AutoConfig.for_model(model_type, **bcfg)
        base = AutoModel.from_config(config)
        dtype = getattr(torch, meta.get("dtype", "float32"), torch.float32)
        base = base.to(dtype)
        with safe_open(str(path / BACKBONE_FILE), framework="pt") as f:
            saved = set(f.keys())
        if mode == "lora":
            base_names = {k[len("base_model.model."):].replace(".base_layer.", ".")
                          for k in saved if k.startswith("base_model.model.") and ".lora_" not in k}
        else:
            base_names = saved
        _drop_absent_children(base, base_names)
        tok = AutoTokenizer.from_pretrained(str(path / TOKENIZER_DIR)) if (path / TOKENIZER_DIR).exists() else None
        backbone_name = enc.pop("backbone_name", "")
        has_proj = PROJECTOR_FILE in sums
        lora = settings if mode == "lora" else ("full" if mode == "full" else False)
        model = TMRLEncoder(base, tokenizer=tok, lora=lora, projector=projector and has_proj, **enc)
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise CheckpointError(f"{path / CONFIG_FILE}: the model cannot be rebuilt from this config: "
                              f"{type(e).__name__}: {e}") from None
    if mode == "merged":
        model.lora_mode = "merged"
    model.backbone_name = backbone_name
    model.to(dtype)
    missing, unexpected = load_model(model.backbone, str(path / BACKBONE_FILE), strict=False,
                                     device=str(map_location))
    if missing or unexpected:
        raise ValueError(f"{path / BACKBONE_FILE} does not fit the backbone rebuilt from {CONFIG_FILE}: missing "
                         f"{sorted(missing)[:8]}, unexpected {sorted(unexpected)[:8]}")
    if model.projector is not None:
        missing, unexpected = load_model(model.projector, str(path / PROJECTOR_FILE), strict=True,
                                         device=str(map_location))
    return model.to(map_location)
