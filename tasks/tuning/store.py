"""A study's database, read as data (README, "Security notes").

`work/tune/<study>.db` may be damaged, restored from elsewhere or another program's file; what
it holds never reaches a trial or the params file unchecked:

- `check_database`: an SQLite file with Optuna's tables (or empty), else StoreError (exit 10):
  a damaged file or another program's database (Optuna would add its tables to it);
- `reading`: what SQLite or Optuna raise on a damaged record (JSON, an index out of range, an
  unknown schema) is one StoreError naming the file;
- `open_study` / `load_study`: the study, checked by `check_trials`: one minimized objective,
  trial numbers that are numbers (one names a folder), and every trial's values of keys a
  study searches (`model.*`, `train.*`), plain values; else DataError (exit 3);
- `space_values`: a trial's values as a trial or `--apply` gets them: keys of the config's own
  `tune.space` only, each a point of it; else DataError, nothing run or written.

The database is created 0600 (`enn_core.atomic.private_file`).
"""

from __future__ import annotations

import contextlib
import math
import sqlite3
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from enn_core.atomic import private_file
from enn_core.config import RunConfig, all_config_keys
from enn_core.config.tune import SEARCHABLE, Dimension
from enn_core.errors import ConfigError, DataError, NoSpaceError, StoreError

SQLITE_HEADER = b"SQLite format 3\x00"
OPTUNA_TABLES = frozenset({"studies", "trials", "trial_params", "alembic_version"})
ANOTHER = "move it away, or name another study (--set tune.study=NAME)"


def check_database(path: Path) -> None:
    """An Optuna SQLite database, an empty file or none; else one StoreError."""
    if not path.exists():
        return
    if not path.is_file():
        raise StoreError(f"{path}: not a file, so not a study database; {ANOTHER}")
    with open(path, "rb") as f:
        head = f.read(len(SQLITE_HEADER))
    if not head:
        return
    if head != SQLITE_HEADER:
        raise StoreError(f"{path}: not an SQLite database (a damaged or foreign file); {ANOTHER}")
    try:
        con = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        try:
            rows = con.execute("select name from sqlite_master where type = 'table'").fetchall()
        finally:
            con.close()
    except sqlite3.Error as e:
        raise StoreError(f"{path}: cannot be read as SQLite ({e}); {ANOTHER}") from e
    tables = {r[0] for r in rows}
    if tables and not OPTUNA_TABLES <= tables:
        raise StoreError(
            f"{path}: another program's database (tables {sorted(tables)[:4]}), not an Optuna "
            f"study; {ANOTHER}"
        )


@contextlib.contextmanager
def reading(path: Path, records: bool = True) -> Iterator[None]:
    """What SQLite raises (and with `records`, what Optuna raises on a damaged record or a
    schema it does not know) as one StoreError naming `path`; a full disk as NoSpaceError."""
    from sqlalchemy.exc import SQLAlchemyError

    damaged = (ValueError, KeyError, IndexError, TypeError, RuntimeError) if records else ()
    try:
        yield
    except (SQLAlchemyError, *damaged) as e:
        first = (str(e).splitlines() or [""])[0][:200]
        if "database or disk is full" in str(e):
            raise NoSpaceError.at(path, "the study database") from e
        raise StoreError(
            f"{path}: the study database cannot be read ({type(e).__name__}: {first}); {ANOTHER}"
        ) from e


def open_study(cfg: RunConfig, name: str, path: Path) -> Any:
    """Study `name` in the database at `path` (created, 0600, when missing), checked; its
    sampler seeded with `tune.seed` plus the trials it already has (a resumed study draws new
    points, not its first run's again); `tune.enqueue`'s points queued once."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    check_database(path)
    private_file(path)
    t = cfg.tune
    pruner = (
        optuna.pruners.MedianPruner(
            n_startup_trials=t.n_startup_trials, n_warmup_steps=t.n_warmup_steps
        )
        if t.pruner == "median"
        else optuna.pruners.NopPruner()
    )
    with reading(path):
        study = optuna.create_study(
            study_name=name,
            storage=f"sqlite:///{path}",
            sampler=optuna.samplers.RandomSampler(seed=t.seed),  # replaced below
            pruner=pruner,
            direction="minimize",
            load_if_exists=True,
        )
        check_trials(study, path)
    seed = t.seed + len(study.get_trials(deepcopy=False))
    study.sampler = (
        optuna.samplers.TPESampler(seed=seed)
        if t.sampler == "tpe"
        else optuna.samplers.RandomSampler(seed=seed)
    )
    for values in t.enqueue:
        study.enqueue_trial(dict(values), skip_if_exists=True)
    return study


def load_study(name: str, path: Path) -> Any:
    """Study `name` of an existing database, checked (`enn tune --apply` reads it)."""
    import optuna

    if not path.exists():
        raise ConfigError(f"{path}: no study {name!r} here; run `enn tune` first")
    check_database(path)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with reading(path):
        names = optuna.get_all_study_names(f"sqlite:///{path}")
        if name not in names:
            raise ConfigError(f"{path}: no study {name!r} here; run `enn tune` first")
        study = optuna.load_study(study_name=name, storage=f"sqlite:///{path}")
        check_trials(study, path)
    return study


def check_trials(study: Any, path: Path) -> None:
    """One minimized objective, and every trial's values of keys a study searches."""
    from optuna.study import StudyDirection

    directions = list(study.directions)
    if directions != [StudyDirection.MINIMIZE]:
        what = "has several objectives" if len(directions) > 1 else "maximizes its objective"
        raise DataError(
            f"{path}: study {study.study_name!r} {what}; enn tune minimizes one and did not "
            f"make it: {ANOTHER}"
        )
    keys = all_config_keys()
    for t in study.get_trials(deepcopy=False):
        if type(t.number) is not int or t.number < 0:  # SQLite stores text in any column
            raise DataError(
                f"{path}: a trial numbered {t.number!r}, which Optuna never writes (it names the "
                f"trial's folder): not this project's study; {ANOTHER}"
            )
        for key, value in t.params.items():
            if not (key.startswith(SEARCHABLE) and key in keys) or not plain(value):
                raise DataError(
                    f"{path}: trial {t.number} holds {key}={value!r}, which no study searches "
                    f"(model.* and train.* keys, plain values): not this project's study; "
                    f"{ANOTHER}"
                )


def plain(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    return value is None or isinstance(value, (str, int, bool))


def space_values(
    values: Mapping[str, Any], dims: Sequence[Dimension], where: str, then: str
) -> dict[str, Any]:
    """`values` when every key is one of `dims` and every value a point of it; else a
    DataError: `where` names the record, `then` what was not done."""
    space = {d.key: d for d in dims}
    extra = sorted(set(values) - set(space))
    if extra:
        raise DataError(
            f"{where} holds {extra[0]}, which is not a key of tune.space ({', '.join(space)}); "
            f"{then}"
        )
    for key, value in values.items():
        if not space[key].holds(value):
            raise DataError(f"{where} holds {key}={value!r}, outside tune.space.{key}; {then}")
    return dict(values)
