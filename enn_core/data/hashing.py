"""Content hashes of staged data: each hash string names its algorithm.

- "blake2b-256-tree1m:<hex>": a staged array's data bytes. The bytes are cut into 1 MiB
  leaves, each hashed with BLAKE2b-256 in tree mode (node_depth 0, node_offset = leaf index,
  leaf_size 1 MiB, inner_size 32, fanout 0, depth 2); the root is BLAKE2b-256 with the same
  parameters, node_depth 1 and last_node set, over the leaf digests in order. Leaves are
  independent, so two threads hash one array at twice the speed of a single stream, which
  matters because hashing every staged byte is the longest step of stage-data here: these
  machines have no SHA extensions (sha256 ~0.3-0.4 GB/s a core, BLAKE2b ~1.6x that).
- "blake2b-256:<hex>": a plain BLAKE2b-256 (`b2sum -l 256`) of small strings and input files.
- A bare 64-digit hex: sha256, from manifests written before hashes named their algorithm;
  `hasher_for` reads it, so those datasets still verify.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

ALGORITHM = "blake2b-256"
TREE = "blake2b-256-tree1m"
LEAF = 1 << 20
_LEGACY = re.compile(r"[0-9a-f]{64}")
_TREE_PARAMS = {"digest_size": 32, "fanout": 0, "depth": 2, "leaf_size": LEAF, "inner_size": 32}


def new() -> Any:
    """A fresh plain BLAKE2b-256 hasher."""
    return hashlib.blake2b(digest_size=32)


def named(h: Any) -> str:
    """The hash string of a finished hasher made by `new` or `TreeHash`."""
    if isinstance(h, TreeHash):
        return f"{TREE}:{h.hexdigest()}"
    return f"{ALGORITHM}:{h.hexdigest()}"


class TreeHash:
    """The TREE hash of a byte stream, fed in pieces of any size.

    `plan(view)` cuts the next piece at leaf boundaries and returns one task per leaf it
    touches; the tasks of one plan may run in parallel threads (hashlib releases the GIL),
    but every task of a plan must finish before the next `plan`, `copy` or `hexdigest`.
    `update(view)` runs a plan in the calling thread.
    """

    def __init__(self) -> None:
        self.digests: list[bytes | None] = []  # finished leaves, in order
        self._leaf: Any = None  # the partly filled leaf
        self._fill = 0

    def _new_leaf(self) -> Any:
        return hashlib.blake2b(node_offset=len(self.digests), node_depth=0, **_TREE_PARAMS)

    def plan(self, view: memoryview) -> list[Callable[[], None]]:
        tasks, pos, n = [], 0, len(view)
        while pos < n:
            if self._leaf is None:
                self._leaf = self._new_leaf()
            take = min(LEAF - self._fill, n - pos)
            seg, h, self._fill = view[pos : pos + take], self._leaf, self._fill + take
            if self._fill == LEAF:  # the leaf is complete: its task also takes its digest
                self.digests.append(None)
                tasks.append(_leaf_task(h, seg, self.digests, len(self.digests) - 1))
                self._leaf, self._fill = None, 0
            else:
                tasks.append(_leaf_task(h, seg, None, 0))
            pos += take
        return tasks

    def update(self, view: memoryview) -> None:
        for task in self.plan(view):
            task()

    def copy(self) -> TreeHash:
        other = TreeHash()
        other.digests = list(self.digests)
        other._leaf = self._leaf.copy() if self._leaf is not None else None
        other._fill = self._fill
        return other

    def hexdigest(self) -> str:
        leaves = list(self.digests) + ([self._leaf.digest()] if self._leaf is not None else [])
        root = hashlib.blake2b(node_offset=0, node_depth=1, last_node=True, **_TREE_PARAMS)
        for d in leaves:
            root.update(d)
        return root.hexdigest()


def _leaf_task(h: Any, seg: memoryview, digests: list | None, i: int) -> Callable[[], None]:
    def run() -> None:
        h.update(seg)
        if digests is not None:
            digests[i] = h.digest()

    return run


def hasher_for(stored: str) -> tuple[Callable[[], Any], Callable[[Any], str]]:
    """(new hasher, formatter) that reproduce a stored hash string's algorithm and spelling.

    Raises ValueError for a string no version of stage-data wrote.
    """
    if stored.startswith(f"{TREE}:"):
        return TreeHash, named
    if stored.startswith(f"{ALGORITHM}:"):
        return new, named
    if _LEGACY.fullmatch(stored):  # manifests before the algorithm was named: bare sha256 hex
        return hashlib.sha256, lambda h: h.hexdigest()
    raise ValueError(
        f"unknown hash {stored[:24]!r}: expected '{TREE}:<hex>', '{ALGORITHM}:<hex>' or sha256 hex"
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
