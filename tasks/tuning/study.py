"""`enn tune`'s study: Optuna's ask/tell loop over trial processes, pruned from their events.

    work/tune/<study>.db                     Optuna's storage (SQLite; or tune.storage's URL)
    work/tune/<study>/outputs/stage-data/    the study's staged data (its config's data section)
    work/tune/<study>/trial-<N>/             one trial: trial.json, trial.log, outputs/, work/

One loop in the calling thread starts trials (`tasks.tuning.trial`, each in its own process
group) up to the parallel slots, follows each trial's `epoch/<metric>` events, reports them
to Optuna and, when the pruner says so, kills the trial's process group and waits until every
process of it is gone (`end.json` records the pids and how long they took). A trial's
checkpoints are deleted when it ends. On start, trials a killed study left RUNNING are ended:
their process trees are killed (only processes this study started, `tasks/tuning/owner.py`)
and they are marked FAIL and queued again; the study then runs until `tune.n_trials` trials
are complete or pruned. The database is data (`tasks/tuning/store.py`): a trial runs only
values of the config's own `tune.space`.

Several hosts share a study through one storage (`tune.storage`, tasks/tuning/shared.py):
Optuna numbers the trials and pops each queued one to one host; each host counts every
host's trials against `tune.n_trials`, records heartbeats for its own and fails any host's
stale ones; a host whose own trials ended waits while other hosts' still run (one of them may
go stale and be queued again).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml

from enn_core.atomic import write_json
from enn_core.config import RunConfig, load_config, sections_of
from enn_core.config.tune import Dimension, check_study_name, dimensions, points
from enn_core.errors import ConfigError, DataError, TrainingError
from enn_core.events import EventTail
from enn_core.paths import Layout
from enn_core.stages import STAGE_DATA
from tasks.gc import size_of
from tasks.runner import PipelineSession, execute_stage
from tasks.tuning import shared, store
from tasks.tuning.owner import OWNER_ATTR, TrialOwner, claim, left_here, trial_command
from tasks.tuning.trial import TrialJob, checkpoint_files, events_file

log = logging.getLogger("enn.tune")
MAX_FAILED_IN_A_ROW = 3


@dataclass(frozen=True)
class StudyPlan:
    """Where a study lives and how its trials run."""

    name: str
    config: Path
    overrides: tuple[str, ...]  # the study's own --set (every trial gets them)
    root: Path
    folder: Path  # work/tune/<study>/
    storage: str  # sqlite:///.../work/tune/<study>.db, or tune.storage's URL
    parallel: int
    runtime: tuple[str, ...]  # each trial's runtime overrides (threads, progress)
    gpus: int
    shared: bool = False  # tune.storage is set: other hosts may run this study's trials
    identity: str = ""  # this host and checkout, in a shared study's sampler seed

    @property
    def database(self) -> Path | None:
        """The SQLite file, when the storage is one."""
        return store.sqlite_file(self.storage)

    @property
    def shown(self) -> str:
        """The storage as messages name it (a server's URL without its user info)."""
        return store.shown(self.storage)

    @property
    def staged(self) -> Path:
        return self.folder / "outputs" / STAGE_DATA.name


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def slots(cfg: RunConfig, cores: int, gpus: int) -> tuple[int, int]:
    """(trials side by side, threads per worker): one GPU per trial, or on CPU the cores
    shared so that trials x workers x threads never exceeds them."""
    want = cfg.tune.parallel
    if gpus and cfg.runtime.device != "cpu":
        most = gpus
        threads = cfg.runtime.threads_per_worker or max(1, cores // gpus)
        return (min(want, most) if want else most), threads
    workers = max(1, cfg.runtime.world_size)
    threads = cfg.runtime.threads_per_worker or 1
    most = max(1, cores // (workers * threads))
    parallel = min(want, most) if want else most
    threads = cfg.runtime.threads_per_worker or max(1, cores // (parallel * workers))
    return parallel, threads


def make_plan(cfg: RunConfig, config: Path, overrides: list[str], layout: Layout) -> StudyPlan:
    if not cfg.tune.space:
        raise ConfigError(
            f"{config}: tune.space is empty; declare what to search, e.g. "
            "tune: {space: {train.lr: {low: 0.001, high: 0.1, log: true}}} (README, Tuning)"
        )
    name = cfg.tune.study or config.stem
    check_study_name(name, "tune.study" if cfg.tune.study else f"the study name ({config.name})")
    gpus = gpu_count() if cfg.runtime.device != "cpu" else 0
    parallel, threads = slots(cfg, usable_cores(), gpus)
    folder = layout.work / "tune" / name
    shared_storage = bool(cfg.tune.storage)
    return StudyPlan(
        name=name,
        config=config,
        overrides=tuple(overrides),
        root=layout.root,
        folder=folder,
        storage=storage_url(cfg.tune.storage, layout.root, layout.work / "tune" / f"{name}.db"),
        parallel=parallel,
        runtime=(f"runtime.threads_per_worker={threads}", "runtime.progress=false"),
        gpus=gpus,
        shared=shared_storage,
        identity=f"{socket.gethostname()}:{folder.resolve()}" if shared_storage else "",
    )


def storage_url(configured: str, root: Path, default: Path) -> str:
    """`tune.storage`, an SQLite file's relative path taken from the project root; empty: the
    SQLite file `default`."""
    if not configured:
        return f"sqlite:///{default}"
    file = store.sqlite_file(configured)
    if file is None or file.is_absolute():
        return configured
    query = configured.partition("?")[2]
    return f"sqlite:///{root / file}" + (f"?{query}" if query else "")


def stage_study_data(plan: StudyPlan, cfg: RunConfig, study: Any = None) -> Path:
    """The study's staged data (its config's data section), staged once into its folder; a
    study whose trials ran on other data settings (another fold) is refused. On a shared
    storage the study itself holds its data settings (`store.check_data` compared them when
    it opened): this host's staged copy is only a cache, staged again when it differs."""
    layout = Layout(root=plan.root, work=plan.folder / "work", outputs_dir=plan.folder / "outputs")
    params = plan.staged / "params.json"
    want = json.loads(json.dumps(sections_of(cfg, STAGE_DATA.sections)))
    if params.is_file():
        try:
            had = json.loads(params.read_text())
        except (ValueError, OSError) as e:
            raise DataError(
                f"{params}: damaged ({e}); delete {plan.staged} to stage the study's data again"
            ) from e
        if had == want:
            return plan.staged
        if study is None:
            ran = plan.database is not None and plan.database.is_file()
        else:
            ran = not plan.shared and bool(study.get_trials(deepcopy=False))
        if ran:
            changed = sorted(
                k for k in want["data"] if had.get("data", {}).get(k) != want["data"][k]
            )
            raise ConfigError(
                f"study {plan.name} ({plan.shown}) ran on other data settings "
                f"(data.{changed[0] if changed else '?'} differs); name a new study "
                "(--set tune.study=NAME) or delete its database"
            )
    session = PipelineSession(cfg=cfg, config=plan.config, layout=layout, run_id="study")
    execute_stage(STAGE_DATA, session)
    return plan.staged


def override(key: str, value: Any) -> str:
    """`key=value` as `--set` parses it back (YAML: `1.0e-06`, where JSON's `1e-06` would be
    read as a string)."""
    text = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
    return f"{key}={text}"


def shown(values: dict[str, Any]) -> str:
    """`train.lr=0.01173 model.layers=2`: a trial's values for a console line (4 significant
    digits; the trial runs with the exact values, which trial.json and MLflow keep)."""
    return " ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(values.items())
    )


def distribution(dim: Dimension) -> Any:
    from optuna.distributions import (
        CategoricalDistribution,
        FloatDistribution,
        IntDistribution,
    )

    if dim.kind == "choice":
        return CategoricalDistribution(list(dim.choices))
    if dim.kind == "int":
        step = int(dim.step) if dim.step is not None else 1
        return IntDistribution(int(dim.low), int(dim.high), log=dim.log, step=step)
    return FloatDistribution(dim.low, dim.high, log=dim.log, step=dim.step)


def open_study(cfg: RunConfig, plan: StudyPlan, on_stale: store.StaleHook | None = None) -> Any:
    """The plan's study, created or resumed, its storage checked (`store.open_study`)."""
    plan.folder.mkdir(parents=True, exist_ok=True)
    return store.open_study(cfg, plan.name, plan.storage, plan.identity, on_stale)


def kill_tree(proc: psutil.Process, timeout: float = 10.0) -> tuple[list[int], float]:
    """SIGKILL a trial's process group and every descendant; wait until all are gone.
    Returns the pids and the seconds they took to go."""
    t0 = time.monotonic()
    procs = [proc, *proc.children(recursive=True)]
    pids = [p.pid for p in procs]
    try:
        if os.getpgid(proc.pid) == proc.pid:  # the trial leads its group (start_new_session)
            os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for p in procs:  # a descendant that left the group (none should) goes too
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    if alive:
        log.warning("trial processes still alive after %.0f s: %s", timeout, [p.pid for p in alive])
    return pids, time.monotonic() - t0


def end_stale_trials(study: Any, plan: StudyPlan, dims: tuple[Dimension, ...]) -> list[int]:
    """Trials a killed study left RUNNING: kill what of them still runs (only a process this
    study started here, `owner.claim`), mark them FAIL, enqueue their values again (when they
    are points of the space), delete their checkpoints. Returns their numbers. The default
    SQLite file is this checkout's alone (and `enn tune` holds its lock), so each of its
    running trials is one; on a shared storage only those `left_here` are (the others run on
    live studies elsewhere, or go stale by their heartbeat)."""
    from optuna.trial import TrialState

    ended = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        folder = trial_folder(plan, t.number)
        owner = TrialOwner.parse(t.user_attrs.get(OWNER_ATTR))
        if plan.shared and not left_here(owner, folder / "trial.json"):
            continue
        proc, why = claim(owner, folder / "trial.json")
        if proc is not None:
            kill_tree(proc)
        elif "gone" not in why:
            log.warning("trial %d: %s; left alone", t.number, why)
        if shared.fail(study, t.number):
            shared.requeue(study, t, dims, plan.shown)
        remove_checkpoints(folder)
        ended.append(t.number)
    return ended


def trial_folder(plan: StudyPlan, number: Any) -> Path:
    """`work/tune/<study>/trial-<N>/`; a number that is not one is the database's fault."""
    if type(number) is not int or number < 0:
        raise DataError(f"{plan.shown}: a trial numbered {number!r}: not this project's study")
    return plan.folder / f"trial-{number}"


def remove_checkpoints(folder: Path) -> int:
    """Delete a finished trial's checkpoints (only inside its own folder: a link that leads
    out is left); the bytes freed."""
    freed = 0
    inside = folder.resolve()
    for p in checkpoint_files(folder):
        if not p.resolve().is_relative_to(inside):
            log.warning("trial folder %s: %s leads outside it; left alone", folder, p)
            continue
        freed += size_of(p)
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return freed


@dataclass
class RunningTrial:
    """A trial process the loop follows."""

    trial: Any  # optuna.Trial
    folder: Path
    proc: subprocess.Popen
    started: float
    values: list[tuple[int, float]] = field(default_factory=list)
    pruned: bool = False
    events: EventTail = field(init=False)  # its distributed-train events, followed

    def __post_init__(self) -> None:
        self.events = EventTail(events_file(self.folder))

    @property
    def number(self) -> int:
        return int(self.trial.number)

    def new_values(self, metric: str) -> list[tuple[int, float]]:
        """The `epoch/<metric>` values appended to the trial's events since the last call."""
        out = [
            (int(rec["step"]), float(rec["value"]))
            for rec in self.events.new()
            if rec.get("type") == "metric" and rec.get("name") == f"epoch/{metric}"
        ]
        self.values += out
        return out


@dataclass(frozen=True)
class TrialEnd:
    """How a trial ended (the study's table row)."""

    number: int
    state: str  # complete | pruned | failed
    value: float | None
    params: dict[str, Any]
    epochs: int
    seconds: float
    pids: tuple[int, ...] = ()
    gone_s: float | None = None


class Hooks:
    """What the study tells its tracker (MLflow) as trials start, report and end."""

    def started(self, trial: RunningTrial) -> None: ...

    def reported(self, trial: RunningTrial, epoch: int, value: float) -> None: ...

    def ended(self, trial: RunningTrial, end: TrialEnd) -> None: ...

    def stale(self, number: int) -> None:
        """Trial `number` (any host's) was failed as stale and its values queued again."""


def start_trial(
    study: Any,
    cfg: RunConfig,
    plan: StudyPlan,
    slot: int,
    heartbeat: shared.Heartbeat | None = None,
) -> RunningTrial | None:
    """The next trial (a queued one first, else the sampler's) started as a process; None
    when the queued trial Optuna handed out duplicates a lower one (`shared.duplicate_of`)."""
    from optuna.trial import TrialState

    dims = dimensions(cfg.tune)
    trial = shared.ask(study, {d.key: distribution(d) for d in dims})
    if heartbeat is not None:  # from its first moment: a host that dies now leaves it stale
        heartbeat.beat(trial)
    twin = shared.duplicate_of(study, trial)
    if twin is not None:
        trial.set_user_attr(shared.DUPLICATE_ATTR, twin)
        study.tell(trial, state=TrialState.FAIL)
        log.info("trial %d: the point of trial %d (queued twice); not run", trial.number, twin)
        return None
    try:  # a point the database enqueued is data: only the space's keys and values run
        where = f"{plan.shown}: trial {trial.number}"
        point = store.space_values(trial.params, dims, where, "nothing run")
    except DataError:
        study.tell(trial, state=TrialState.FAIL)
        raise
    folder = trial_folder(plan, trial.number)
    if folder.is_symlink() or folder.is_file():
        folder.unlink()
    elif folder.exists():  # a number is never reused in one study; a leftover of another
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    values = [override(k, v) for k, v in points(point, dims).items()]  # 0.002358, not 17 digits
    study_sets = tuple(o for o in plan.overrides if not o.startswith("tune.storage="))
    overrides = (*study_sets, *values, *plan.runtime, "tracking.enabled=false")
    try:  # a value the config refuses is the study's error (the space), not a trial's
        load_config(plan.config, list(overrides))
    except ConfigError:
        study.tell(trial, state=TrialState.FAIL)
        raise
    job = TrialJob(
        number=trial.number,
        config=str(plan.config),
        overrides=overrides,
        root=str(plan.root),
        staged=str(plan.staged),
        folder=str(folder),
    )
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = plan.runtime[0].split("=")[1]
    if plan.gpus:
        env["CUDA_VISIBLE_DEVICES"] = str(slot % plan.gpus)
    command = trial_command(job.write())
    with open(folder / "trial.log", "wb") as out:
        proc = subprocess.Popen(
            command,
            cwd=plan.root,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group: pruning kills the group
        )
    trial.set_user_attr(OWNER_ATTR, TrialOwner.of(proc.pid, command).to_json())
    log.info("trial %d: %s", trial.number, shown(trial.params))
    return RunningTrial(trial, folder, proc, time.monotonic())


def poll_trial(
    study: Any, cfg: RunConfig, running: RunningTrial, hooks: Hooks, lost: bool = False
) -> TrialEnd | None:
    """Report new epoch values; prune when Optuna says so; the end once the trial ended. A
    trial the storage no longer holds as running (`lost`: another host failed it as stale
    when this host's heartbeats stopped reaching the storage, and queued it again) is stopped:
    its result is not this host's to tell."""
    from optuna.exceptions import UpdateFinishedTrialError

    try:
        if not lost:
            return _poll(study, cfg, running, hooks)
    except (UpdateFinishedTrialError, ValueError):
        if running.number in shared.counts(study)[1]:
            raise  # still running there: a damaged record, not a trial taken over
    pids, gone = [], 0.0
    if running.proc.poll() is None:  # reaped already: its pid may be another process's now
        with contextlib.suppress(psutil.NoSuchProcess):
            pids, gone = kill_tree(psutil.Process(running.proc.pid))
    running.proc.wait()
    log.warning(
        "trial %d was failed as stale by another host (no heartbeat for %d s): stopped here",
        running.number,
        cfg.tune.stale_after_s,
    )
    return _end(running, "failed", None, pids, gone)


def _poll(study: Any, cfg: RunConfig, running: RunningTrial, hooks: Hooks) -> TrialEnd | None:
    from optuna.trial import TrialState

    for epoch, value in running.new_values(cfg.tune.metric):
        running.trial.report(value, epoch)
        hooks.reported(running, epoch, value)
        if running.trial.should_prune():
            pids, gone = kill_tree(psutil.Process(running.proc.pid))
            running.proc.wait()
            running.pruned = True
            study.tell(running.trial, state=TrialState.PRUNED)
            return _end(running, "pruned", value, pids, gone)
    rc = running.proc.poll()
    if rc is None:
        return None
    running.new_values(cfg.tune.metric)  # what it wrote before it exited
    best = min((v for _, v in running.values), default=None)
    if rc == 0 and best is not None:
        study.tell(running.trial, best)
        return _end(running, "complete", best)
    study.tell(running.trial, state=TrialState.FAIL)
    tail = (running.folder / "trial.log").read_text(errors="replace").strip().splitlines()[-1:]
    log.warning("trial %d failed (exit %d): %s", running.number, rc, " ".join(tail))
    return _end(running, "failed", best)


def _end(
    running: RunningTrial,
    state: str,
    value: float | None,
    pids: list[int] | None = None,
    gone: float | None = None,
) -> TrialEnd:
    remove_checkpoints(running.folder)
    end = TrialEnd(
        number=running.number,
        state=state,
        value=value,
        params=dict(running.trial.params),
        epochs=len(running.values),
        seconds=time.monotonic() - running.started,
        pids=tuple(pids or ()),
        gone_s=gone,
    )
    write_json(running.folder / "end.json", end.__dict__)
    return end


def finished(study: Any) -> int:
    from optuna.trial import TrialState

    return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))


def run_study(
    study: Any,
    cfg: RunConfig,
    plan: StudyPlan,
    hooks: Hooks,
    should_stop: Callable[[], bool] = lambda: False,
) -> list[TrialEnd]:
    """Trials side by side until `tune.n_trials` of the study (every host's) are complete or
    pruned: a trial starts while a slot is free and the complete, pruned and running trials
    are fewer than `tune.n_trials`. Two hosts that count at the same moment may both start
    one, so hosts together end with at most `tune.n_trials + hosts - 1`. Each `heartbeat_s`,
    a beat for each running trial of this host and a sweep for stale ones (any host's)."""
    heartbeat = shared.Heartbeat(study, cfg.tune.heartbeat_s)
    running: dict[int, RunningTrial] = {}
    ends: list[TrialEnd] = []
    failed_in_a_row = 0
    waiting_said = False
    try:
        while True:
            if should_stop():
                log.warning("study %s stopped: its running trials are killed", plan.name)
                return ends
            heartbeat.tick([t.trial for t in running.values() if t.proc.poll() is None])
            done, busy = shared.counts(study)
            room = cfg.tune.n_trials - done - len(busy)
            if room > 0 and len(running) < plan.parallel:
                slot = min(set(range(plan.parallel)) - set(running))
                started = start_trial(study, cfg, plan, slot, heartbeat)
                if started is not None:
                    running[slot] = started
                    hooks.started(started)
                continue
            if not running:
                if done >= cfg.tune.n_trials:
                    return ends
                if not waiting_said:  # another host's trials run; one may go stale
                    others = ", ".join(str(n) for n in sorted(busy))
                    log.info("study %s: waiting for other hosts' trials %s", plan.name, others)
                    waiting_said = True
                time.sleep(1.0)
                continue
            for slot, trial in list(running.items()):
                end = poll_trial(study, cfg, trial, hooks, lost=trial.number not in busy)
                if end is None:
                    continue
                del running[slot]
                ends.append(end)
                hooks.ended(trial, end)
                log.info("trial %d: %s", end.number, describe(end, cfg.tune.metric))
                failed_in_a_row = failed_in_a_row + 1 if end.state == "failed" else 0
                if failed_in_a_row >= MAX_FAILED_IN_A_ROW:
                    raise TrainingError(
                        f"{MAX_FAILED_IN_A_ROW} trials failed in a row; the last one's log: "
                        f"{trial.folder / 'trial.log'}"
                    )
            time.sleep(0.5)
    finally:
        hand_back(study, cfg, plan, list(running.values()))


def hand_back(study: Any, cfg: RunConfig, plan: StudyPlan, running: list[RunningTrial]) -> None:
    """An interrupted study's trials: killed (no trial trains on without its study), failed
    and queued again at once (another host need not wait for them to go stale)."""
    from sqlalchemy.exc import SQLAlchemyError

    dims = dimensions(cfg.tune)
    for trial in running:
        if trial.proc.poll() is None:
            kill_tree(psutil.Process(trial.proc.pid))
            trial.proc.wait()
        remove_checkpoints(trial.folder)
        try:
            if shared.fail(study, trial.number):
                shared.requeue(study, trial.trial, dims, plan.shown)
        except SQLAlchemyError as e:  # the storage may be what interrupted the study
            log.warning("trial %d: not handed back (%s); it goes stale instead", trial.number, e)


def describe(end: TrialEnd, metric: str) -> str:
    value = f"{metric} {end.value:.4g}" if end.value is not None else "no value"
    gone = f"; its {len(end.pids)} processes gone in {end.gone_s:.1f} s" if end.pids else ""
    return f"{end.state} after {end.epochs} epoch(s), {value}, {end.seconds:.0f} s{gone}"


def table(study: Any) -> list[dict[str, Any]]:
    """The study's trials: number, state, objective, epochs, values."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        rows.append(
            {
                "trial": t.number,
                "state": t.state.name.lower(),
                "value": t.value,
                "epochs": len(t.intermediate_values),
                "seconds": round(t.duration.total_seconds(), 1) if t.duration else None,
                **t.params,
            }
        )
    return rows


def best(study: Any) -> tuple[dict[str, Any], float, int] | None:
    """The best complete trial's values, objective and number (None before any completed)."""
    from optuna.trial import TrialState

    if not study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        return None
    t = study.best_trial
    return dict(t.params), float(t.value), int(t.number)
