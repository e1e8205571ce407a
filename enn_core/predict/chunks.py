"""Chunked, resumable prediction output: memmap parts, a parts manifest, completion markers.

A prediction of `n_rows` rows is cut into parts of `rows_per_part` rows (the last may be
shorter). Part boundaries depend only on `n_rows` and `rows_per_part`, never on the number
of workers, so the batches inside a part, and therefore its bytes, are the same whoever
computes it. Layout of a parts directory (under the work directory, not DVC-tracked):

    manifest.json          format version, model and input fingerprints, rows per part,
                           per-row shape and dtype, number of parts
    part-00003.npy         predictions of part 3 ([rows, *out_shape]), renamed into place
                           only once complete (written as `.tmp-part-00003.npy` before)
    part-00003.rows.npy    the row ids (positions in the predicted row list) it holds
    part-00003.done        completion marker (JSON): range, checksums, fingerprints

Resume rule: a part is reused when its marker exists, names the same fingerprints and row
range, and the files' sha256 match the marker (so a part torn by a power loss is recomputed,
which is why parts need no fsync). Parts made from another model or another input are
*discarded with a clear message* when the run starts (`PartStore.prepare`): the directory is
keyed by the output, not the model, so refusing them would leave the user to delete them by
hand, and keeping them is never correct. The message names both fingerprints.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from enn_core.atomic import write_json
from enn_core.data.hashing import sha256_file
from enn_core.errors import StaleOutputError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp-"

log = logging.getLogger("enn.predict")


@dataclass(frozen=True)
class PartsPlan:
    """What a parts directory holds; two runs may share parts only when their plans are equal."""

    n_rows: int
    rows_per_part: int
    out_shape: tuple[int, ...]
    dtype: str
    model_fingerprint: str
    input_fingerprint: str

    @property
    def n_parts(self) -> int:
        return max(1, -(-self.n_rows // self.rows_per_part)) if self.n_rows else 0

    def part_range(self, k: int) -> tuple[int, int]:
        start = k * self.rows_per_part
        return start, min(start + self.rows_per_part, self.n_rows)

    def to_manifest(self) -> dict[str, Any]:
        d = asdict(self)
        d["out_shape"] = list(self.out_shape)
        return {"format_version": FORMAT_VERSION, "n_parts": self.n_parts, **d}


def parts_of_worker(n_parts: int, rank: int, world_size: int) -> range:
    """The contiguous block of parts worker `rank` computes (sizes differ by at most one)."""
    return range(rank * n_parts // world_size, (rank + 1) * n_parts // world_size)


class PartStore:
    """One parts directory under one plan. The parent calls `prepare`; workers write parts."""

    def __init__(self, root: str | Path, plan: PartsPlan) -> None:
        self.root = Path(root)
        self.plan = plan

    def pred_path(self, k: int) -> Path:
        return self.root / f"part-{k:05d}.npy"

    def rows_path(self, k: int) -> Path:
        return self.root / f"part-{k:05d}.rows.npy"

    def marker_path(self, k: int) -> Path:
        return self.root / f"part-{k:05d}.done"

    def prepare(self) -> str | None:
        """Make the directory ready for this plan; returns why earlier parts were discarded."""
        reason = None
        manifest = self.root / MANIFEST
        if manifest.exists():
            reason = self._mismatch(_read_json(manifest))
            if reason:
                # the caller says it (once, on the console); the folder goes to the log file
                logging.getLogger("enn_core.predict.chunks").info(
                    "predict: discarding parts in %s: %s", self.root, reason
                )
                shutil.rmtree(self.root)
        self.root.mkdir(parents=True, exist_ok=True)
        for p in self.root.glob(f"{TMP_PREFIX}*"):  # left by a killed worker
            p.unlink(missing_ok=True)
        if not manifest.exists():
            write_json(manifest, self.plan.to_manifest())
        return reason

    def _mismatch(self, old: Mapping[str, Any]) -> str | None:
        new = self.plan.to_manifest()
        for key in ("format_version", "model_fingerprint", "input_fingerprint"):
            if old.get(key) != new[key]:
                return (
                    f"they were made with {key}={str(old.get(key))[:16]}, this run has "
                    f"{str(new[key])[:16]}; recomputing every part"
                )
        for key in ("n_rows", "rows_per_part", "out_shape", "dtype"):
            if old.get(key) != new[key]:
                return (
                    f"they were made with {key}={old.get(key)}, this run has {new[key]}; "
                    "recomputing every part"
                )
        return None

    def is_done(self, k: int, *, verify: bool = True) -> bool:
        """True when part `k` is complete under this plan (checksums verified unless told not)."""
        marker = self.marker_path(k)
        if not marker.exists():
            return False
        try:
            m = _read_json(marker)
        except StaleOutputError:
            return False  # markers are written atomically; an unreadable one is not ours
        expect = dict(self._marker_key(k))
        if any(m.get(key) != value for key, value in expect.items()):
            return False
        if not (self.pred_path(k).exists() and self.rows_path(k).exists()):
            return False
        if verify and (
            sha256_file(self.pred_path(k)) != m.get("sha256")
            or sha256_file(self.rows_path(k)) != m.get("rows_sha256")
        ):
            log.warning("predict: part %d in %s fails its checksum; recomputing it", k, self.root)
            return False
        return True

    def _marker_key(self, k: int) -> Iterator[tuple[str, object]]:
        start, stop = self.plan.part_range(k)
        yield "format_version", FORMAT_VERSION
        yield "part", k
        yield "start", start
        yield "stop", stop
        yield "model_fingerprint", self.plan.model_fingerprint
        yield "input_fingerprint", self.plan.input_fingerprint

    @contextlib.contextmanager
    def writing(self, k: int, *, rank: int = 0) -> Iterator[np.ndarray]:
        """Yield a writable memmap for part `k`; on clean exit it is committed with its marker."""
        start, stop = self.plan.part_range(k)
        self.marker_path(k).unlink(missing_ok=True)
        tmp = self.root / f"{TMP_PREFIX}{self.pred_path(k).name}"
        shape = (stop - start, *self.plan.out_shape)
        buf = np.lib.format.open_memmap(
            tmp, mode="w+", dtype=np.dtype(self.plan.dtype), shape=shape
        )
        t0 = time.perf_counter()
        try:
            yield buf
            buf.flush()
        except BaseException:
            del buf
            tmp.unlink(missing_ok=True)
            raise
        del buf
        os.replace(tmp, self.pred_path(k))
        rows_tmp = self.root / f"{TMP_PREFIX}{self.rows_path(k).name}"
        with open(rows_tmp, "wb") as f:
            np.save(f, np.arange(start, stop, dtype=np.int64))
        os.replace(rows_tmp, self.rows_path(k))
        marker = {
            **dict(self._marker_key(k)),
            "sha256": sha256_file(self.pred_path(k)),
            "rows_sha256": sha256_file(self.rows_path(k)),
            "rank": rank,
            "seconds": round(time.perf_counter() - t0, 6),
        }
        write_json(self.marker_path(k), marker)

    def read_part(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(row ids, predictions) of a completed part, memory-mapped read-only."""
        if not self.is_done(k, verify=False):
            raise StaleOutputError(
                f"{self.marker_path(k)}: part {k} is not complete for this plan; re-run predict"
            )
        return np.load(self.rows_path(k), mmap_mode="r"), np.load(self.pred_path(k), mmap_mode="r")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise StaleOutputError(
            f"{path}: unreadable ({e}); delete the parts directory {path.parent}"
        ) from e
