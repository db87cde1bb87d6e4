"""Optional faiss first stage, imported lazily so tempokern works without faiss."""
from __future__ import annotations

import numpy as np
import torch

_INSTALL = ("the faiss backends need faiss: pip install 'tempokern[faiss]' (faiss-cpu) or "
            "'tempokern[faiss-gpu]' (faiss-gpu-cu12); only one of them may be installed")


def require():
    try:
        import faiss  # noqa: F401
    except ImportError as e:
        raise ImportError(f"{_INSTALL} ({e})") from None
    return faiss


def _gpu_ok(faiss, device: torch.device) -> bool:
    return device.type == "cuda" and hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


def _np32(x: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(x.detach().to("cpu", torch.float32).numpy())


class FaissStage:
    """An inner-product faiss index over the record positions 0..n-1 (in insertion order)."""

    def __init__(self, index, backend: str, keep=()):
        self.index, self.backend = index, backend
        self._keep = keep  # the IVF quantizer and GPU resources must outlive the index

    def add(self, emb: torch.Tensor) -> bool:
        """Appends rows; False when the index must be rebuilt instead (IVF trained on too few points)."""
        if self.backend == "faiss-ivf":
            return False
        self.index.add(_np32(emb))
        return True

    def search(self, q: torch.Tensor, c: int) -> torch.Tensor:
        _, pos = self.index.search(_np32(q), c)
        return torch.from_numpy(pos.astype(np.int64))


def build(backend: str, dim: int, emb: torch.Tensor, device: torch.device, options: dict) -> FaissStage:
    faiss = require()
    x = _np32(emb)
    n = x.shape[0]
    if backend == "faiss-flat":
        index = faiss.IndexFlatIP(dim)
    elif backend == "faiss-ivf":
        nlist = max(1, min(options["nlist"], n // 39 if n >= 39 else 1))  # faiss wants ~39 points per list
        quant = faiss.IndexFlatIP(dim)
        index = faiss.IndexIVFFlat(quant, dim, nlist, faiss.METRIC_INNER_PRODUCT)
        index.train(x)
        index.nprobe = min(options["nprobe"], nlist)
    elif backend == "faiss-hnsw":
        index = faiss.IndexHNSWFlat(dim, options["hnsw_m"], faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efSearch = options["ef_search"]
    else:
        raise ValueError(f"unknown faiss backend {backend!r}")
    res = None
    if backend != "faiss-hnsw" and _gpu_ok(faiss, device):
        res = faiss.StandardGpuResources()
        index = faiss.index_cpu_to_gpu(res, device.index or 0, index)
    index.add(x)
    return FaissStage(index, backend, keep=(quant if backend == "faiss-ivf" else None, res))
