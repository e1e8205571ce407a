"""`enn tune`'s study: where it lives (`work/tune/<study>.db`, `work/tune/<study>/`), how its
trials run, and what hosts sharing it need (docs/design.md, "Tuning", "A study across hosts")."""

from __future__ import annotations

import contextvars
import copy
import json
import logging
import shutil
import socket
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import yaml
from optuna.exceptions import UpdateFinishedTrialError
from optuna.storages import RetryHeartbeatStaleTrialCallback as Retry
from optuna.study import Study
from optuna.trial import FrozenTrial, TrialState

from enn_core.config import RunConfig, sections_of
from enn_core.config.tune import check_study_name
from enn_core.errors import ConfigError, DataError
from enn_core.paths import Layout
from enn_core.runtime.device import usable_cores
from enn_core.stages import STAGE_DATA
from tasks.runner import PipelineSession, execute_stage
from tasks.tuning import store

log = logging.getLogger("enn.tune")
START_TOLERANCE_S = 0.01  # psutil's create_time of one process, read twice, agrees to this


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
    def shown(self) -> str:
        return store.shown(self.storage)

    @property
    def staged(self) -> Path:
        return self.folder / "outputs" / STAGE_DATA.name


def slots(cfg: RunConfig, cores: int, gpus: int) -> tuple[int, int]:
    """(trials side by side, threads per worker) within the GPUs, or the cores."""
    want = cfg.tune.parallel
    if gpus and cfg.runtime.device != "cpu":
        threads = cfg.runtime.threads_per_worker or max(1, cores // gpus)
        return (min(want, gpus) if want else gpus), threads
    workers = max(1, cfg.runtime.world_size)
    most = max(1, cores // (workers * (cfg.runtime.threads_per_worker or 1)))
    parallel = min(want, most) if want else most
    threads = cfg.runtime.threads_per_worker or max(1, cores // (parallel * workers))
    return parallel, threads


def make_plan(cfg: RunConfig, config: Path, overrides: list[str], layout: Layout) -> StudyPlan:
    if not cfg.tune.space:
        raise ConfigError(
            f"{config}: tune.space is empty; declare what to search, e.g. "
            "tune: {space: {train.lr: {low: 0.001, high: 0.1, log: true}}} (docs/tuning.md)"
        )
    name = cfg.tune.study or config.stem
    check_study_name(name, "tune.study" if cfg.tune.study else f"the study name ({config.name})")
    gpus = 0
    if cfg.runtime.device != "cpu":
        import torch  # here: `enn tune --apply` reads the study without it

        gpus = torch.cuda.device_count()
    parallel, threads = slots(cfg, usable_cores(), gpus)
    folder = layout.work / "tune" / name
    on_server = bool(cfg.tune.storage)
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
        shared=on_server,
        identity=f"{socket.gethostname()}:{folder.resolve()}" if on_server else "",
    )


def storage_url(configured: str, root: Path, default: Path) -> str:
    """`tune.storage` (a relative SQLite path from the project root), or `default`."""
    if not configured:
        return f"sqlite:///{default}"
    file = store.sqlite_file(configured)
    if file is None or file.is_absolute():
        return configured
    query = configured.partition("?")[2]
    return f"sqlite:///{root / file}" + (f"?{query}" if query else "")


def stage_study_data(plan: StudyPlan, cfg: RunConfig) -> Path:
    """The study's data, staged again when this host's copy has other settings."""
    params = plan.staged / "params.json"
    want = json.loads(json.dumps(sections_of(cfg, STAGE_DATA.sections)))
    if params.is_file():
        try:
            if json.loads(params.read_text()) == want:
                return plan.staged
        except (ValueError, OSError) as e:
            raise DataError(
                f"{params}: damaged ({e}); delete {plan.staged} to stage the study's data again"
            ) from e
    layout = Layout(root=plan.root, work=plan.folder / "work", outputs_dir=plan.folder / "outputs")
    session = PipelineSession(cfg=cfg, config=plan.config, layout=layout, run_id="study")
    execute_stage(STAGE_DATA, session)
    return plan.staged


def override(key: str, value: Any) -> str:
    """`key=value` as `--set` parses it back (YAML: `1.0e-06`, not JSON's `1e-06`, a string)."""
    text = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
    return f"{key}={text}"


def shown(values: dict[str, Any]) -> str:
    """`train.lr=0.01173 model.layers=2`: a trial's values for a console line (4 digits)."""
    return " ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(values.items())
    )


def open_study(
    cfg: RunConfig, plan: StudyPlan, on_stale: store.StaleHook | None = None
) -> store.TuneStudy:
    plan.folder.mkdir(parents=True, exist_ok=True)
    return store.open_study(cfg, plan.name, plan.storage, plan.identity, on_stale)


def end_stale_trials(study: Study, plan: StudyPlan) -> list[int]:
    """The RUNNING trials a killed study of this checkout left: failed, run again."""
    ended = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        folder = trial_folder(plan, t.number)
        owner = store.TrialOwner.parse(t.user_attrs.get(store.OWNER_ATTR))
        if plan.shared and not left_here(owner, folder / "trial.json"):
            continue
        try:
            study.tell(t.number, state=TrialState.FAIL)
        except (ValueError, UpdateFinishedTrialError):  # it had ended: another host failed it
            pass
        else:
            retry(study, t.number)
        remove_checkpoints(folder)
        ended.append(t.number)
    return ended


def trial_folder(plan: StudyPlan, number: Any) -> Path:
    return plan.folder / f"trial-{store.trial_number(number, plan.shown)}"


def remove_checkpoints(folder: Path) -> None:
    """Delete a finished trial's checkpoints and .pt files (a link out of its folder is left)."""
    out = [folder / "work" / "checkpoints"]
    out += sorted((folder / "outputs").glob("*/*.pt")) if (folder / "outputs").is_dir() else []
    for p in [p for p in out if p.exists() and not p.is_symlink()]:
        if not p.resolve().is_relative_to(folder.resolve()):
            log.warning("trial folder %s: %s leads outside it; left alone", folder, p)
        elif p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def table(study: Study) -> list[dict[str, Any]]:
    """The study's trials, but those that never ran (asked while it was full)."""
    return [
        {
            "trial": t.number,
            "state": t.state.name.lower(),
            "value": t.value,
            "epochs": len(t.intermediate_values),
            "seconds": round(t.duration.total_seconds(), 1) if t.duration else None,
            **t.params,
        }
        for t in study.get_trials(deepcopy=False)
        if store.NOT_RUN_ATTR not in t.user_attrs
    ]


def best(study: Study) -> tuple[dict[str, Any], float, int] | None:
    """The best complete trial's values, objective and number (None before any completed)."""
    if not study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        return None
    t = study.best_trial
    return dict(t.params), float(t.value or 0.0), int(t.number)


def trial_command(job_file: Path) -> list[str]:
    return [sys.executable, "-m", "tasks.tuning.trial", str(job_file)]


def left_here(owner: store.TrialOwner | None, job_file: Path) -> bool:
    """Whether `owner` is this host's trial `job_file` of this checkout, its `enn tune` gone."""
    if owner is None or owner.host != socket.gethostname():
        return False
    if tuple(owner.cmdline[-3:]) != tuple(trial_command(job_file)[-3:]):
        return False
    if owner.study_pid <= 0:
        return True
    try:
        p = psutil.Process(owner.study_pid)
        same = abs(p.create_time() - owner.study_started) <= START_TOLERANCE_S
        return not (same and p.status() != psutil.STATUS_ZOMBIE)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return True


def retry_of(trial: FrozenTrial) -> int | None:
    """The trial `trial` runs again (the last of Optuna's retry history), if it ran."""
    ran = not {store.NOT_RUN_ATTR, store.DUPLICATE_ATTR} & set(trial.user_attrs)
    history = Retry.retry_history(trial) if ran else []
    return history[-1] if history else None


def retry(study: Study, number: int, stopped: bool = False) -> None:
    """Trial `number`'s point queued again (docs/design.md, "Retries are Optuna's")."""
    trials = study.get_trials(deepcopy=False)
    trial = copy.copy(next(t for t in trials if t.number == number))
    if {store.NOT_RUN_ATTR, store.DUPLICATE_ATTR} & set(trial.user_attrs):
        return
    if any(retry_of(t) == number for t in trials):
        return
    trial.user_attrs = {}  # its owner record and --set values are its own, not its retry's
    Retry(max_retry=None if stopped else 1)(study, trial)


class StaleTrials:
    """The storage's stale-trial callback, in the flow run's context."""

    def __init__(self) -> None:
        self.listeners: list[Callable[[int], None]] = []
        self.context = contextvars.copy_context()

    def __call__(self, study: Study, trial: FrozenTrial) -> None:
        self.context.copy().run(self.failed, study, trial)

    def failed(self, study: Study, trial: FrozenTrial) -> None:
        owner = store.TrialOwner.parse(trial.user_attrs.get(store.OWNER_ATTR))
        host = owner.host if owner else "an unknown host"
        log.warning("trial %d (on %s) missed its heartbeats: failed, run again", trial.number, host)
        retry(study, trial.number)
        for listener in self.listeners:
            listener(trial.number)


def duplicate_of(trials: Sequence[FrozenTrial], number: int) -> int | None:
    """The lower number of a trial that runs what trial `number` (just popped) runs: a point
    or a retry queued twice (a sampler may repeat a point on purpose)."""
    mine = next(t for t in trials if t.number == number)
    point, retry = mine.system_attrs.get("fixed_params"), retry_of(mine)
    for t in trials:
        if t.number >= number:
            continue
        if retry is not None and retry_of(t) == retry:
            return int(t.number)
        queued = t.system_attrs.get("fixed_params", t.params)
        if retry is None and point is not None and t.state != TrialState.FAIL and queued == point:
            return int(t.number)
    return None


def counts(trials: Sequence[FrozenTrial], below: int | None = None) -> tuple[int, set[int]]:
    """Complete or pruned trials, and the running ones (numbered `below`) that run."""
    done = sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials)
    running = {
        t.number
        for t in trials
        if t.state == TrialState.RUNNING
        and store.NOT_RUN_ATTR not in t.user_attrs
        and (below is None or t.number < below)
    }
    return done, running
