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

    .enn-parts             present when enn made the folder (so enn may remove it, empty)

Resume rule: a part is reused when its marker exists, names the same fingerprints and row
range, the files' sha256 match the marker (so a part torn by a power loss is recomputed,
which is why parts need no fsync), and the marker's HMAC under the job secret verifies (on
every path: one worker, several, one node or several; enn_core.runtime.secret): a part
rewritten by someone without the secret (its marker's sha256 recomputed) is recomputed, and
assembly refuses one that fails after it was checked.
Parts made from another model or another input are *discarded with a clear message* when the
run starts (`PartStore.prepare`): the directory is keyed by the output, not the model, so
refusing them would leave the user to delete them by hand, and keeping them is never correct.

The folder may be shared by several hosts (predict.parts_dir), so it chooses nothing: a link
where the folder should be is one line (nothing written through it); only files enn writes
(by name, and parts only with an authentic marker) are ever deleted, never by a manifest's
say-so alone; anything else is left and named; the folder itself is removed only when enn
made it and it is empty.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import re
import stat
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from enn_core.atomic import not_a_link, write_json
from enn_core.data.hashing import sha256_file
from enn_core.errors import ConfigError, StaleOutputError
from enn_core.runtime import secret

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
OWNER = ".enn-parts"
TMP_PREFIX = ".tmp-"
PART = re.compile(r"part-(\d{5})\.(npy|rows\.npy|done)")
# files enn writes in a parts folder, besides the parts (the local pool's status files)
OURS = re.compile(r"manifest\.json|index\.npy|worker-\d+\.json|\.enn-parts|\.tmp-.+")

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

    def __init__(self, root: str | Path, plan: PartsPlan, key: bytes) -> None:
        self.root = Path(root)
        self.plan = plan
        # the job secret keys every marker's MAC, on every path (`parts_key`)
        if len(key) < secret.MIN_CHARS:
            raise ValueError("a parts folder's markers need the job secret as their MAC key")
        self.key = key

    def pred_path(self, k: int) -> Path:
        return self.root / f"part-{k:05d}.npy"

    def rows_path(self, k: int) -> Path:
        return self.root / f"part-{k:05d}.rows.npy"

    def marker_path(self, k: int) -> Path:
        return self.root / f"part-{k:05d}.done"

    def prepare(self, job: str = "") -> str | None:
        """Make the directory ready for this plan; returns why earlier parts were discarded."""
        own_folder(self.root)
        if not self.root.exists():
            self.root.mkdir(parents=True)
            write_json(self.root / OWNER, {"made_by": "enn predict", "job": job})
        reason = None
        manifest = self.root / MANIFEST
        if os.path.lexists(manifest):
            if not _regular(manifest):
                raise ConfigError(
                    f"{manifest} is not a regular file (a link?); enn wrote no such thing: "
                    "remove it, or choose another predict.parts_dir"
                )
            reason = self._mismatch(_read_json(manifest))
            if reason:
                # the caller says it (once, on the console); the folder goes to the log file
                logging.getLogger("enn_core.predict.chunks").info(
                    "predict: discarding parts in %s: %s", self.root, reason
                )
                self._remove(self._authentic_parts() | {MANIFEST})
        self._remove({p.name for p in self.root.glob(f"{TMP_PREFIX}*")})  # a killed worker's
        if not manifest.exists():
            write_json(manifest, self.plan.to_manifest())
        return reason

    def clear(self) -> list[str]:
        """After assembly: remove what enn wrote here (the folder too, when enn made it and
        nothing else is left); returns the files left, which are named in the log."""
        own_folder(self.root)
        if not self.root.is_dir():
            return []
        ours = {p.name for p in self.root.iterdir() if OURS.fullmatch(p.name)}
        ours |= {self.path(k, kind).name for k in range(self.plan.n_parts) for kind in PARTS}
        made = (self.root / OWNER).is_file()
        self._remove(ours - {OWNER})
        left = sorted(p.name for p in self.root.iterdir() if p.name != OWNER)
        if left:
            log.warning(
                "predict: %s holds files enn did not write, left as they are: %s",
                self.root,
                ", ".join(left[:5]) + (", ..." if len(left) > 5 else ""),
            )
        elif made:
            self._remove({OWNER})
            with contextlib.suppress(OSError):
                self.root.rmdir()
        return left

    def path(self, k: int, kind: str) -> Path:
        return {"pred": self.pred_path, "rows": self.rows_path, "done": self.marker_path}[kind](k)

    def _authentic_parts(self) -> set[str]:
        """Names of the part files whose marker this job's secret vouches for (any plan)."""
        names: set[str] = set()
        for marker in self.root.glob("part-*.done"):
            m = PART.fullmatch(marker.name)
            if m is None or not _regular(marker):
                continue
            with contextlib.suppress(StaleOutputError):
                if self._authentic(_read_json(marker)):
                    names |= {self.path(int(m.group(1)), kind).name for kind in PARTS}
        return names

    def _authentic(self, marker: Mapping[str, Any]) -> bool:
        tag = marker.get("mac")
        body = {k: v for k, v in marker.items() if k != "mac"}
        return isinstance(tag, str) and secret.valid(self.key, _unhex(tag), _canonical(body))

    def _sign(self, marker: dict[str, Any]) -> dict[str, Any]:
        return {**marker, "mac": secret.mac(self.key, _canonical(marker)).hex()}

    def _remove(self, names: set[str]) -> None:
        """Unlink these files of the folder: regular files and links (a link itself, never
        its target); anything else (a folder) is left."""
        for name in sorted(names):
            p = self.root / name
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISDIR(os.lstat(p).st_mode):
                    continue
                p.unlink()

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
        if not _regular(marker):
            return False
        try:
            m = _read_json(marker)
        except StaleOutputError:
            return False  # markers are written atomically; an unreadable one is not ours
        expect = dict(self._marker_key(k))
        if any(m.get(key) != value for key, value in expect.items()):
            return False
        if not (_regular(self.pred_path(k)) and _regular(self.rows_path(k))):
            return False
        if not self._authentic(m):
            log.warning(
                "predict: part %d in %s: its marker fails its MAC (not written by a member of "
                "this job, or with another job secret); recomputing it",
                k,
                self.root,
            )
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
        """Yield a writable array for part `k`; on clean exit it is committed with its marker
        (files created fresh, never through a link planted in the shared folder)."""
        own_folder(self.root)
        start, stop = self.plan.part_range(k)
        self.marker_path(k).unlink(missing_ok=True)
        buf = np.empty((stop - start, *self.plan.out_shape), dtype=np.dtype(self.plan.dtype))
        t0 = time.perf_counter()
        yield buf
        sums = {}
        for path, array in ((self.pred_path(k), buf), (self.rows_path(k), None)):
            data = np.arange(start, stop, dtype=np.int64) if array is None else array
            out = io.BytesIO()
            np.save(out, data)
            raw = out.getvalue()
            tmp = self.root / f"{TMP_PREFIX}{path.name}"
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "wb") as f:
                f.write(raw)
            os.replace(tmp, path)
            sums[path] = hashlib.sha256(raw).hexdigest()
        marker = {
            **dict(self._marker_key(k)),
            "sha256": sums[self.pred_path(k)],
            "rows_sha256": sums[self.rows_path(k)],
            "rank": rank,
            "seconds": round(time.perf_counter() - t0, 6),
        }
        write_json(self.marker_path(k), self._sign(marker))

    def read_part(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(row ids, predictions) of a completed part, read once and checked against its
        marker (sha256 and the marker's MAC) from the bytes read."""
        if not self.is_done(k, verify=False):
            raise StaleOutputError(
                f"{self.marker_path(k)}: part {k} is not complete for this plan; re-run predict"
            )
        m = _read_json(self.marker_path(k))
        raw = {kind: _read_own(self.path(k, kind)) for kind in ("pred", "rows")}
        if not self._authentic(m) or (
            hashlib.sha256(raw["pred"]).hexdigest(),
            hashlib.sha256(raw["rows"]).hexdigest(),
        ) != (m.get("sha256"), m.get("rows_sha256")):
            raise StaleOutputError(
                f"{self.pred_path(k)}: part {k} changed after it was written (its checksum or "
                "MAC fails): it was not published; run predict again, which recomputes it"
            )
        return _npy(raw["rows"]), _npy(raw["pred"])


PARTS = ("pred", "rows", "done")


def parts_key(secret_file: str) -> bytes:
    """The MAC key of a parts folder's markers: the job secret in `secret_file` (the stage
    names it for every path: ENN_JOB_SECRET_FILE, else the work directory's own), or, when
    none is named, the one in ENN_JOB_SECRET_FILE; a worker with neither is one line."""
    key = secret.read(Path(secret_file)) if secret_file else secret.load()
    if key is None:
        raise ConfigError(
            f"a prediction worker without a job secret (no {secret.ENV}, none named in its "
            "job): its parts would carry no MAC; run it through `enn predict`"
        )
    return key


def own_folder(root: Path) -> None:
    """A folder enn writes into: not a link (nothing is written or deleted through one)."""
    not_a_link(root, "remove it or choose another predict.parts_dir")


def _regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def _read_own(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _npy(raw: bytes) -> np.ndarray:
    return np.load(io.BytesIO(raw), allow_pickle=False)


def _canonical(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()


def _unhex(tag: str) -> bytes:
    try:
        return bytes.fromhex(tag)
    except ValueError:
        return b""


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise StaleOutputError(
            f"{path}: unreadable ({e}); delete the parts directory {path.parent}"
        ) from e
