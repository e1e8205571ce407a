"""A migrated, empty Prefect database, made once per environment and copied into a new work
directory's Prefect home: the first `enn run` of a fresh clone otherwise waits for Prefect's
migrations while its temporary API starts (8 s to a healthy API on a fresh file, 3 s on a
migrated one; the migrations alone take 5 to 7 s on two cores).

    python -m tasks.prefect_seed   # scripts/setup.sh: makes it once per Prefect version
    seed(db)                       # tasks.env: a missing prefect.db starts as a copy, 0600

The seed lives in the environment (`<sys.prefix>/share/enn/prefect-<version>.db`), named by
the installed Prefect's version, so an upgraded Prefect never starts from an older schema (it
finds no seed of its version and migrates as before). It holds no run, flow or setting: only
the schema Prefect's own `prefect server database upgrade` writes.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def seed_path(prefix: str | Path = sys.prefix) -> Path:
    version = importlib.metadata.version("prefect")
    return Path(prefix) / "share" / "enn" / f"prefect-{version}.db"


def make(prefix: str | Path = sys.prefix) -> Path | None:
    """The seed of this environment, made now when missing; None when Prefect's migrations
    failed (their output goes to stderr)."""
    target = seed_path(prefix)
    if target.is_file():
        return target
    print("setup: preparing an empty Prefect database for new work directories (once)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        db = Path(tmp) / "prefect.db"
        env = {
            **os.environ,
            "PREFECT_HOME": tmp,
            "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{db}",
            "DO_NOT_TRACK": "1",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        }
        env.pop("PREFECT_API_URL", None)
        prefect = Path(sys.executable).parent / "prefect"
        done = subprocess.run(
            [str(prefect), "server", "database", "upgrade", "-y"],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0 or not db.is_file():
            sys.stderr.write(done.stdout[-2000:] + done.stderr[-2000:])
            return None
        os.chmod(db, 0o644)  # copied 0600 into each work directory (seed)
        os.replace(db, target)
    return target


def seed(db: Path, prefix: str | Path = sys.prefix) -> bool:
    """Start a missing `db` as a copy of the environment's seed (0600); whether it did. An
    existing file, or a link in its place, is never touched."""
    if os.path.lexists(db):  # every `enn` start but the first: no lookup of Prefect's version
        return False
    source = seed_path(prefix)
    if not source.is_file():
        return False
    db.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=db.parent, prefix=".seed-", suffix=".db")
    try:
        with os.fdopen(fd, "wb") as out, open(source, "rb") as src:
            shutil.copyfileobj(src, out)
        os.link(tmp, db)  # fails if anything took the name meanwhile: theirs stays
    except OSError:
        return False
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return True


if __name__ == "__main__":
    sys.exit(0 if make() is not None else 1)
