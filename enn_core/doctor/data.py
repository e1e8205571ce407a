"""Doctor, data layer: the staged dataset and the places the runtime reads and writes.

- manifest: opens with StagedDataset (format version, shapes, dtypes, split sizes);
- content hash: the files re-hashed against the manifest's content_hash;
- non-finite: NaN/Inf counts in features and labels (staging refuses or drops them);
- labels: a label column that is one value on more than half of its training rows (labels.py);
- memmaps: every staged array opens read-only and reads back (with the read rate);
- fs <place>: filesystem type of the data, temp (tempfile.gettempdir()), work and cache
  directories, whether memory-backed (tmpfs) or network, free space, and a write probe;
- /dev/shm: size and free space (a warning, not a failure, where the platform has none).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, NotRequired, TypedDict

import numpy as np

from enn_core.data.manifest import FORMAT_VERSION
from enn_core.doctor.context import DoctorContext, Mount, free_bytes, gib, mount_of
from enn_core.doctor.labels import labels
from enn_core.doctor.report import Check, Recorder
from enn_core.errors import EnnError

if TYPE_CHECKING:
    from enn_core.data.dataset import StagedDataset

SHM = Path("/dev/shm")
MIN_SHM_FREE = 1 << 30  # below this, DataLoader workers and shared tensors risk a Bus error
MIN_FREE = 1 << 30  # free space below which a place gets a warning
QUICK_HASH_LIMIT = 256 << 20  # --quick skips re-hashing staged data larger than this
PROBE_BYTES = 1 << 20
BLOCK_ROWS = 1 << 16


class PlaceFacts(TypedDict):
    """The measurements of one `fs <place>` line (its report data)."""

    path: str
    fstype: str
    mountpoint: str
    free_bytes: int
    total_bytes: int
    kind: str
    writable: NotRequired[bool]  # after the write probe


def run(ctx: DoctorContext) -> list[Check]:
    rec = Recorder("data")
    ds = staged(ctx, rec)
    if ds is not None:
        content_hash(ctx, rec, ds)
        nonfinite(rec, ds)
        labels(ctx, rec, ds)
        memmaps(rec, ds)
    size = _staged_bytes(ds)
    for place, path in places(ctx).items():
        location(rec, place, path, need=2 * size if place in ("data", "work") else 0)
    shm(rec, SHM)
    return rec.checks


def places(ctx: DoctorContext) -> dict[str, Path]:
    """Where the runtime reads and writes: staged data, temp, work dir (run dirs, MLflow,
    checkpoints) and the torch.compile cache."""
    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(
        Path(tempfile.gettempdir()) / f"torchinductor_{_user()}"
    )
    out = {
        "data": ctx.staged_dir,
        "temp": Path(tempfile.gettempdir()),
        "work": ctx.layout.work,
        "compile-cache": Path(inductor),
    }
    # Python silently skips an unusable TMPDIR, but gcc (torch.compile) and other tools do not.
    env = os.environ.get("TMPDIR")
    if env and Path(env).resolve() != out["temp"].resolve():
        out["TMPDIR"] = Path(env)
    return out


def _user() -> str:
    try:
        import getpass

        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


def staged(ctx: DoctorContext, rec: Recorder) -> StagedDataset | None:
    from enn_core.data.dataset import StagedDataset

    path = ctx.staged_dir
    if not (path / "manifest.json").exists():
        rec.add(
            "manifest",
            "warn",
            f"no staged data at {path}; the model check uses a synthetic manifest",
            "run `enn stage-data` (or point the project root at staged outputs)",
        )
        return None
    with rec.timer() as t:
        try:
            ds = StagedDataset(path)
        except EnnError as e:
            rec.add("manifest", "fail", str(e), "re-run `enn stage-data`", t())
            return None
    m = ds.manifest
    labels = f", labels {m.labels.dtype}{list(m.labels.shape)}" if m.labels else ", features only"
    rec.add(
        "manifest",
        "ok",
        f"format v{FORMAT_VERSION}, {ds.n_rows} rows, features "
        f"{m.features.dtype}{list(m.features.shape)}{labels}, splits {dict(m.splits)}",
        seconds=t(),
        n_rows=ds.n_rows,
        splits=dict(m.splits),
        content_hash=ds.fingerprint,
    )
    return ds


def _staged_bytes(ds: StagedDataset | None) -> int:
    if ds is None:
        return 0
    arrays = [ds.features] + ([ds.labels] if ds.labels is not None else [])
    return int(sum(a.nbytes for a in arrays))


def content_hash(ctx: DoctorContext, rec: Recorder, ds: StagedDataset) -> None:
    size = _staged_bytes(ds)
    if ctx.quick and size > QUICK_HASH_LIMIT:
        rec.add(
            "content hash", "skip", f"{gib(size)} of staged data: re-hashing skipped by --quick"
        )
        return
    with rec.timer() as t:
        try:
            ds.verify()
        except (EnnError, KeyError, OSError) as e:
            msg = (
                str(e)
                if isinstance(e, EnnError)
                else f"{ds.path}: cannot re-hash ({type(e).__name__}: {e})"
            )
            rec.add(
                "content hash",
                "fail",
                msg,
                "the staged files changed after staging (or the manifest was edited): "
                "re-run `enn stage-data`",
                t(),
            )
            return
        secs = t()
    rate = size / secs / 2**20 if secs > 0 else float("inf")
    rec.add(
        "content hash",
        "ok",
        f"{len(ds.manifest.files)} files ({gib(size)}) match content_hash "
        f"{ds.fingerprint[:12]} (re-hashed at {rate:.0f} MiB/s)",
        seconds=secs,
    )


def count_nonfinite(arr: np.ndarray, rows: int = BLOCK_ROWS) -> tuple[int, int | None]:
    """(NaN/Inf count, first bad row) read in blocks of rows (memmap-friendly)."""
    if not np.issubdtype(arr.dtype, np.floating):
        return 0, None
    total, first = 0, None
    for s in range(0, arr.shape[0], rows):
        bad = ~np.isfinite(np.asarray(arr[s : s + rows]))
        n = int(bad.sum())
        if n and first is None:
            first = s + int(np.argwhere(bad.reshape(bad.shape[0], -1).any(axis=1))[0][0])
        total += n
    return total, first


def nonfinite(rec: Recorder, ds: StagedDataset) -> None:
    with rec.timer() as t:
        found = {"features": count_nonfinite(ds.features)}
        if ds.labels is not None:
            found["labels"] = count_nonfinite(ds.labels)
    detail = ", ".join(f"{k} {n}" for k, (n, _) in found.items())
    bad = {k: v for k, v in found.items() if v[0]}
    if bad:
        where = "; ".join(f"{k}: first at row {first}" for k, (_, first) in bad.items())
        rec.add(
            "non-finite",
            "fail",
            f"NaN/Inf values: {detail} ({where})",
            "fix the input rows, or re-run `enn stage-data` with data.nonfinite=error "
            "to find them (drop to skip them)",
            t(),
            counts={k: n for k, (n, _) in found.items()},
        )
    else:
        rec.add("non-finite", "ok", f"NaN/Inf values: {detail}", seconds=t())


def memmaps(rec: Recorder, ds: StagedDataset) -> None:
    """Every array opens as a read-only memmap; read the first rows of each and time it."""
    names = sorted(ds.manifest.files) or ["features.npy"]
    read = 0
    with rec.timer() as t:
        try:
            for name in names:
                arr = np.load(ds.path / name, mmap_mode="r", allow_pickle=False)
                if arr.size and (not isinstance(arr, np.memmap) or arr.flags.writeable):
                    rec.add(
                        "memmaps",
                        "fail",
                        f"{name} did not open as a read-only memmap",
                        "re-run `enn stage-data` (staged arrays must be plain .npy files)",
                    )
                    return
                row_bytes = arr.itemsize * int(np.prod(arr.shape[1:], dtype=np.int64))
                n = min(arr.shape[0], max(1, (64 << 20) // max(1, row_bytes)))  # up to 64 MiB
                read += np.asarray(arr[:n]).nbytes + np.asarray(arr[-1:]).nbytes
        except (OSError, ValueError) as e:
            rec.add(
                "memmaps",
                "fail",
                f"{ds.path}: {type(e).__name__}: {e}",
                "re-run `enn stage-data`",
                t(),
            )
            return
        secs = t()
    rate = read / secs / 2**20 if secs > 0 else float("inf")
    rec.add(
        "memmaps",
        "ok",
        f"{len(names)} arrays open read-only; read {gib(read)} at {rate:.0f} MiB/s",
        seconds=secs,
        read_bytes=read,
    )


def write_probe(directory: Path, nbytes: int = PROBE_BYTES) -> str:
    """Write, fsync and delete a file in `directory`; '' when it works, else the OS error."""
    try:
        fd, name = tempfile.mkstemp(prefix=".enn-doctor-", dir=directory)
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror or e}"
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(b"\0" * nbytes)
            f.flush()
            os.fsync(f.fileno())
        return ""
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror or e}"
    finally:
        Path(name).unlink(missing_ok=True)


def location(rec: Recorder, place: str, path: Path, need: int = 0) -> None:
    """Filesystem kind, free space and writability of one place the runtime uses."""
    t0 = time.perf_counter()
    mnt = mount_of(path)
    free, total = free_bytes(path)
    where = f"{path} on {mnt.fstype} ({mnt.mountpoint}), {gib(free)} free of {gib(total)}"
    facts: PlaceFacts = {
        "path": str(path),
        "fstype": mnt.fstype,
        "mountpoint": mnt.mountpoint,
        "free_bytes": free,
        "total_bytes": total,
        "kind": mnt.kind,
    }
    exists = path.is_dir()
    target = path if exists else _nearest_dir(path)
    err = write_probe(target)
    facts["writable"] = not err
    secs = time.perf_counter() - t0
    name = f"fs {place}"
    if err and (place != "data" or exists):
        rec.add(
            name,
            "fail",
            f"{where}: cannot write in {target} ({err})",
            _write_fix(place, mnt),
            secs,
            **facts,
        )
    elif place == "data" and mnt.kind == "memory":
        rec.add(
            name,
            "warn",
            f"{where}: staged data in memory (tmpfs) counts against RAM and is lost at reboot",
            "stage onto a local disk: run the project (outputs/) from a disk-backed directory",
            secs,
            **facts,
        )
    elif place in ("data", "work") and mnt.kind == "network":
        rec.add(
            name,
            "warn",
            f"{where}: network filesystem; random memmap reads and checkpoint writes are slow",
            "stage data and the work directory onto local disk (NVMe) and sync results afterwards",
            secs,
            **facts,
        )
    elif place == "work" and mnt.kind == "memory":
        rec.add(
            name,
            "warn",
            f"{where}: checkpoints, MLflow and run records in memory are lost at reboot",
            "set runtime.work_dir (or ENN_WORK_DIR) to a disk-backed directory",
            secs,
            **facts,
        )
    elif free < max(MIN_FREE, need):
        rec.add(
            name,
            "warn",
            f"{where}: less than {gib(max(MIN_FREE, need))} free",
            f"free space on {mnt.mountpoint}"
            + (" or set TMPDIR to a larger disk" if place == "temp" else ""),
            secs,
            **facts,
        )
    else:
        kind = {"memory": "memory-backed (tmpfs)", "network": "network", "local": "local"}.get(
            mnt.kind, mnt.kind
        )
        rec.add(
            name,
            "ok",
            f"{where}; {kind}" + ("" if exists else "; not created yet") + ", writable",
            seconds=secs,
            **facts,
        )


def _nearest_dir(path: Path) -> Path:
    p = path
    while not p.is_dir() and p != p.parent:
        p = p.parent
    return p


def _write_fix(place: str, mnt: Mount) -> str:
    why = "it is mounted read-only" if mnt.read_only else "check its free space and permissions"
    if place in ("temp", "TMPDIR"):
        return (
            f"set TMPDIR to a writable directory with free space ({why}); "
            "torch.compile, DCP and exports write there"
        )
    if place == "work":
        return f"set runtime.work_dir (or ENN_WORK_DIR) to a writable directory ({why})"
    return f"make {mnt.mountpoint} writable or move the directory ({why})"


def shm(rec: Recorder, path: Path) -> None:
    if not path.is_dir():
        rec.add(
            "/dev/shm",
            "warn",
            f"{path} does not exist on this platform; worker shared memory falls back to files",
            "nothing required; on Linux containers mount /dev/shm (e.g. docker --shm-size=2g)",
            path=str(path),
        )
        return
    free, total = free_bytes(path)
    detail = f"{path}: {gib(free)} free of {gib(total)}"
    if free < MIN_SHM_FREE:
        rec.add(
            "/dev/shm",
            "warn",
            detail
            + f" (under {gib(MIN_SHM_FREE)}: a full /dev/shm kills workers with a Bus error)",
            "raise the shared-memory size "
            "(docker --shm-size, k8s emptyDir medium: Memory sizeLimit) "
            "or remove stale files there",
            free_bytes=free,
            total_bytes=total,
        )
    else:
        rec.add("/dev/shm", "ok", detail, free_bytes=free, total_bytes=total)
