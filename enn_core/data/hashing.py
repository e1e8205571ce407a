"""Content hashes of staged data: one algorithm, named in every hash string it makes.

Staged data is hashed with BLAKE2b at a 256-bit digest, written "blake2b-256:<hex>" (the
same digest as `b2sum -l 256` over the same bytes). On these machines (no SHA extensions)
BLAKE2b runs about 1.6x faster than sha256, and hashing every staged byte is the longest
serial step of stage-data. Hashes in manifests written before the algorithm was named are a
bare 64-digit hex sha256; `hasher_for` reads both, so those datasets still verify.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

ALGORITHM = "blake2b-256"
_LEGACY = re.compile(r"[0-9a-f]{64}")


def new() -> Any:
    """A fresh hasher of the current algorithm."""
    return hashlib.blake2b(digest_size=32)


def named(h: Any) -> str:
    """The hash string of a finished hasher made by `new` ("blake2b-256:<hex>")."""
    return f"{ALGORITHM}:{h.hexdigest()}"


def hasher_for(stored: str) -> tuple[Callable[[], Any], Callable[[Any], str]]:
    """(new hasher, formatter) that reproduce a stored hash string's algorithm and spelling.

    Raises ValueError for a string no version of stage-data wrote.
    """
    if stored.startswith(f"{ALGORITHM}:"):
        return new, named
    if _LEGACY.fullmatch(stored):  # manifests before the algorithm was named: bare sha256 hex
        return hashlib.sha256, lambda h: h.hexdigest()
    raise ValueError(f"unknown hash {stored[:24]!r}: expected '{ALGORITHM}:<hex>' or sha256 hex")


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
