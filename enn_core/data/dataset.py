"""StagedDataset: the read-only view every stage after stage-data uses.

    ds = StagedDataset(ctx.input(STAGE_DATA))    # in a stage reading the staged data
    x, y = ds.features, ds.labels           # np.memmap, mode "r"
    train = ds.split("train")               # int64 row indices
    ds.manifest.feature_specs, ds.fingerprint   # manifest: a StagedManifest record

The manifest is checked on open (format version, file shapes, dtypes, split sizes); any
mismatch raises StaleOutputError saying to re-run stage-data.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from enn_core.data import hashing
from enn_core.data.manifest import (
    ArrayEntry,
    FileEntry,
    StagedManifest,
    content_hash,
    read_manifest,
)
from enn_core.errors import DataError, StaleOutputError

if TYPE_CHECKING:  # pandas (0.4 s of imports) only where row keys are read: not in a worker
    import pandas as pd


class StagedDataset:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.manifest: StagedManifest = read_manifest(self.path)
        m = self.manifest
        self.features = self._open(m.features)
        self.labels = self._open(m.labels) if m.labels else None
        if self.features.shape[0] != m.n_rows:
            self._stale(f"features have {self.features.shape[0]} rows, manifest says {m.n_rows}")
        self._splits: dict[str, np.ndarray] = {}
        for name, size in m.splits.items():
            self._splits[name] = self._open(ArrayEntry(f"splits/{name}.npy", "int64", (size,)))

    def _stale(self, what: str) -> NoReturn:
        raise StaleOutputError(f"{self.path}: {what}; re-run stage-data")

    def _open(self, spec: ArrayEntry) -> np.ndarray:
        p = self.path / spec.file
        if not p.exists():
            self._stale(f"{spec.file} is missing")
        try:
            arr = np.load(p, mmap_mode="r", allow_pickle=False)
        except ValueError as e:
            self._stale(f"{spec.file} is unreadable ({e})")
        if tuple(arr.shape) != spec.shape or str(arr.dtype) != spec.dtype:
            self._stale(
                f"{spec.file} is {arr.dtype}{list(arr.shape)} "
                f"but the manifest says {spec.dtype}{list(spec.shape)}"
            )
        return arr

    @property
    def fingerprint(self) -> str:
        """The content hash of features, labels and splits (changes when the data does)."""
        return self.manifest.content_hash

    @property
    def targets(self) -> np.ndarray:
        """The labels of a training dataset; features-only data is refused, named."""
        if self.labels is None:
            raise DataError(
                f"{self.path} is features-only (no labels); stage the training data with its "
                "label columns"
            )
        return self.labels

    @property
    def n_rows(self) -> int:
        return self.manifest.n_rows

    @property
    def feature_specs(self) -> tuple[Mapping[str, Any], ...]:
        return self.manifest.feature_specs

    @property
    def label_shape(self) -> tuple[int, ...] | None:
        return self.manifest.label_shape

    @property
    def split_names(self) -> list[str]:
        return list(self._splits)

    def split(self, name: str) -> np.ndarray:
        """Row indices of a split ('train', 'val', 'test'), or all rows for 'all'."""
        if name == "all":
            return np.arange(self.n_rows, dtype=np.int64)
        if name not in self._splits:
            raise KeyError(
                f"unknown split {name!r}; staged splits are {self.split_names} (or 'all')"
            )
        return self._splits[name]

    @cached_property
    def row_keys(self) -> pd.DataFrame:
        """pandas DataFrame of the row-key columns (plus source_row), one row per sample."""
        import pandas as pd

        return pd.read_parquet(self.path / "row_keys.parquet")

    def verify(self) -> None:
        """Re-hash the staged arrays and compare with the manifest (slow: reads every byte).

        Each file is re-hashed with the algorithm its manifest entry names (hashing.hasher_for).
        """
        files = {}
        for name, spec in self.manifest.files.items():
            arr = np.load(self.path / name, mmap_mode="r")
            try:
                make, spell = hashing.hasher_for(spec.hash)
            except ValueError as e:
                self._stale(f"{name}: {e}")
            files[name] = FileEntry(spec.dtype, spec.shape, spell(_data_hash(arr, make())))
        if content_hash(files) != self.fingerprint:
            self._stale("staged files do not match their content hash")


def _data_hash(arr: np.ndarray, h: Any, rows: int = 1 << 16) -> Any:
    """`h` updated with an array's C-ordered data bytes, as the staging writer hashes them
    (`h`: a hashing.hasher_for hasher, hashlib's or the untyped blake3's)."""
    for s in range(0, arr.shape[0], rows):
        h.update(np.ascontiguousarray(arr[s : s + rows]).data.cast("B"))
    return h
