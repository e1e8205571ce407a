"""The job secret: what the members of one distributed job know and nobody else does.

Every process of a job that talks over the network (the agents' rendezvous, the workers,
under `enn` and under torchrun) reads the same secret from a host-local file whose path is in
the environment variable `ENV` (ENN_JOB_SECRET_FILE). The file is the scheduler's or the
user's: mode 0600, owned by the user running the job, at least 16 characters of which at least
5 differ (its bytes, with surrounding whitespace stripped, are the key). A link is followed
only to a file inside its own folder, on the same file system (a Kubernetes Secret volume:
`secret -> ..data/secret`, `..data -> ..<timestamp>/`); that file is checked as a plain one.
It is never on a command line, in a params file, the console, MLflow or Prefect: only its path
travels, in the environment.

What it keys (HMAC-SHA256):
- the rendezvous state and every value the agents read from the rendezvous store
  (enn_core.runtime.stores): a value without a valid MAC is never unpickled nor used;
- the prediction parts and their markers in the shared parts folder (enn_core.predict.chunks):
  a part whose marker fails its MAC is recomputed, never published.

Interface for the launcher (the one call it makes before it starts a job):

    extra = launch_env(work_dir, nnodes)   # -> {} or {ENV: path}; add to the torchrun child's env

- ENV already set: the file is checked (one line if it is missing, a link out of its folder,
  readable by others, not this user's, too short or too uniform) and `{}` is returned: the
  child inherits it;
- one node and none set: `<work_dir>/job-secret` is made once (0600, 32 random bytes, hex)
  and reused by later launches, so kept prediction parts stay valid for a resumed run; a
  local user who can reach the loopback rendezvous port cannot read it;
- several nodes and none set: one line saying how to make one (`how_to_make`).

Making one by hand (the first node), then copying it to every node of the job:

    umask 077; python -c 'import secrets; print(secrets.token_hex(32))' > ~/.enn-job-secret
    scp -p ~/.enn-job-secret node2:~/   # every node, a host-local path, never a shared folder
    export ENN_JOB_SECRET_FILE=~/.enn-job-secret
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

from enn_core.errors import ConfigError

ENV = "ENN_JOB_SECRET_FILE"
FILE_NAME = "job-secret"
MIN_CHARS = 16
MAX_BYTES = 4096
MIN_DISTINCT = 5  # fewer distinct bytes (`aaaa...`, `abab...`) is no secret


def how_to_make() -> str:
    """The fix, in one line, for a job without a secret."""
    return (
        "make one on the first node (umask 077; python -c 'import secrets; "
        "print(secrets.token_hex(32))' > ~/.enn-job-secret), copy it to every node "
        f"(scp -p, a host-local path) and export {ENV}=~/.enn-job-secret on each"
    )


def load(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The job secret named by `ENV`, or None when the variable is unset or empty."""
    env = os.environ if environ is None else environ
    where = env.get(ENV, "")
    if not where:
        return None
    return read(Path(where))


def read(path: Path) -> bytes:
    """The secret in `path`, after the checks the module docstring lists (one line each)."""
    name = f"{ENV}={path}"
    try:
        st = os.lstat(path)
    except OSError as e:
        raise ConfigError(f"{name}: {e.strerror}; {how_to_make()}") from None
    target = _mounted_target(Path(path), name) if stat.S_ISLNK(st.st_mode) else Path(path)
    st = os.lstat(target)
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(
            f"{name} is not a regular file (a link or a folder); name the file itself"
        )
    _check_owner_and_mode(st, name, target)
    fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        opened = os.fstat(f.fileno())
        if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):  # swapped meanwhile
            raise ConfigError(f"{name} changed while it was read; name a file nobody rewrites")
        key = f.read(MAX_BYTES + 1).strip()
    if len(key) < MIN_CHARS or len(key) > MAX_BYTES:
        raise ConfigError(
            f"{name} holds {len(key)} bytes; a job secret is {MIN_CHARS} to {MAX_BYTES} "
            "(e.g. python -c 'import secrets; print(secrets.token_hex(32))')"
        )
    if len(set(key)) < MIN_DISTINCT:
        raise ConfigError(
            f"{name} holds only {len(set(key))} distinct character(s): anyone could guess it; "
            "make a random one (python -c 'import secrets; print(secrets.token_hex(32))')"
        )
    return key


def _check_owner_and_mode(st: os.stat_result, name: str, target: Path) -> None:
    if st.st_uid != os.geteuid():
        raise ConfigError(f"{name} belongs to uid {st.st_uid}, not to this user; use your own file")
    if st.st_mode & 0o077:
        raise ConfigError(
            f"{name} is readable by others (mode {stat.S_IMODE(st.st_mode):04o}); "
            f"chmod 600 {target}"
        )


def _mounted_target(path: Path, name: str) -> Path:
    """The file a link at `path` leads to, accepted only in the layout a Kubernetes Secret
    volume has (`secret -> ..data/secret`, `..data -> ..<timestamp>/`, the kubelet's atomic
    writer): the final target lies inside the link's own folder, on the same file system,
    and the link is this user's or root's. Its owner and mode are then checked as a plain
    file's are. A link that leads anywhere else is one line."""
    folder = Path(os.path.realpath(path.parent))
    real = Path(os.path.realpath(path))
    link_owner = os.lstat(path).st_uid
    if link_owner not in (0, os.geteuid()):
        raise ConfigError(
            f"{name} is a link of uid {link_owner}, not this user's; name your own file"
        )
    try:
        same_fs = os.stat(real).st_dev == os.stat(folder).st_dev
    except OSError as e:
        raise ConfigError(
            f"{name}: its link leads nowhere ({e.strerror}); {how_to_make()}"
        ) from None
    if real == folder or not real.is_relative_to(folder) or not same_fs:
        raise ConfigError(
            f"{name} is a link leading out of its folder (to {real}); name the file itself "
            "(a link is followed only inside its own folder, as in a Kubernetes Secret volume)"
        )
    return real


def make(path: Path) -> Path:
    """A new secret file at `path` (0600, never through a link, never over a file: then
    FileExistsError), whole from its first moment: written aside and linked into place, so
    that processes starting at once (torchrun's ranks) never read it half written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
        os.link(tmp, path)  # never replaces: a file (or link) there is FileExistsError
    finally:
        tmp.unlink(missing_ok=True)
    return path


def launch_env(
    work_dir: Path, nnodes: int, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """What the launcher adds to its torchrun child's environment (module docstring)."""
    env = os.environ if environ is None else environ
    if env.get(ENV):
        load(env)  # checked now: one line before any process starts
        return {}
    if nnodes > 1:
        raise ConfigError(
            f"a job of runtime.nnodes={nnodes} needs a job secret in {ENV} (the rendezvous "
            f"store authenticates every value with it); {how_to_make()}"
        )
    path = Path(work_dir) / FILE_NAME
    if not os.path.lexists(path):
        try:
            make(path)
        except FileExistsError:  # another launch made it first
            pass
    read(path)
    return {ENV: str(path)}


def mac(key: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 over `parts`, each length-prefixed (no two tuples give one message)."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        h.update(len(p).to_bytes(8, "big"))
        h.update(p)
    return h.digest()


def valid(key: bytes, tag: bytes, *parts: bytes) -> bool:
    """Whether `tag` is the MAC of `parts` under `key` (constant-time comparison)."""
    return hmac.compare_digest(tag, mac(key, *parts))
