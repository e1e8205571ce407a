"""Atomic outputs: write beside the target under a temporary name, then rename into place.

An error or a kill leaves the previous output untouched; stale temporary siblings from a
killed run are removed at the next start (`clean_stale`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from enn_core.errors import ConfigError, DataError

TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"


def clean_stale(target: Path) -> list[Path]:
    """Remove temporary siblings of `target` left by a killed run whose process is gone."""
    removed: list[Path] = []
    parent = target.parent
    if not parent.exists():
        return removed
    for p in parent.iterdir():
        for prefix in (TMP_PREFIX, OLD_PREFIX):
            if p.name.startswith(f"{prefix}{target.name}-"):
                pid = p.name.rsplit("-", 2)[-2] if p.name.count("-") >= 2 else ""
                if pid.isdigit() and process_alive(int(pid)) and int(pid) != os.getpid():
                    continue  # another live process is writing it
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
                removed.append(p)
    return removed


def process_alive(pid: int) -> bool:
    """Whether `pid` runs (another user's process counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def umask() -> int:
    """The process umask, read without changing it (os.umask sets it while reading: another
    thread could create a file in that instant with no umask at all)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    old = os.umask(0o022)  # no /proc: the classic read, briefly
    os.umask(old)
    return old


@contextlib.contextmanager
def atomic_dir(target: str | Path) -> Iterator[Path]:
    """Yield a fresh temporary directory beside `target`; on success it replaces `target`."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(target)
    tmp = Path(
        tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{target.name}-{os.getpid()}-", dir=target.parent)
    )
    try:
        tmp.chmod(0o777 & ~umask())  # mkdtemp makes 0700; an output folder follows the umask
        yield tmp
        fsync_dir(tmp)
        if target.exists():
            old = target.parent / f"{OLD_PREFIX}{target.name}-{os.getpid()}-x"
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
        fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def atomic_file(target: str | Path, mode: str = "w") -> Iterator[IO[Any]]:
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(
        prefix=f"{TMP_PREFIX}{target.name}-{os.getpid()}-", dir=target.parent
    )
    try:
        os.fchmod(fd, 0o666 & ~umask())  # mkstemp makes 0600; a written file follows the umask
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def open_own(path: str | Path, flags: int = os.O_WRONLY | os.O_APPEND, mode: int = 0o666) -> int:
    """`os.open` of a file in a folder enn owns (a lock, a log), created when missing, never
    through a link: a link planted there (a copied or shared work directory) would make enn
    truncate or append to whatever it points at. A link or a non-file is one DataError."""
    return _plain_fd(path, flags | os.O_CREAT, mode, "enn writes there only to a file of its own")


def _plain_fd(path: str | Path, flags: int, mode: int, why: str) -> int:
    """`os.open(path, flags)` if `path` is a plain file, never through a link nor waiting on a
    pipe (O_NONBLOCK, which a plain file ignores); else one DataError naming it."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, mode)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENXIO):  # a link; a pipe nobody reads
            raise
        fd = -1
    if fd < 0 or not stat.S_ISREG(os.fstat(fd).st_mode):
        if fd >= 0:
            os.close(fd)
        raise DataError(f"{path} is a link or not a plain file; {why}: remove it, then re-run")
    os.set_blocking(fd, True)  # as opened before: children and locks inherit the flags
    return fd


def private_file(path: str | Path) -> Path:
    """A database only its owner reads (0600): created empty when missing (SQLite takes an
    empty file as a new database and makes its journals with the file's mode), and narrowed
    to 0600 when an older run left it (or its journals) readable by others."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    for p in [path, *(path.with_name(path.name + s) for s in ("-journal", "-wal", "-shm"))]:
        with contextlib.suppress(OSError):
            st = os.lstat(p)  # a link is left as it is: never follow one
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and st.st_mode & 0o077:
                os.chmod(p, 0o600)
    return path


def write_json(target: str | Path, obj: Any) -> None:
    with atomic_file(target) as f:
        json.dump(obj, f, indent=2, sort_keys=True, default=str)
        f.write("\n")


def fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def own_folder(path: Path, fix: str) -> Path:
    """A folder enn makes in a shared place under a name nobody could guess (a checkpoint's
    temporary folder), 0755, or the same one another process of the job made first: a link
    there, a file, or a folder others may write into (where a link could be put inside) is
    one ConfigError. The owner is not compared: on NFS with root squashing the job's own
    folders belong to `nobody`."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o755)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_mode & 0o022:
        raise ConfigError(
            f"{path} is not a folder only its owner writes (mode {stat.filemode(st.st_mode)}); "
            f"enn writes only into a folder it made: {fix}"
        )
    return path


def read_plain(path: Path) -> IO[bytes]:
    """`path` opened for reading if it is a plain file, never through a link nor waiting on
    a pipe (a model folder's files are data: a link there would choose what is read)."""
    return os.fdopen(_plain_fd(path, os.O_RDONLY, 0, "enn reads only a file there"), "rb")


def not_a_link(path: Path, fix: str) -> None:
    """A folder of ours in a shared place (checkpoint.dir, predict.parts_dir): a link there is
    one ConfigError (nothing is written or deleted through it); so is a file."""
    if os.path.islink(path):
        raise ConfigError(
            f"{path} is a link (to {os.readlink(path)}); enn writes there only into a folder "
            f"of its own and follows no link: {fix}"
        )
    if os.path.lexists(path) and not os.path.isdir(path):
        raise ConfigError(f"{path} is not a folder: {fix}")
