"""Content hashes of staged data: each hash string names its algorithm.

Written by this version: "blake3:<hex>", BLAKE3 with its default 256-bit output (`b3sum`),
of a staged array's data bytes (C order, the .npy payload without its header), of an input
file's bytes, and of small strings (the json of the array hashes, the generator config).

Why BLAKE3: hashing every staged byte is the largest piece of work stage-data adds to a
plain copy. BLAKE3 is cryptographic (a content id that DVC, checkpoint fingerprints and
model lineage rely on must resist collisions, which rules out xxhash) and runs at 7.3 GB/s a
core on these machines with AVX-512, against 1.2 for BLAKE2b and 1.8 for sha256 with SHA-NI
(measured 2026-11-23, `bench/bench_stage_data.py --hashes`); without AVX-512 it falls back
to AVX2/SSE4.1 at roughly half and a quarter of that. It releases the GIL, so one helper
thread hashes a chunk while the main thread writes the next.

Read, never written, so datasets staged by earlier versions still verify (`hasher_for`):
- "blake2b-256-tree1m:<hex>": BLAKE2b-256 in tree mode over 1 MiB leaves (node_depth 0,
  node_offset = leaf index, leaf_size 1 MiB, inner_size 32, fanout 0, depth 2), the root
  over the leaf digests with node_depth 1 and last_node set.
- "blake2b-256:<hex>": plain BLAKE2b-256.
- a bare 64-digit hex: sha256, from manifests written before hashes named their algorithm.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypedDict

import blake3

ALGORITHM = "blake3"
_B2 = "blake2b-256"
_B2_TREE = "blake2b-256-tree1m"
_B2_LEAF = 1 << 20


class _TreeParams(TypedDict):
    digest_size: int
    fanout: int
    depth: int
    leaf_size: int
    inner_size: int


_B2_TREE_PARAMS: _TreeParams = {
    "digest_size": 32,
    "fanout": 0,
    "depth": 2,
    "leaf_size": _B2_LEAF,
    "inner_size": 32,
}
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def new() -> Any:
    """A fresh BLAKE3 hasher (update / copy / hexdigest; its update releases the GIL)."""
    return blake3.blake3()


def named(h: Any) -> str:
    """The hash string of a finished hasher made by `new`."""
    return f"{ALGORITHM}:{h.hexdigest()}"


class _Blake2bTree:
    """The legacy "blake2b-256-tree1m" hash of a byte stream fed in pieces of any size."""

    def __init__(self) -> None:
        self._digests: list[bytes] = []
        self._leaf: hashlib.blake2b | None = None
        self._fill = 0

    def update(self, view: memoryview) -> None:
        pos, n = 0, len(view)
        while pos < n:
            if self._leaf is None:
                self._leaf = hashlib.blake2b(
                    node_offset=len(self._digests), node_depth=0, **_B2_TREE_PARAMS
                )
            take = min(_B2_LEAF - self._fill, n - pos)
            self._leaf.update(view[pos : pos + take])
            self._fill += take
            pos += take
            if self._fill == _B2_LEAF:
                self._digests.append(self._leaf.digest())
                self._leaf, self._fill = None, 0

    def hexdigest(self) -> str:
        leaves = self._digests + ([self._leaf.digest()] if self._leaf is not None else [])
        root = hashlib.blake2b(node_offset=0, node_depth=1, last_node=True, **_B2_TREE_PARAMS)
        for d in leaves:
            root.update(d)
        return root.hexdigest()


def hasher_for(stored: str) -> tuple[Callable[[], Any], Callable[[Any], str]]:
    """(new hasher, formatter) that reproduce a stored hash string's algorithm and spelling.

    Raises ValueError for a string no version of stage-data wrote.
    """
    if stored.startswith(f"{ALGORITHM}:"):
        return new, named
    if stored.startswith(f"{_B2_TREE}:"):
        return _Blake2bTree, lambda h: f"{_B2_TREE}:{h.hexdigest()}"
    if stored.startswith(f"{_B2}:"):
        return lambda: hashlib.blake2b(digest_size=32), lambda h: f"{_B2}:{h.hexdigest()}"
    if _SHA256_HEX.fullmatch(stored):  # manifests before the algorithm was named
        return hashlib.sha256, lambda h: h.hexdigest()
    raise ValueError(
        f"unknown hash {stored[:24]!r}: expected '{ALGORITHM}:<hex>' (or an older "
        f"'{_B2_TREE}:', '{_B2}:' or bare sha256 hex)"
    )


def of_bytes(data: bytes) -> str:
    """The hash string of a small byte string."""
    h = new()
    h.update(data)
    return named(h)


def hash_files(paths: list[Path], stop: threading.Event | None = None, block: int = 4 << 20) -> str:
    """Hash of the files' bytes, one after the other (a file input's source hash)."""
    h = new()
    for path in paths:
        with open(path, "rb") as f:
            while chunk := f.read(block):
                if stop is not None and stop.is_set():
                    return ""
                h.update(chunk)
    return named(h)


def sha256_file(path: str | Path, block: int = 1 << 22) -> str:
    """The sha256 hex digest of a file (models, calibration and prediction files are named by
    it: a reader checks the file it was made for)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()
