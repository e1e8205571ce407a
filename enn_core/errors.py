"""The project's domain exceptions, and every exit code `enn` returns (`EXIT_CODES`, the one
list: `enn --help` prints it and docs/getting-started.md's list is checked against it).

Every message names the file, field or row at fault and what to do about it, on one line.
`TransientError` marks failures worth retrying (worker launch, I/O); the orchestration layer
retries those and nothing else. Everything else (bad input, bad config) fails at once.
"""

from __future__ import annotations

import errno
import re
import shutil
from collections.abc import Iterable
from pathlib import Path


class EnnError(Exception):
    """Base class. `exit_code` is what the CLI returns for it; `docs`, the page its error line
    names (a message that names a page of its own keeps that one)."""

    exit_code = 1
    docs = "docs/troubleshooting.md"


class ConfigError(EnnError):
    """A config value is missing, unknown or invalid. Never retried."""

    exit_code = 2
    docs = "docs/config.md"


class DataError(EnnError):
    """Input data is missing, malformed or inconsistent with its manifest. Never retried."""

    exit_code = 3
    docs = "docs/your-data.md"


class StaleOutputError(EnnError):
    """An artifact on disk does not match what its reader expects (re-run the producing stage)."""

    exit_code = 4


class UntrustedCheckpointError(StaleOutputError):
    """A checkpoint file holds something other than checkpoint data: refused, nothing ran."""

    @classmethod
    def refused(cls, path: str | Path, detail: str, fix: str) -> UntrustedCheckpointError:
        """The error for a file `torch.load(weights_only=True)` refused; `detail` is torch's
        message, of which only the global it names is kept: its advice (load it again with
        weights_only off) is the one thing not to do with a file nobody vouches for."""
        found = re.search(r"GLOBAL ([\w.]+)", detail)
        what = f" (it refers to {found.group(1)})" if found else ""
        return cls(
            f"{path}: holds something other than tensors and plain values{what}, so it was "
            f"refused and nothing in it ran (a crafted or foreign file): {fix}"
        )


class TrainingError(EnnError):
    """Training stopped for a reason it names (too many non-finite steps, a bad plan...)."""

    exit_code = 5


class CollapseError(EnnError):
    """Every prediction candidate collapsed; the report says why. Never retried."""

    exit_code = 6


class ExportError(EnnError):
    """An export format failed: names the format, the operator or constraint, and the fix."""

    exit_code = 7
    docs = "docs/serving.md"


class LockError(EnnError):
    """Another pipeline run holds the work directory."""

    exit_code = 8


class Preempted(EnnError):
    """Preempted (SIGTERM or SIGUSR2): a committed checkpoint was saved; run it again to resume."""

    exit_code = 12
    docs = "docs/checkpoints.md"


class StoreError(EnnError):
    """A state store (the MLflow database) cannot be read: names the file and the fix."""

    exit_code = 10


class NoSpaceError(EnnError):
    """A disk ran full: names the path, its free space, and what to do."""

    exit_code = 11

    @classmethod
    def at(cls, path: str | Path, what: str = "") -> NoSpaceError:
        """The error for `path`'s file system, with its free space (`what`: what was written)."""
        where = Path(path)
        while not where.exists() and where != where.parent:
            where = where.parent
        try:
            usage = shutil.disk_usage(where)
            free = f"{usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.0f} MiB"
        except OSError:
            free = "free space unknown"
        done = f" while writing {what}" if what else ""
        return cls(
            f"{path}: no space left on the device{done} ({free}); free space there, or set "
            "runtime.work_dir (and checkpoint.dir) to a disk with room, then re-run"
        )


def no_space_behind(error: BaseException, paths: Iterable[str | Path]) -> NoSpaceError | None:
    """The NoSpaceError behind `error`, whatever library wrapped it first (an OSError ENOSPC,
    MLflow's "database or disk is full", a Prefect API answering 500 because its database is
    full): the error itself says so, or one of `paths` has (almost) no room left."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return NoSpaceError.at(error.filename or next(iter(paths), "."))
    full = low_space(paths)
    return NoSpaceError.at(full) if full is not None else None


def low_space(paths: Iterable[str | Path], margin: int = 1 << 20) -> Path | None:
    """The first of `paths` whose file system has less than `margin` bytes free, or None."""
    for path in paths:
        where = Path(path)
        while not where.exists() and where != where.parent:
            where = where.parent
        try:
            if shutil.disk_usage(where).free < margin:
                return Path(path)
        except OSError:
            continue
    return None


class OutOfMemory(EnnError):
    """Out of memory: names the stage, what it tried to hold and the setting that lowers it."""

    exit_code = 13
    docs = "docs/troubleshooting.md"


# What an out-of-memory error says it tried to hold: numpy's MemoryError ("Unable to allocate
# 76.3 GiB for an array with shape (39215, 511, 511) and data type float64"), torch's CPU
# allocator ("DefaultCPUAllocator: can't allocate memory: you tried to allocate 400000000000
# bytes") and its CUDA allocator ("CUDA out of memory. Tried to allocate 2.00 GiB").
_NUMPY_HELD = re.compile(r"Unable to allocate (.+? for an array with shape \([^)]*\))")
_TORCH_HELD = re.compile(r"(?:you tried|Tried) to allocate ([\d.]+ ?[KMGTP]?i?B|\d+ bytes)")
_OOM_TEXT = ("out of memory", "can't allocate memory", "cannot allocate memory")


def oom_held(kind: str, message: str) -> str | None:
    """What an out-of-memory error (its class name `kind`, its message) tried to hold, as a
    reader wants it ("76.3 GiB for an array with shape (...)", "372.5 GiB"; "" when it does not
    say); None when the error is not out of memory. Class names, not classes: a worker's error
    record (enn_core.runtime.watchdog) has only those, and this module imports neither numpy
    nor torch."""
    text = message.lower()
    if not (kind.endswith("MemoryError") or _said_oom(kind, text)):
        return None
    numpy = _NUMPY_HELD.search(message)
    if numpy is not None:
        return numpy.group(1)
    torch = _TORCH_HELD.search(message)
    if torch is None:
        return ""
    held = torch.group(1)
    if held.endswith(" bytes"):
        held = f"{_size(int(held.split()[0]))} ({held})"
    return held


def _said_oom(kind: str, text: str) -> bool:
    """A RuntimeError that says so (torch's allocators), or an OSError ENOMEM (mmap, fork)."""
    if kind == "OSError":
        return text.startswith(f"[errno {errno.ENOMEM}]")
    return kind == "RuntimeError" and any(s in text for s in _OOM_TEXT)


def _size(n: int) -> str:
    """Bytes as numpy says them (372.5 GiB)."""
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024:
            return f"{value:.1f} {unit}"
    return f"{value / 1024:.1f} PiB"


def out_of_memory(error: BaseException, stage: str, lower: Iterable[str]) -> OutOfMemory | None:
    """`error` as the one line of a stage that ran out of memory (`lower`: the settings that
    lower what it holds, e.g. `predict.batch_size`), or None when it is not out of memory: a
    MemoryError (numpy's included), torch's (CPU and CUDA allocators), or an OutOfMemory raised
    below (a worker's, read by the launcher) that does not name its stage or a setting yet."""
    settings = list(lower)
    which = settings[0] if len(settings) == 1 else f"one of {', '.join(settings)}"
    fix = (
        f"; lower {which} and run it again"
        if settings
        else "; no setting bounds what it holds: run it where more memory is free"
    )
    if isinstance(error, OutOfMemory):
        text = str(error)
        if text.startswith(f"{stage}: "):
            return None  # already this stage's line
        named = any(s in text for s in settings)  # the governor's line names its own
        return OutOfMemory(f"{stage}: {text}{'' if named else fix}")
    held = oom_held(type(error).__name__, str(error))
    if held is None:
        return None
    said = (str(error).splitlines() or ["it says no more"])[0]
    what = f"tried to allocate {held}" if held else said
    return OutOfMemory(f"{stage}: out of memory: {what} ({type(error).__name__}){fix}")


class TransientError(EnnError):
    """A failure that may succeed on retry (worker launch, rendezvous, I/O)."""

    exit_code = 75  # EX_TEMPFAIL


class WorkerError(EnnError):
    """A distributed worker failed or hung; names the rank and its last phase."""

    exit_code = 9


INTERRUPTED = 130  # Ctrl-C, or the flow run was cancelled (Prefect)
TERMINATED = 143  # SIGTERM


def exit_codes() -> dict[int, str]:
    """Every exit code of `enn` and what it means, in order; a code two classes of this module
    share (StaleOutputError, UntrustedCheckpointError) lists both. Subclasses defined elsewhere
    (a test's injected fault) mean what their base means, so the list does not depend on which
    modules happen to be imported."""
    ours = [c for c in _subclasses(EnnError) if c.__module__ == __name__]
    codes = {0: "success"}
    for cls in sorted(ours, key=lambda c: c.exit_code):
        doc = (cls.__doc__ or cls.__name__).strip().splitlines()[0]
        said = f"{codes[cls.exit_code]} " if cls.exit_code in codes else ""
        codes[cls.exit_code] = f"{said}{cls.__name__}: {doc}"
    codes[EnnError.exit_code] = (
        "any other failure (one not named by the codes below prints its traceback)"
    )
    codes[INTERRUPTED] = "interrupted: Ctrl-C, or the flow run was cancelled in Prefect"
    codes[TERMINATED] = "terminated: SIGTERM (workers stopped, lock released)"
    return dict(sorted(codes.items()))


def _subclasses(cls: type[EnnError]) -> list[type[EnnError]]:
    out: list[type[EnnError]] = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out
