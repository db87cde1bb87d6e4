"""TemporalIndex: records (int64 id, embedding, calendar position u) searched under the full
CTD score s = q . g / temperature + bias(u_g - u_q); exact scan or faiss first stage + rerank."""
from __future__ import annotations

from typing import Optional

import torch

from .._ops.ctd_topk import ctd_rerank, ctd_topk
from ..nn.offset_bias import bias_params
from ..reference.ctd_topk import offset_bias as _ref_offset_bias
from ..reference.ctd_topk import table_bias as _ref_table_bias
from . import _faiss
from ._format import IndexFormatError, dump, read

BACKENDS = ("exact", "faiss-flat", "faiss-ivf", "faiss-hnsw")
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
                torch.float64: "float64"}


class TemporalIndex:
    """A searchable gallery of (id, embedding, u) records.

    backend: "exact" (every record scored by the fused :func:`tempokern.ctd_topk`), or a faiss
    first stage by inner product ("faiss-flat", "faiss-ivf", "faiss-hnsw") whose `candidates`
    per query are reranked under the full CTD score. faiss is optional and imported lazily
    (``pip install tempokern[faiss]`` or ``[faiss-gpu]``).
    device: where embeddings live and the exact scan / rerank runs ("cpu" or "cuda[:n]"); with a
    CUDA device and a faiss build with GPU support, flat and IVF indexes run on the GPU.
    dtype: storage dtype of the embeddings (float32, float16, bfloat16, float64).
    nlist / nprobe: IVF lists and lists probed; hnsw_m / ef_search: HNSW graph degree and search
    breadth."""

    def __init__(self, dim: int, *, backend: str = "exact", device="cpu", dtype: torch.dtype = torch.float32,
                 nlist: int = 1024, nprobe: int = 32, hnsw_m: int = 32, ef_search: int = 128):
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim must be an int >= 1, got {dim!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if dtype not in _DTYPE_NAMES:
            raise TypeError(f"dtype must be one of {tuple(_DTYPE_NAMES)}, got {dtype}")
        for name, v in (("nlist", nlist), ("nprobe", nprobe), ("hnsw_m", hnsw_m), ("ef_search", ef_search)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        device = torch.device(device)
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {device}")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device is cuda but torch sees no CUDA device")
        if backend != "exact":
            _faiss.require()  # fail now, with the install hint, not at the first search
        self.dim, self.backend, self.device, self.dtype = dim, backend, device, dtype
        self.options = {"nlist": nlist, "nprobe": nprobe, "hnsw_m": hnsw_m, "ef_search": ef_search}
        self._ids = torch.empty(0, dtype=torch.int64, device=device)
        self._u = torch.empty(0, dtype=torch.float32, device=device)
        self._emb = torch.empty(0, dim, dtype=dtype, device=device)
        self._faiss = None  # rebuilt lazily when stale
        #: the fingerprint of the encoder that built the index (tempokern.models.fingerprint), saved with it
        self.model: Optional[dict] = None

    # ---- records --------------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self._ids.shape[0])

    def __repr__(self) -> str:
        return (f"TemporalIndex(dim={self.dim}, backend={self.backend!r}, device={str(self.device)!r}, "
                f"dtype={self.dtype}, records={len(self)})")

    @property
    def ids(self) -> torch.Tensor:
        return self._ids

    def add(self, ids, emb: torch.Tensor, u: torch.Tensor) -> None:
        """Adds records; ids are arbitrary int64 values, unique and not already present."""
        ids = torch.as_tensor(ids)
        if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
            raise TypeError(f"ids must be a 1-D integer tensor, got {ids.dtype} of shape {tuple(ids.shape)}")
        n = ids.shape[0]
        if not isinstance(emb, torch.Tensor) or not emb.is_floating_point():
            raise TypeError("emb must be a floating-point tensor of shape (n, dim)")
        if emb.dim() != 2 or emb.shape != (n, self.dim):
            raise ValueError(f"emb must have shape ({n}, {self.dim}) (n = len(ids), dim), got {tuple(emb.shape)}")
        if not isinstance(u, torch.Tensor) or not u.is_floating_point():
            raise TypeError("u must be a floating-point tensor of shape (n,)")
        if u.shape != (n,):
            raise ValueError(f"u must have shape ({n},) (one calendar position per id), got {tuple(u.shape)}")
        ids = ids.to(torch.int64).to(self.device)
        if n == 0:
            return
        if torch.unique(ids).shape[0] != n:
            raise ValueError("ids must be unique within one add() call")
        dup = torch.isin(ids, self._ids)
        if bool(dup.any()):
            raise ValueError(f"ids already in the index: {ids[dup][:5].tolist()} (remove them first)")
        if not bool(torch.isfinite(emb).all()) or not bool(torch.isfinite(u).all()):
            raise ValueError("emb and u must be finite")
        new_emb = emb.detach().to(self.device, self.dtype)
        self._ids = torch.cat([self._ids, ids])
        self._u = torch.cat([self._u, u.detach().to(self.device, torch.float32)])
        self._emb = torch.cat([self._emb, new_emb])
        if self._faiss is not None and not self._faiss.add(new_emb):
            self._faiss = None

    def remove(self, ids) -> int:
        """Removes records by id; unknown ids raise ValueError and nothing is removed. Returns the count."""
        ids = torch.as_tensor(ids).reshape(-1)
        if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
            raise TypeError(f"ids must be integers, got {ids.dtype}")
        ids = ids.to(torch.int64).to(self.device)
        known = torch.isin(ids, self._ids)
        if not bool(known.all()):
            raise ValueError(f"ids not in the index: {ids[~known][:5].tolist()}")
        keep = ~torch.isin(self._ids, ids)
        removed = int((~keep).sum())
        self._ids, self._u, self._emb = self._ids[keep], self._u[keep], self._emb[keep]
        self._faiss = None
        return removed

    # ---- search ---------------------------------------------------------------------------------
    def search(self, q: torch.Tensor, u_q: torch.Tensor, k: int, *, candidates: Optional[int] = None, bias=None,
               temperature: float = 1.0):
        """Top-k records per query under s = q . g / temperature + bias(u_g - u_q).

        bias: None, a :class:`tempokern.nn.OffsetBias` (exact), or its ``table(...)`` (interpolated).
        candidates: faiss backends only, how many inner-product neighbours per query are reranked
        (default max(4k, 64), at most len(self)). Returns (ids (Q, k) int64, scores (Q, k) float32),
        best first, ties by insertion order; slots without a record (faiss found fewer) are (-1, -inf)."""
        if len(self) == 0:
            raise ValueError("the index is empty: add() records before search()")
        if isinstance(q, torch.Tensor) and q.dim() == 2 and q.shape[1] != self.dim:
            raise ValueError(f"q has dimension {q.shape[1]} but the index holds dimension-{self.dim} embeddings "
                             f"(q must be a (Q, {self.dim}) tensor; was the index built by another encoder?)")
        if not isinstance(q, torch.Tensor) or q.dim() != 2:
            raise ValueError(f"q must be a (Q, {self.dim}) tensor, got "
                             f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
        Q = q.shape[0]
        if not isinstance(u_q, torch.Tensor) or u_q.shape != (Q,):
            raise ValueError(f"u_q must have shape ({Q},), one calendar position per query, got "
                             f"{tuple(u_q.shape) if isinstance(u_q, torch.Tensor) else type(u_q).__name__}")
        for name, t in (("q", q), ("u_q", u_q)):
            if not t.is_floating_point():
                raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
            bad = ~torch.isfinite(t)
            if bool(bad.any()):
                rows = bad.reshape(Q, -1).any(dim=1).nonzero().flatten()[:5].tolist()
                raise ValueError(f"{name} must be finite: query row(s) {rows} hold NaN or inf")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be an int >= 1, got {k!r}")
        if k > len(self):
            raise ValueError(f"k must be <= the number of records {len(self)}, got {k}")
        q = q.detach().to(self.device, self.dtype)
        u_q = u_q.detach().to(self.device, torch.float32)
        bias_args = _bias_args(bias, u_q, self._u, self.device)
        if self.backend == "exact":
            scores, pos = ctd_topk(q, self._emb, k, temperature=temperature, bias=bias_args)
        else:
            if candidates is None:
                candidates = max(4 * k, 64)
            if isinstance(candidates, bool) or not isinstance(candidates, int) or candidates < k:
                raise ValueError(f"candidates must be an int >= k={k}, got {candidates!r}")
            candidates = min(candidates, len(self))
            cand = self._first_stage(q, candidates)
            if self.device.type == "cpu":  # fused C++ rerank of each query's own candidates
                scores, pos = ctd_rerank(q, self._emb, cand, k, temperature=temperature, bias=bias_args)
            else:
                scores, pos = _rerank(q, self._emb, cand, k, temperature, bias_args)
        ids = torch.where(pos >= 0, self._ids[pos.clamp_min(0)], torch.full_like(pos, -1))
        return ids, scores.to(torch.float32)

    def _first_stage(self, q: torch.Tensor, c: int) -> torch.Tensor:
        if self._faiss is None:
            self._faiss = _faiss.build(self.backend, self.dim, self._emb, self.device, self.options)
        return self._faiss.search(q, c).to(self.device)

    # ---- persistence ----------------------------------------------------------------------------
    def save(self, path) -> None:
        """Writes the index atomically (temporary file, fsync, rename) with a SHA-256 checksum."""
        meta = {"dim": self.dim, "backend": self.backend, "device": str(self.device),
                "dtype": _DTYPE_NAMES[self.dtype], "count": len(self), "options": self.options}
        if self.model is not None:
            meta["model"] = self.model
        dump(path, meta, self._ids, self._u, self._emb)

    @classmethod
    def load(cls, path, *, device=None, backend: Optional[str] = None) -> "TemporalIndex":
        """Reads an index written by save(); a truncated, corrupted or other-version file raises
        IndexFormatError (a ValueError) and nothing is returned. device/backend override the saved ones."""
        meta, ids, u, emb = read(path)
        where = f"'{path}' has invalid metadata"
        if not isinstance(meta, dict):
            raise IndexFormatError(f"{where}: expected a JSON object")
        raw_opts = meta.get("options", {})
        if not isinstance(raw_opts, dict):
            raise IndexFormatError(f"{where}: 'options' must be an object, got {raw_opts!r}")
        saved_device = meta.get("device", "cpu")
        if device is None:
            if not isinstance(saved_device, str):
                raise IndexFormatError(f"{where}: 'device' must be a string, got {saved_device!r}")
            try:
                device = torch.device(saved_device)
            except (RuntimeError, ValueError, TypeError):
                raise IndexFormatError(f"{where}: 'device' {saved_device!r} is not a device name") from None
        if backend is None and meta.get("backend") not in BACKENDS:
            raise IndexFormatError(f"{where}: 'backend' must be one of {BACKENDS}, got {meta.get('backend')!r}")
        try:
            opts = {k: int(v) for k, v in raw_opts.items() if k in ("nlist", "nprobe", "hnsw_m", "ef_search")}
            out = cls(meta["dim"], backend=backend or meta["backend"], device=device, dtype=emb.dtype, **opts)
        except (KeyError, TypeError) as e:
            raise IndexFormatError(f"{where}: {e}") from None
        except ValueError as e:       # e.g. an out-of-range option, or a CUDA device this machine lacks
            raise IndexFormatError(f"'{path}' cannot be loaded: {e}") from None
        if ids.numel() and torch.unique(ids).shape[0] != ids.shape[0]:
            raise IndexFormatError(f"'{path}' holds duplicate ids")
        out._ids, out._u, out._emb = ids.to(out.device), u.to(out.device), emb.to(out.device)
        fp = meta.get("model")
        if fp is not None and not isinstance(fp, dict):
            raise IndexFormatError(f"{where}: 'model' must be an object (the encoder's fingerprint), got {fp!r}")
        out.model = fp
        return out


def _bias_args(bias, u_q: torch.Tensor, u_g: torch.Tensor, device):
    if bias is None:
        return None
    if hasattr(bias, "mlp") and hasattr(bias, "scale"):  # tempokern.nn.OffsetBias (duck-typed)
        p = [torch.as_tensor(t).detach().to(device) for t in bias_params(bias)]
        return (u_q, u_g, *p)
    if isinstance(bias, torch.Tensor) or hasattr(bias, "values"):  # OffsetBias.table(...)
        values = bias if isinstance(bias, torch.Tensor) else bias.values
        return (u_q, u_g, values.detach().to(device))
    raise TypeError("bias must be None, a tempokern.nn.OffsetBias or its table(...), "
                    f"got {type(bias).__name__}")


def _rerank(q, emb, cand, k, temperature, bias_args, block_bytes: int = 1 << 26):
    """Scores each query's own candidates (Q, C) under the full CTD score and keeps the k best (ties by
    lower record position); -1 / duplicate candidates are ignored. The CUDA rerank, and the spec the C++
    rerank (ctd_rerank) is tested against. Query blocks keep the gathered (Qb, C, H) slice bounded."""
    Q, C = cand.shape
    acc = torch.float64 if emb.dtype == torch.float64 else torch.float32
    # positions ascending within a row, then a stable sort by score: ties go to the lower position
    cand = torch.where(cand < 0, torch.full_like(cand, torch.iinfo(torch.int64).max), cand).sort(dim=1).values
    valid = cand != torch.iinfo(torch.int64).max
    valid[:, 1:] &= cand[:, 1:] != cand[:, :-1]  # a repeated candidate counts once
    cand = torch.where(valid, cand, torch.zeros_like(cand))
    H = emb.shape[1]
    width = H + (bias_args[2].shape[0] + bias_args[2].shape[1] if bias_args and len(bias_args) == 7 else 0)
    qb = max(1, block_bytes // max(1, C * width * 4))
    out_v, out_i = [], []
    for a in range(0, Q, qb):
        b = min(Q, a + qb)
        g = emb[cand[a:b]].to(acc)                                   # (Qb, C, H)
        s = torch.bmm(g, q[a:b].to(acc).unsqueeze(-1)).squeeze(-1) / temperature
        if bias_args is not None:
            u_q, u_g = bias_args[0][a:b], bias_args[1]
            ug = u_g[cand[a:b]]                                     # (Qb, C)
            if len(bias_args) == 7:
                w1, b1, w2, b2, sc = bias_args[2:]
                bias_v = _pair_offset_bias(u_q, ug, w1, b1, w2, b2, sc)
            else:
                bias_v = _pair_table_bias(u_q, ug, bias_args[2])
            s = s + bias_v.to(acc)
        s = s.masked_fill(~valid[a:b], float("-inf"))
        order = torch.sort(s, dim=1, descending=True, stable=True).indices[:, :k]
        v = s.gather(1, order)
        p = cand[a:b].gather(1, order)
        p = torch.where(v == float("-inf"), torch.full_like(p, -1), p)
        if v.shape[1] < k:
            pad = k - v.shape[1]
            v = torch.cat([v, v.new_full((v.shape[0], pad), float("-inf"))], 1)
            p = torch.cat([p, p.new_full((p.shape[0], pad), -1)], 1)
        out_v.append(v)
        out_i.append(p)
    return torch.cat(out_v), torch.cat(out_i)


def _pair_offset_bias(u_q, ug, w1, b1, w2, b2, scale):
    """The exact bias for per-query candidate lists (row r against ug[r, :]): the bias depends on
    delta = u_g - u_q only, so one (1, Qb*C) grid with u_q = 0 and u_g = delta gives the same values."""
    d = ug - u_q[:, None]
    flat = _ref_offset_bias(torch.zeros(1, dtype=d.dtype, device=d.device), d.reshape(-1), w1, b1, w2, b2, scale)
    return flat.reshape(d.shape)


def _pair_table_bias(u_q, ug, table):
    d = ug - u_q[:, None]
    flat = _ref_table_bias(torch.zeros(1, dtype=d.dtype, device=d.device), d.reshape(-1), table)
    return flat.reshape(d.shape)
