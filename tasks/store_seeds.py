"""Migrated, empty databases for Prefect and MLflow, made once per environment and copied into
a new work directory: the first `enn run` of a fresh clone otherwise waits for each tool's
migrations. Prefect's: 8 s to a healthy temporary API on a fresh file, 3 s on a migrated one
(the migrations alone take 5 to 7 s on two cores). MLflow's: 1.0 s to open a fresh store, 0.03 s
a migrated one, paid by the flow's first MLflow call, after the API answered.

    python -m tasks.store_seeds    # scripts/setup.sh: makes them once per tool version
    seed(db, "prefect")            # tasks.env: a missing database starts as a copy, 0600

The seeds live in the environment (`<sys.prefix>/share/enn/<tool>-<version>.db`), named by the
installed tool's version, so an upgraded tool never starts from an older schema (it finds no
seed of its version and migrates as before). They hold only the schema each tool's own
migrations write (Prefect's `prefect server database upgrade`; MLflow's store opening an empty
file): no run, flow, experiment or path. MLflow's Default experiment, whose artifact location
is the store's, is removed from the seed; MLflow makes it again where the copy is opened.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import shutil
import sqlite3
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Literal

Store = Literal["prefect", "mlflow"]
STORES: tuple[Store, ...] = ("prefect", "mlflow")


def seed_path(store: Store, prefix: str | Path = sys.prefix) -> Path:
    version = importlib.metadata.version(store)
    return Path(prefix) / "share" / "enn" / f"{store}-{version}.db"


def make(store: Store, prefix: str | Path = sys.prefix) -> Path | None:
    """The seed of `store` for this environment, made now when missing; None when the tool's
    migrations failed (their output goes to stderr)."""
    target = seed_path(store, prefix)
    if usable(target, store):
        return target  # else made again, over a seed that holds rows or is a link
    print(f"setup: preparing an empty {store} database for new work directories (once)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        db = Path(tmp) / f"{store}.db"
        done = _migrate(store, db, Path(tmp))
        if done.returncode != 0 or not db.is_file():
            sys.stderr.write(done.stdout[-2000:] + done.stderr[-2000:])
            return None
        os.chmod(db, 0o644)  # copied 0600 into each work directory (seed)
        os.replace(db, target)
    return target


# MLflow migrates an empty file when its store opens it, and adds the Default experiment (id 0)
# with an artifact location under the given root: the seed keeps the schema only
MLFLOW_MIGRATE = """
import sys
from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
SqlAlchemyStore(f"sqlite:///{sys.argv[1]}", sys.argv[2]).engine.dispose()
"""


def _migrate(store: Store, db: Path, tmp: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "DO_NOT_TRACK": "1"}
    if store == "prefect":
        env |= {
            "PREFECT_HOME": str(tmp),
            "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{db}",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        }
        env.pop("PREFECT_API_URL", None)
        cmd = [str(Path(sys.executable).parent / "prefect"), "server", "database", "upgrade", "-y"]
    else:
        cmd = [sys.executable, "-c", MLFLOW_MIGRATE, str(db), str(tmp / "artifacts")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if store == "mlflow" and done.returncode == 0 and db.is_file():
        try:
            with contextlib.closing(sqlite3.connect(db)) as conn, conn:
                conn.execute("DELETE FROM experiment_tags")
                conn.execute("DELETE FROM experiments")
        except sqlite3.Error as e:  # another MLflow's schema: no seed, it migrates as before
            return subprocess.CompletedProcess(cmd, 1, "", f"{db}: {e}\n")
    return done


# What a seed must hold no row of (a seed is the schema only): checked before each copy, so a
# seed left by another recipe, or changed since, is not copied into a work directory
EMPTY_TABLES = {"prefect": ("flow_run", "deployment"), "mlflow": ("experiments", "runs")}


def usable(source: Path, store: Store) -> bool:
    """`source` is a plain file (not a link) holding the tool's schema and none of its rows."""
    try:
        if not stat.S_ISREG(os.lstat(source).st_mode):
            return False
        with contextlib.closing(sqlite3.connect(f"{source.as_uri()}?mode=ro", uri=True)) as conn:
            return not any(
                conn.execute(f"SELECT 1 FROM {table} LIMIT 1").fetchone()  # noqa: S608 - ours
                for table in EMPTY_TABLES[store]
            )
    except (OSError, sqlite3.Error):
        return False


def seed(db: Path, store: Store, prefix: str | Path = sys.prefix) -> bool:
    """Start a missing `db` as a copy of the environment's seed of `store` (0600); whether it
    did. An existing file, or a link in its place, is never touched."""
    if os.path.lexists(db):  # every `enn` start but the first: no lookup of the tool's version
        return False
    source = seed_path(store, prefix)
    if not usable(source, store):
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
    sys.exit(0 if all(make(s) is not None for s in STORES) else 1)
