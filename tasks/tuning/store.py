"""A study's storage, read as data: the one place that opens it and reads and checks its
records (docs/design.md, "The trust boundary on the newer surfaces": study records and
contents). Every failure of the storage is one line (`failure`)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import optuna
import psutil
from optuna.exceptions import StorageInternalError
from optuna.storages import RDBStorage
from optuna.storages._rdb.storage import _create_scoped_session
from optuna.study import Study, StudyDirection
from optuna.trial import FrozenTrial, TrialState

from enn_core.atomic import private_file
from enn_core.config import RunConfig, all_config_keys, redact_url, to_plain
from enn_core.config.tune import SEARCHABLE, TuneConfig
from enn_core.config.urls import pg_refused
from enn_core.errors import ConfigError, DataError, EnnError, NoSpaceError, StoreError

log = logging.getLogger("enn.tune")
SQLITE_HEADER = b"SQLite format 3\x00"
OPTUNA_TABLES = frozenset({"studies", "trials", "trial_params", "alembic_version"})
# every table of Optuna's schema: a database holding only some is one another host is creating
OPTUNA_SCHEMA = OPTUNA_TABLES | {
    *("study_directions", "study_system_attributes", "study_user_attributes", "version_info"),
    *("trial_heartbeats", "trial_intermediate_values", "trial_system_attributes"),
    *("trial_user_attributes", "trial_values"),
}
PLAIN = (type(None), str, int, bool)  # a searched value's types (a float: a finite one)
ANOTHER = "move it away, or name another study (--set tune.study=NAME)"
DATA_ATTR = "enn.data"  # the study's user attribute: the data section its trials train on
OWNER_ATTR = "enn.owner"  # a trial's user attributes: TrialOwner, ...
SETS_ATTR = "enn.sets"  # the --set values it trained under
NOT_RUN_ATTR = "enn.not_run"  # asked when the study was full: never ran, left out of tables
DUPLICATE_ATTR = "enn.duplicate_of"  # a point queued twice: never ran
CONNECT_TIMEOUT_S, SQLITE_BUSY_S, TABLE_RACE_TRIES = 10, 30, 3
StaleHook = Callable[[Study, FrozenTrial], None]


def sqlite_file(url: str) -> Path | None:
    if not url.startswith("sqlite:///"):
        return None
    return Path(url.removeprefix("sqlite:///").partition("?")[0])


def shown(url: str) -> str:
    file = sqlite_file(url)
    return str(file) if file is not None else redact_url(url)


def check_storage(url: str) -> None:
    """Before Optuna opens (and adds its tables to) it: empty or Optuna's, else StoreError."""
    file = sqlite_file(url)
    if file is not None and file.exists():
        if not file.is_file():
            raise StoreError(f"{file}: not a file, so not a study database; {ANOTHER}")
        with open(file, "rb") as f:
            head = f.read(len(SQLITE_HEADER))
        if head and head != SQLITE_HEADER:
            raise StoreError(f"{file}: not an SQLite database (damaged or foreign); {ANOTHER}")
    if file is not None and not (file.exists() and file.stat().st_size):
        return  # none yet, or an empty file
    import sqlalchemy

    engine = sqlalchemy.create_engine(url, **engine_options(url))
    try:
        with reading(url):
            tables = set(sqlalchemy.inspect(engine).get_table_names())
    finally:
        engine.dispose()
    if tables and not OPTUNA_TABLES <= tables and not tables <= OPTUNA_SCHEMA:
        raise StoreError(
            f"{shown(url)}: another program's database (tables {sorted(tables)[:4]}), not an "
            f"Optuna study; {ANOTHER}"
        )


def engine_options(url: str) -> dict[str, Any]:
    """SQLite waits for another writer; a silent server fails fast, a dropped link is replaced."""
    if sqlite_file(url) is not None:
        return {"connect_args": {"timeout": SQLITE_BUSY_S}}
    connect = {"connect_timeout": CONNECT_TIMEOUT_S} if url.startswith("postgresql") else {}
    return {"pool_pre_ping": True, "connect_args": connect}


def lost(e: BaseException) -> BaseException | None:
    """The database connection's error (OperationalError) behind `e`, as Optuna wraps it."""
    from sqlalchemy.exc import OperationalError

    seen: BaseException | None = e
    while seen is not None and not isinstance(seen, OperationalError):
        seen = seen.__cause__ or seen.__context__
    return seen


def failure(url: str, e: BaseException, records: bool = True) -> EnnError | None:
    """The one translator of a storage failure: `e` as one line naming the storage (a server's
    URL without its user), or None; `records`: a damaged record's error too."""
    from sqlalchemy.exc import SQLAlchemyError

    file, cause = sqlite_file(url), lost(e)
    gone = cause is not None and (file is None or not records)  # else: read, not reached
    said = (str(cause if gone else e).strip().splitlines() or [""])[0][:200]
    if "database or disk is full" in str(cause or e):
        return NoSpaceError.at(file or Path("."), "the study database")
    if gone and file is not None:
        return StoreError(f"{shown(url)}: the study database cannot be written ({said})")
    if gone and pg_refused(said):
        return ConfigError(
            f"{shown(url)}: the database server refused the login ({said}); check PGPASSWORD "
            "(or ~/.pgpass) for the user the URL names"
        )
    if gone:
        return StoreError(
            f"{shown(url)}: the study storage cannot be reached ({said}); check that the "
            "database server runs and answers from this host, and the password in PGPASSWORD "
            "or ~/.pgpass"
        )
    damaged = (ValueError, KeyError, IndexError, TypeError, RuntimeError) if records else ()
    if not isinstance(e, (SQLAlchemyError, *damaged)):
        return None
    return StoreError(
        f"{shown(url)}: the study database cannot be read ({type(e).__name__}: {said}); {ANOTHER}"
    )


@contextlib.contextmanager
def reading(url: str, records: bool = True) -> Iterator[None]:
    """A storage failure inside as one line (`failure`)."""
    try:
        yield
    except Exception as e:
        error = failure(url, e, records)
        if error is None:
            raise
        raise error from e


class Storage(RDBStorage):
    """Optuna's RDBStorage whose failed heartbeat is logged (its thread lives on), and whose
    queued trials are claimed by one thread at a time (Optuna's row lock is none on SQLite)."""

    _claim = threading.Lock()

    def set_trial_state_values(
        self, trial_id: int, state: TrialState, values: Sequence[float] | None = None
    ) -> bool:
        if state != TrialState.RUNNING:
            return super().set_trial_state_values(trial_id, state, values)
        with self._claim:
            return super().set_trial_state_values(trial_id, state, values)

    def adopt_orphans(self, study_id: int) -> None:
        """One beat for each RUNNING trial that never beat (docs/design.md, "Orphans")."""
        from optuna.storages._rdb import models

        with _create_scoped_session(self.scoped_session) as session:
            rows = (
                session.query(models.TrialModel.trial_id)
                .outerjoin(models.TrialHeartbeatModel)
                .filter(models.TrialModel.study_id == study_id)
                .filter(models.TrialModel.state == TrialState.RUNNING)
                .filter(models.TrialHeartbeatModel.trial_heartbeat_id.is_(None))
                .all()
            )
        for (trial_id,) in rows:
            self.record_heartbeat(trial_id)

    def record_heartbeat(self, trial_id: int) -> None:
        from sqlalchemy.exc import SQLAlchemyError

        try:
            super().record_heartbeat(trial_id)
        except (SQLAlchemyError, StorageInternalError) as e:
            log.debug("heartbeat of trial id %d not recorded: %s", trial_id, e)


class TuneStudy(optuna.Study):
    """Optuna's study whose `ask` first passes `gate` (objective.room), one thread at a time."""

    gate: Callable[[], None] | None = None
    _asking = threading.Lock()  # one per process: its threads ask in turn

    def ask(
        self, fixed_distributions: dict[str, optuna.distributions.BaseDistribution] | None = None
    ) -> optuna.Trial:
        with self._asking:
            if self.gate is not None:
                self.gate()
            return super().ask(fixed_distributions)


def rdb_storage(
    url: str, tune: TuneConfig | None = None, on_stale: StaleHook | None = None
) -> Storage:
    """The storage; with `tune`, Optuna's heartbeat and `on_stale` for a silent trial."""
    from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError

    beat: dict[str, Any] = {}
    if tune is not None:
        beat = dict(heartbeat_interval=tune.heartbeat_s, grace_period=tune.stale_after_s)
        beat["heartbeat_stale_trial_callback"] = on_stale
    for _ in range(TABLE_RACE_TRIES - 1):
        with contextlib.suppress(IntegrityError, ProgrammingError, OperationalError, RuntimeError):
            return Storage(url, engine_kwargs=engine_options(url), **beat)
        time.sleep(0.5 + random.random())  # another host is creating the tables
    return Storage(url, engine_kwargs=engine_options(url), **beat)


def open_study(
    cfg: RunConfig, name: str, url: str, identity: str = "", on_stale: StaleHook | None = None
) -> TuneStudy:
    """Study `name` (an SQLite file created 0600), checked; `tune.enqueue` queued once."""
    check_storage(url)
    if (file := sqlite_file(url)) is not None:
        private_file(file)
    t = cfg.tune
    pruner: optuna.pruners.BasePruner = optuna.pruners.NopPruner()
    if t.pruner == "median":
        pruner = optuna.pruners.MedianPruner(t.n_startup_trials, t.n_warmup_steps)
    with reading(url):
        storage = rdb_storage(url, t, on_stale)
        created = optuna.create_study(
            study_name=name, storage=storage, direction="minimize", load_if_exists=True
        )
        study = TuneStudy(study_name=name, storage=created._storage, pruner=pruner)
        check_trials(study, shown(url))
        want = json.loads(json.dumps(to_plain(cfg.data)))  # the first host's; the others' match
        had = study.user_attrs.get(DATA_ATTR)
        if had is None:
            study.set_user_attr(DATA_ATTR, want)
        elif had != want:
            changed = sorted(k for k in want if not isinstance(had, dict) or had.get(k) != want[k])
            raise ConfigError(
                f"study {study.study_name} ({shown(url)}) ran on other data settings "
                f"(data.{changed[0] if changed else '?'} differs); name a new study "
                "(--set tune.study=NAME), or use the data settings the study ran with"
            )
        trials = len(study.get_trials(deepcopy=False))  # a resumed study draws new points
        seed = t.seed + trials
        if identity:  # a shared study: each host draws its own points
            digest = hashlib.sha256(f"{t.seed}:{trials}:{identity}".encode()).digest()
            seed = int.from_bytes(digest[:4], "big")
        study.sampler = (
            optuna.samplers.TPESampler(seed=seed)
            if t.sampler == "tpe"
            else optuna.samplers.RandomSampler(seed=seed)
        )
        for values in t.enqueue:
            study.enqueue_trial(dict(values), skip_if_exists=True)
    return study


def load_study(name: str, url: str) -> Study:
    """Study `name` of an existing storage, checked (`enn tune --apply` reads it)."""
    file = sqlite_file(url)
    if file is not None and not file.exists():
        raise ConfigError(f"{file}: no study {name!r} here; run `enn tune` first")
    check_storage(url)
    with reading(url):
        storage = rdb_storage(url)
        if name not in optuna.get_all_study_names(storage):
            raise ConfigError(f"{shown(url)}: no study {name!r} here; run `enn tune` first")
        study = optuna.load_study(study_name=name, storage=storage)
        check_trials(study, shown(url))
    return study


def check_trials(study: Study, path: str) -> None:
    """One minimized objective, and every trial's values of keys a study searches."""
    directions = list(study.directions)
    if directions != [StudyDirection.MINIMIZE]:
        what = "has several objectives" if len(directions) > 1 else "maximizes its objective"
        raise DataError(
            f"{path}: study {study.study_name!r} {what}; enn tune minimizes one and did not "
            f"make it: {ANOTHER}"
        )
    keys = all_config_keys()
    for t in study.get_trials(deepcopy=False):
        trial_number(t.number, path)
        for key, value in t.params.items():
            finite = math.isfinite(value) if isinstance(value, float) else isinstance(value, PLAIN)
            if not (key.startswith(SEARCHABLE) and key in keys and finite):
                raise DataError(
                    f"{path}: trial {t.number} holds {key}={value!r}, which no study searches "
                    f"(model.* and train.* keys, plain values): not this project's study; "
                    f"{ANOTHER}"
                )


def trial_number(number: Any, where: str) -> int:
    """A trial's number as Optuna writes it (it names the trial's folder), else DataError."""
    if type(number) is not int or number < 0:  # SQLite stores text in any column
        raise DataError(
            f"{where}: a trial numbered {number!r}, which Optuna never writes (it names the "
            f"trial's folder): not this project's study; {ANOTHER}"
        )
    return number


def sets_of(study: Study, number: int) -> list[str]:
    """The --set values trial `number` trained under (`enn.sets`: a list of strings, else [])."""
    found = [t for t in study.get_trials(deepcopy=False) if t.number == number]
    sets = found[0].user_attrs.get(SETS_ATTR) if found else None
    return list(sets) if isinstance(sets, list) and all(isinstance(x, str) for x in sets) else []


@dataclass(frozen=True)
class TrialOwner:
    """A trial's `enn.owner`, written once as it starts: what `study.left_here` reads."""

    host: str
    cmdline: tuple[str, ...]  # as the study ran it: its job file names the study and trial
    study_pid: int = 0  # the `enn tune` process that started it (0: an older record)
    study_started: float = 0.0

    @classmethod
    def of(cls, command: list[str]) -> TrialOwner:
        me = psutil.Process()
        return cls(socket.gethostname(), tuple(command), me.pid, me.create_time())

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def parse(cls, raw: Any) -> TrialOwner | None:
        try:
            d = json.loads(raw) if isinstance(raw, str) else {}
            study = (int(d.get("study_pid", 0)), float(d.get("study_started", 0.0)))
            owner = cls(str(d["host"]), tuple(d["cmdline"]), *study)
        except (TypeError, ValueError, KeyError, AttributeError, OverflowError):
            return None
        return owner if all(isinstance(a, str) for a in owner.cmdline) else None
