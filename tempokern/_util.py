"""Small helpers shared across tempokern's layers (no tempokern imports here, so every module can use them)."""
from __future__ import annotations

CACHE_MAX = 16  # module-level caches hold at most this many entries, the oldest goes first


def cache_put(cache: dict, key, value, limit: int = CACHE_MAX):
    """Insert into a bounded module-level cache (at most `limit` entries, evicting the oldest) and return the
    value."""
    while len(cache) >= limit:
        cache.pop(next(iter(cache)))
    cache[key] = value
    return value


def trace_constant(fn):
    """Marks fn so that torch.compile records its result as a constant of the trace (what
    ``torch.compiler.assume_constant_result`` does: it sets this attribute), without importing torch._dynamo when
    tempokern is imported (that import alone costs seconds). tests/test_dispatch.py checks that torch's decorator
    still sets the same attribute."""
    fn._dynamo_marked_constant = True
    return fn
