"""TemporalIndex: every backend on small galleries, persistence (round trip, corruption,
truncation, other version, atomic write), bad inputs."""
import struct

import pytest
import torch

from tempokern.reference import ctd_topk as ref_topk
from tempokern.search import IndexFormatError, TemporalIndex
from tempokern.search import _format

try:
    import faiss  # noqa: F401
    HAVE_FAISS = True
except ImportError:
    HAVE_FAISS = False

FAISS_BACKENDS = ["faiss-flat", "faiss-ivf", "faiss-hnsw"]
needs_faiss = pytest.mark.skipif(not HAVE_FAISS, reason="faiss is not installed")


class FakeOffsetBias(torch.nn.Module):
    """Shaped like tempokern.nn.OffsetBias: .mlp = Linear, ReLU, Linear; .scale."""

    def __init__(self, features=32, hidden=32, scale=0.8):
        super().__init__()
        torch.manual_seed(11)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))
        self.scale = torch.nn.Parameter(torch.tensor(scale))


def gallery(n=600, dim=24, seed=0):
    """Random unique int64 ids (shuffled), unit-norm embeddings (a record is its own best match)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(-2 ** 63, 2 ** 63 - 1, (n,), generator=gen, dtype=torch.int64)
    ids = torch.unique(ids)[:n]
    n = ids.shape[0]
    ids = ids[torch.randperm(n, generator=gen)]
    emb = torch.nn.functional.normalize(torch.randn(n, dim, generator=gen), dim=1)
    return ids, emb, torch.rand(n, generator=gen)


def bias_tuple(bias, u_q, u_g):
    if bias is None:
        return None
    if isinstance(bias, torch.Tensor):
        return (u_q, u_g, bias)
    l1, l2 = bias.mlp[0], bias.mlp[2]
    return (u_q, u_g, l1.weight.detach(), l1.bias.detach(), l2.weight.detach(), l2.bias.detach(), bias.scale.detach())


@pytest.mark.parametrize("bias_kind", [None, "exact", "table"])
@pytest.mark.parametrize("backend", ["exact"] + [pytest.param(b, marks=needs_faiss) for b in FAISS_BACKENDS])
def test_backend_matches_reference_when_all_candidates_are_reranked(backend, bias_kind):
    ids, emb, u = gallery()
    ix = TemporalIndex(emb.shape[1], backend=backend, nlist=8, nprobe=8, ef_search=600)
    ix.add(ids[:300], emb[:300], u[:300])
    ix.add(ids[300:], emb[300:], u[300:])  # two batches: incremental add
    assert len(ix) == ids.shape[0]
    torch.manual_seed(1)
    q, u_q = torch.randn(7, emb.shape[1]), torch.rand(7)
    bias = {None: None, "exact": FakeOffsetBias(), "table": torch.randn(129)}[bias_kind]
    got_ids, got_s = ix.search(q, u_q, 10, candidates=len(ix), bias=bias, temperature=0.7)
    rv, ri = ref_topk(q, emb, 10, temperature=0.7, bias=bias_tuple(bias, u_q, u))
    torch.testing.assert_close(got_s, rv, atol=1e-4, rtol=0)
    if backend in ("exact", "faiss-flat"):  # every record is a candidate: identical ids
        assert torch.equal(got_ids, ids[ri])
    else:  # approximate first stage: found ids are real and carry their true score
        pos = {int(x): i for i, x in enumerate(ids)}
        for r in range(7):
            for j in range(10):
                if got_ids[r, j] >= 0:
                    p = pos[int(got_ids[r, j])]
                    s = q[r] @ emb[p] / 0.7
                    if bias is not None:
                        s = s + _ref_bias(bias, u_q[r:r + 1], u[p:p + 1])
                    assert abs(float(s) - float(got_s[r, j])) < 1e-4


def _ref_bias(bias, u_q, u_g):
    from tempokern.reference.ctd_topk import ctd_scores
    return ctd_scores(torch.zeros(1, 1), torch.zeros(1, 1), bias=bias_tuple(bias, u_q, u_g))[0, 0]


@needs_faiss
@pytest.mark.parametrize("backend", FAISS_BACKENDS)
def test_faiss_rerank_reorders_candidates(backend):
    # the bias must change the order the inner-product stage produced
    ids, emb, u = gallery(400, 16, seed=3)
    ix = TemporalIndex(16, backend=backend, nlist=4, nprobe=4)
    ix.add(ids, emb, u)
    q, u_q = torch.randn(3, 16), torch.zeros(3)
    table = torch.linspace(-50, 50, 33)  # strongly prefers later u_g
    plain, _ = ix.search(q, u_q, 5, candidates=100)
    biased, s = ix.search(q, u_q, 5, candidates=100, bias=table)
    assert not torch.equal(plain, biased)
    assert bool((s[:, :-1] >= s[:, 1:]).all())


def test_remove_and_len():
    ids, emb, u = gallery(50, 8)
    ix = TemporalIndex(8)
    ix.add(ids, emb, u)
    q = emb[:2] * 10
    top, _ = ix.search(q, torch.zeros(2), 1)
    assert torch.equal(top[:, 0], ids[:2])
    assert ix.remove(ids[:1]) == 1 and len(ix) == 49
    top, _ = ix.search(q, torch.zeros(2), 1)
    assert int(top[0, 0]) != int(ids[0]) and int(top[1, 0]) == int(ids[1])
    with pytest.raises(ValueError, match="not in the index"):
        ix.remove(torch.tensor([ids[0], ids[5]]))
    assert len(ix) == 49  # nothing removed by a failed call


@needs_faiss
def test_faiss_index_rebuilt_after_remove():
    ids, emb, u = gallery(200, 8)
    ix = TemporalIndex(8, backend="faiss-flat")
    ix.add(ids, emb, u)
    q = emb[:3] * 10
    top, _ = ix.search(q, torch.zeros(3), 1)
    assert torch.equal(top[:, 0], ids[:3])
    ix.remove(ids[1:2])
    top, _ = ix.search(q, torch.zeros(3), 1)
    assert int(top[1, 0]) != int(ids[1]) and int(top[0, 0]) == int(ids[0]) and int(top[2, 0]) == int(ids[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_save_load_round_trip(tmp_path, dtype):
    ids, emb, u = gallery(123, 12)
    ids[0], ids[1] = 2 ** 63 - 1, -2 ** 63  # the extremes survive
    ix = TemporalIndex(12, dtype=dtype)
    ix.add(ids, emb, u)
    path = tmp_path / "ix.tki"
    ix.save(path)
    back = TemporalIndex.load(path)
    assert len(back) == len(ix) and back.dtype == dtype and back.backend == "exact"
    assert torch.equal(back.ids, ix.ids) and torch.equal(back._emb, ix._emb) and torch.equal(back._u, ix._u)
    q = torch.randn(4, 12)
    assert torch.equal(ix.search(q, torch.zeros(4), 5)[0], back.search(q, torch.zeros(4), 5)[0])
    assert not list(tmp_path.glob("*.tmp"))  # no temporary left behind


@needs_faiss
def test_save_load_keeps_backend_and_options(tmp_path):
    ids, emb, u = gallery(300, 8)
    ix = TemporalIndex(8, backend="faiss-ivf", nlist=5, nprobe=3)
    ix.add(ids, emb, u)
    ix.save(tmp_path / "f.tki")
    back = TemporalIndex.load(tmp_path / "f.tki")
    assert back.backend == "faiss-ivf" and back.options["nlist"] == 5 and back.options["nprobe"] == 3
    q = torch.randn(3, 8)
    assert torch.equal(ix.search(q, torch.zeros(3), 4)[0], back.search(q, torch.zeros(3), 4)[0])


def _saved(tmp_path):
    ids, emb, u = gallery(40, 6)
    ix = TemporalIndex(6)
    ix.add(ids, emb, u)
    path = tmp_path / "ix.tki"
    ix.save(path)
    return path


def test_corrupted_file_raises(tmp_path):
    path = _saved(tmp_path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit in the embeddings
    path.write_bytes(bytes(data))
    with pytest.raises(IndexFormatError, match="checksum"):
        TemporalIndex.load(path)


@pytest.mark.parametrize("keep", [0, 5, 30, -1, -33])
def test_truncated_file_raises(tmp_path, keep):
    path = _saved(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:keep] if keep >= 0 else data[:len(data) + keep])
    with pytest.raises(IndexFormatError):
        TemporalIndex.load(path)


def test_other_format_version_raises(tmp_path):
    path = _saved(tmp_path)
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, 8, _format.VERSION + 1)
    path.write_bytes(bytes(data))
    with pytest.raises(IndexFormatError, match=f"version {_format.VERSION + 1}"):
        TemporalIndex.load(path)


def test_not_an_index_file(tmp_path):
    p = tmp_path / "x.tki"
    p.write_bytes(b"hello world, definitely not an index")
    with pytest.raises(IndexFormatError, match="not a tempokern"):
        TemporalIndex.load(p)


def test_failed_save_keeps_previous_file(tmp_path, monkeypatch):
    path = _saved(tmp_path)
    before = path.read_bytes()
    ids, emb, u = gallery(10, 6, seed=9)
    ix = TemporalIndex(6)
    ix.add(ids, emb, u)

    def boom(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(_format.os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        ix.save(path)
    assert path.read_bytes() == before and not list(tmp_path.glob("*.tmp"))


def test_bad_inputs():
    ix = TemporalIndex(4)
    with pytest.raises(ValueError, match="empty"):
        ix.search(torch.randn(1, 4), torch.zeros(1), 1)
    with pytest.raises(ValueError, match=r"emb must have shape \(3, 4\)"):
        ix.add(torch.arange(3), torch.randn(3, 5), torch.rand(3))
    with pytest.raises(ValueError, match=r"u must have shape \(3,\)"):
        ix.add(torch.arange(3), torch.randn(3, 4), torch.rand(2))
    with pytest.raises(TypeError, match="ids must be a 1-D integer"):
        ix.add(torch.rand(3), torch.randn(3, 4), torch.rand(3))
    with pytest.raises(ValueError, match="unique"):
        ix.add(torch.tensor([1, 1]), torch.randn(2, 4), torch.rand(2))
    ix.add(torch.tensor([1, 2]), torch.randn(2, 4), torch.rand(2))
    with pytest.raises(ValueError, match="already in the index"):
        ix.add(torch.tensor([2, 3]), torch.randn(2, 4), torch.rand(2))
    assert len(ix) == 2
    with pytest.raises(ValueError, match=r"q must be a \(Q, 4\)"):
        ix.search(torch.randn(1, 5), torch.zeros(1), 1)
    with pytest.raises(ValueError, match=r"u_q must have shape \(1,\)"):
        ix.search(torch.randn(1, 4), torch.zeros(2), 1)
    with pytest.raises(ValueError, match="k must be <= the number of records"):
        ix.search(torch.randn(1, 4), torch.zeros(1), 3)
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        ix.search(torch.randn(1, 4), torch.zeros(1), 0)
    with pytest.raises(TypeError, match="bias must be None"):
        ix.search(torch.randn(1, 4), torch.zeros(1), 1, bias="nope")
    with pytest.raises(ValueError, match="backend must be one of"):
        TemporalIndex(4, backend="annoy")
    with pytest.raises(ValueError, match="dim must be"):
        TemporalIndex(0)


def test_faiss_missing_says_what_to_install(monkeypatch):
    import builtins
    real = builtins.__import__

    def fake(name, *a, **k):
        if name == "faiss":
            raise ImportError("No module named 'faiss'")
        return real(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(ImportError, match=r"tempokern\[faiss\]"):
        TemporalIndex(4, backend="faiss-flat")
    ix = TemporalIndex(4)  # exact still works without faiss
    ix.add(torch.arange(3), torch.randn(3, 4), torch.rand(3))
    assert ix.search(torch.randn(2, 4), torch.zeros(2), 2)[0].shape == (2, 2)


def test_real_offset_bias_module_and_table():
    from tempokern import nn  # part of the package: a broken import must fail, not skip
    ids, emb, u = gallery(300, 16, seed=4)
    ix = TemporalIndex(16)
    ix.add(ids, emb, u)
    mod = nn.OffsetBias()
    with torch.no_grad():
        mod.scale.fill_(3.0)
    q, u_q = torch.randn(4, 16), torch.rand(4)
    for bias in (mod, mod.table()):
        got, s = ix.search(q, u_q, 6, bias=bias)
        l1, l2 = mod.mlp[0], mod.mlp[2]
        tup = ((u_q, u, l1.weight.detach(), l1.bias.detach(), l2.weight.detach(), l2.bias.detach(),
                mod.scale.detach()) if bias is mod else (u_q, u, bias))
        rv, ri = ref_topk(q, emb, 6, bias=tup)
        torch.testing.assert_close(s, rv, atol=1e-4, rtol=0)
        assert torch.equal(got, ids[ri])


def test_empty_index_round_trip(tmp_path):
    ix = TemporalIndex(5, dtype=torch.bfloat16)
    ix.save(tmp_path / "e.tki")
    back = TemporalIndex.load(tmp_path / "e.tki")
    assert len(back) == 0 and back.dim == 5 and back.dtype == torch.bfloat16
