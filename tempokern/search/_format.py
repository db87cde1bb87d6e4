"""On-disk format of a TemporalIndex (version 1), written atomically and verified on load.

    magic      8 bytes   b"TKINDEX\\0"
    version    uint32 LE
    meta_len   uint64 LE
    meta       meta_len bytes of UTF-8 JSON: dim, backend, device, dtype, count, options
    ids        count x int64 LE
    u          count x float32 LE
    emb        count x dim values of `dtype`, little-endian (bfloat16/float16 as raw 16-bit words)
    checksum   32 bytes: SHA-256 of everything above

faiss structures are not stored: they are rebuilt from the embeddings on load (deterministic
for flat and HNSW; IVF k-means uses faiss's fixed default seed)."""
from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from pathlib import Path

import numpy as np
import torch

from .._files import sweep_tmp, tmp_prefix
from .._util import default_mode

MAGIC = b"TKINDEX\0"
VERSION = 1
_HEAD = struct.Struct("<8sIQ")
_DTYPES = {"float32": (torch.float32, 4), "float16": (torch.float16, 2), "bfloat16": (torch.bfloat16, 2),
           "float64": (torch.float64, 8)}


class IndexFormatError(ValueError):
    """A file that is not a valid TemporalIndex of a supported version (truncated, corrupted, other version)."""


def _raw(t: torch.Tensor) -> bytes:
    t = t.detach().to("cpu").contiguous()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    return t.numpy().astype(t.numpy().dtype.newbyteorder("<"), copy=False).tobytes()


def dump(path, meta: dict, ids: torch.Tensor, u: torch.Tensor, emb: torch.Tensor) -> None:
    path = Path(path)
    meta_b = json.dumps(meta, sort_keys=True).encode("utf-8")
    parts = [_HEAD.pack(MAGIC, VERSION, len(meta_b)), meta_b, _raw(ids.to(torch.int64)), _raw(u.to(torch.float32)),
             _raw(emb)]
    h = hashlib.sha256()
    for b in parts:
        h.update(b)
    parts.append(h.digest())
    directory = path.parent if str(path.parent) else Path(".")
    sweep_tmp(path)   # what an interrupted save of this index left
    fd, tmp = tempfile.mkstemp(prefix=tmp_prefix(path.name), suffix=".tmp", dir=directory)
    try:
        os.fchmod(fd, default_mode())     # a plain write's permissions, not mkstemp's 0600
        with os.fdopen(fd, "wb") as f:
            for b in parts:
                f.write(b)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:  # make the rename itself durable
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def read(path):
    """Returns (meta, ids int64, u float32, emb) or raises IndexFormatError; never a partial result."""
    path = Path(path)
    sweep_tmp(path)
    data = path.read_bytes()
    where = f"'{path}'"
    if len(data) < _HEAD.size or data[:8] != MAGIC:
        raise IndexFormatError(f"{where} is not a tempokern TemporalIndex file (bad magic or too short)")
    magic, version, meta_len = _HEAD.unpack_from(data, 0)
    if version != VERSION:
        raise IndexFormatError(f"{where} has TemporalIndex format version {version}; this tempokern reads "
                               f"version {VERSION} (re-save it with a matching tempokern version)")
    if len(data) < _HEAD.size + 32 or len(data) < _HEAD.size + meta_len + 32:
        raise IndexFormatError(f"{where} is truncated ({len(data)} bytes)")
    body, digest = data[:-32], data[-32:]
    if hashlib.sha256(body).digest() != digest:
        raise IndexFormatError(f"{where} is corrupted or truncated: checksum mismatch")
    try:
        meta = json.loads(body[_HEAD.size:_HEAD.size + meta_len].decode("utf-8"))
        dim, count = int(meta["dim"]), int(meta["count"])
        dtype, width = _DTYPES[meta["dtype"]]
    except (ValueError, KeyError, TypeError) as e:
        raise IndexFormatError(f"{where} has invalid metadata: {e}") from None
    off = _HEAD.size + meta_len
    need = off + count * (8 + 4 + dim * width)
    if need != len(body) or dim < 1 or count < 0:
        raise IndexFormatError(f"{where} has {len(body) - off} payload bytes, expected {need - off} for "
                               f"{count} records of dim {dim}")
    buf = memoryview(body)
    ids = torch.from_numpy(np.frombuffer(buf, dtype="<i8", count=count, offset=off).copy())
    off += 8 * count
    u = torch.from_numpy(np.frombuffer(buf, dtype="<f4", count=count, offset=off).copy())
    off += 4 * count
    if dtype in (torch.bfloat16, torch.float16):
        emb = torch.from_numpy(np.frombuffer(buf, dtype="<i2", count=count * dim, offset=off).copy()).view(dtype)
    else:
        emb = torch.from_numpy(np.frombuffer(buf, dtype="<f4" if width == 4 else "<f8", count=count * dim,
                                             offset=off).copy())
    return meta, ids, u, emb.reshape(count, dim)
