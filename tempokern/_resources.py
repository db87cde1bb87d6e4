"""Packaged data files (tempokern/data), read through importlib.resources and verified by sha256."""
from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from importlib import resources
from typing import Dict

CHUNQIU_SPLITS = "chunqiu_time_splits_by_month_v1.json"
ZZTJ_QIJI = "zztj_qiji_part.jsonl"
TIMEQA = "timeqa_human_annotated_train.json.gz"
TIMEQA_LICENSE = "LICENSE-TimeQA"

_SHA256 = {
    CHUNQIU_SPLITS: "f1bd8ba7aa5a988cf12a853d2e2bd7bfa3d52b592207da7567fee091ba00eed3",
    ZZTJ_QIJI: "5b6d96729cde195dafa2c2c1e136ad83268cf5bd27013a91b688e6275823fb33",
    TIMEQA: "312a77ea3c63a252ee7a9bbee6aa8ead9ea065df6db917b39c9e17bb179b43fd",
}


def read_bytes(name: str) -> bytes:
    """Bytes of a packaged data file, checked against its recorded sha256."""
    try:
        data = resources.files("tempokern.data").joinpath(name).read_bytes()
    except FileNotFoundError as e:
        raise FileNotFoundError(f"packaged data file tempokern/data/{name} is missing: the install is "
                                "incomplete (package data not shipped)") from e
    want = _SHA256.get(name)
    if want is not None and hashlib.sha256(data).hexdigest() != want:
        raise ValueError(f"packaged data file tempokern/data/{name} is corrupt (sha256 mismatch)")
    return data


def data_path(name: str):
    """A context manager giving a real filesystem path to a packaged data file."""
    read_bytes(name)  # verify first
    return resources.as_file(resources.files("tempokern.data").joinpath(name))


@lru_cache(maxsize=None)
def _chunqiu_splits_cached() -> tuple:
    raw = json.loads(read_bytes(CHUNQIU_SPLITS).decode("utf-8"))["split_by_sort_key"]
    return tuple(raw.items())


def load_chunqiu_splits() -> Dict[str, str]:
    """``{"g-y-m": "train"|"val"|"test"}`` for the 3,036 ChunQiuTR months."""
    return dict(_chunqiu_splits_cached())
