"""A study in MLflow: one parent run (`tune <study>`), one child run per trial.

The parent (tags `enn.kind: tune`, `enn.tune.study`) is found again by a resumed study and by
every host of a shared study (hosts that both create one keep the earliest). A trial's child
is made by its host (tag `enn.host`): its values as parameters, `epoch/<metric>` per epoch,
`tune/objective`, tag `enn.tune.state` (complete, pruned, failed, interrupted; stale when
another host failed it). When a host's study stops, the parent gets the table
(`tune/trials.csv`, `tune/trials.json`), best values as tags `enn.tune.best.<key>`, counts and
Optuna's plots; it stays RUNNING while other hosts' trials run. MLflow failing mid-study (its
server gone, the experiment deleted) is one warning line; the study goes on untracked.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import tempfile
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optuna.study import Study
from optuna.trial import TrialState

from enn_core.config import RunConfig
from enn_core.config.tune import dimensions, points
from enn_core.config.urls import redact_text, redact_url
from enn_core.paths import Layout
from tasks.tracking import Tracker
from tasks.tracking.runs import TAG_KIND, ended_status

if TYPE_CHECKING:  # tuning calls this module; it needs only their types
    from tasks.tuning.objective import RunningTrial, TrialEnd

log = logging.getLogger("enn.tune")
TAG_STUDY, TAG_STATE, TAG_TRIAL = "enn.tune.study", "enn.tune.state", "enn.tune.trial"
STATUS = {"failed": "FAILED", "interrupted": "KILLED"}  # else FINISHED


class StudyTracker:
    """MLflow runs of one study (every call a no-op when tracking is off)."""

    def __init__(self, cfg: RunConfig, layout: Layout, study: str) -> None:
        self.tracker = Tracker(cfg, layout)
        self.on = self.tracker.enabled
        self.metric, self.dims, self.study = cfg.tune.metric, dimensions(cfg.tune), study
        self.parent: str | None = None
        self.children: dict[int, str] = {}
        self.lock = threading.Lock()

    @property
    def client(self) -> Any:
        return self.tracker.client

    def guarded(self, call: Callable[[], None]) -> None:
        """`call` (one thread at a time); MLflow failing is one line, then tracking is off."""
        with self.lock:
            if not self.on:
                return
            try:
                call()
            except Exception as e:  # noqa: BLE001 - MLflow's errors: server, store, experiment
                self.on = False
                first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
                log.warning(
                    "MLflow (%s) failed: %s; the study goes on untracked",
                    redact_url(self.tracker.uri),
                    redact_text(first),
                )

    def start(self, tags: dict[str, str]) -> str | None:
        if not self.on:
            return None
        own = self.tracker.own_tags()
        found = self.parents()
        if found:
            self.parent = found[0]
            self.client.update_run(self.parent, status="RUNNING")
            self.tracker.set_tags(self.parent, own)
            return self.parent
        all_tags = {**own, **tags, TAG_KIND: "tune", TAG_STUDY: self.study}
        mine = self.client.create_run(
            self.tracker.experiment_id, run_name=f"tune {self.study}", tags=all_tags
        ).info.run_id
        self.parent = self.parents()[0]  # another host may have made one at the same moment
        if self.parent != mine:
            self.client.delete_run(mine)
        return self.parent

    def parents(self) -> list[str]:
        """The study's parent runs, earliest first (by start time, then id)."""
        found = self.client.search_runs(
            [self.tracker.experiment_id],
            f"tags.`{TAG_STUDY}` = '{self.study}' and tags.`{TAG_KIND}` = 'tune'",
            max_results=100,
        )
        found.sort(key=lambda r: (r.info.start_time, r.info.run_id))
        return [r.info.run_id for r in found]

    def stale(self, number: int) -> None:
        """Trial `number`'s child (made by the host that died) marked stale and KILLED."""

        def mark() -> None:
            query = f"tags.`{TAG_STUDY}` = '{self.study}' and tags.`{TAG_TRIAL}` = '{number}'"
            for run in self.client.search_runs(
                [self.tracker.experiment_id], f"{query} and attributes.status = 'RUNNING'"
            ):
                self.tracker.set_tags(run.info.run_id, {TAG_STATE: "stale"})
                self.tracker.end(run.info.run_id, "KILLED", "its host stopped beating (stale)")

        self.guarded(mark)

    def started(self, trial: RunningTrial) -> None:
        def create() -> None:
            tags = {
                **self.tracker.own_tags(),
                "mlflow.parentRunId": str(self.parent),
                TAG_KIND: "trial",
                TAG_STUDY: self.study,
                TAG_TRIAL: str(trial.number),
                TAG_STATE: "running",
            }
            run = self.client.create_run(
                self.tracker.experiment_id, run_name=f"trial {trial.number}", tags=tags
            )
            self.children[trial.number] = run.info.run_id
            ran = points(trial.params, self.dims)
            self.tracker.log_params(run.info.run_id, {k: str(v) for k, v in ran.items()})

        if self.parent is not None:
            self.guarded(create)

    def reported(self, trial: RunningTrial, epoch: int, value: float) -> None:
        child = self.children.get(trial.number)
        if child:
            self.guarded(
                lambda: self.client.log_metric(child, f"epoch/{self.metric}", value, step=epoch)
            )

    def ended(self, trial: RunningTrial, end: TrialEnd) -> None:
        child = self.children.pop(trial.number, None)

        def close(child: str) -> None:
            if end.value is not None:
                self.client.log_metric(child, "tune/objective", end.value)
            state = {TAG_STATE: end.state, "enn.tune.seconds": f"{end.seconds:.1f}"}
            self.tracker.set_tags(child, state)
            self.tracker.log_artifact(child, trial.folder / "trial.log")
            self.tracker.end(child, STATUS.get(end.state, "FINISHED"))

        if child:
            self.guarded(lambda: close(child))

    def finish(self, study: Study, rows: list[dict[str, Any]], error: BaseException | None) -> None:
        """The table, best values, counts and plots on the parent; its status."""
        if self.parent is not None:
            self.guarded(lambda: self.close(study, rows, error))

    def close(self, study: Study, rows: list[dict[str, Any]], error: BaseException | None) -> None:
        parent = str(self.parent)
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            write_table(rows, folder)
            for name in ("trials.csv", "trials.json"):
                self.tracker.log_artifact(parent, folder / name, "tune")
            for png in plots(study, folder):
                self.tracker.log_artifact(parent, png, "plots")
        # every state, 0 included: a count that fell to 0 (the queued retry ran) is updated
        counts: dict[str, float] = {f"tune/n_{s.name.lower()}": 0.0 for s in TrialState}
        for row in rows:
            counts[f"tune/n_{row['state']}"] = counts.get(f"tune/n_{row['state']}", 0) + 1
        for name, value in counts.items():
            self.client.log_metric(parent, name, value)
        done = [r for r in rows if r["state"] == "complete" and r["value"] is not None]
        if done:
            top = min(done, key=lambda r: r["value"])
            self.client.log_metric(parent, "tune/best_value", top["value"])
            skip = {"trial", "state", "value", "epochs", "seconds"}
            ran = points({k: v for k, v in top.items() if k not in skip}, self.dims)
            best = {f"enn.tune.best.{k}": v for k, v in ran.items()}
            self.tracker.set_tags(parent, best | {"enn.tune.best.trial": top["trial"]})
        if error is None and any(r["state"] == "running" for r in rows):
            return  # other hosts' trials run on: the last host to stop ends the parent
        status = "FINISHED" if error is None else ended_status(error)
        self.tracker.end(parent, status, None if error is None else str(error))


def write_table(rows: list[dict[str, Any]], folder: Path) -> None:
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=keys)
    writer.writeheader()
    writer.writerows(rows)
    (folder / "trials.csv").write_text(buf.getvalue())
    (folder / "trials.json").write_text(json.dumps(rows, indent=1, default=str))


def plots(study: Study, folder: Path) -> list[Path]:
    """Optuna's optimization history and parameter importances as PNGs (importances need two
    complete trials); none when the storage cannot be read."""
    from optuna.visualization import matplotlib as ovm

    from tasks.tracking.plots import _pyplot

    try:
        complete = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
    except Exception:  # noqa: BLE001 - the storage gone: the study's error says so
        return []
    plt, out = _pyplot(), []
    for name, draw, needs in (
        ("optimization_history", ovm.plot_optimization_history, 1),
        ("param_importances", ovm.plot_param_importances, 2),
    ):
        if complete < needs:  # Optuna would only warn
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Optuna marks its matplotlib backend experimental
                ax = draw(study)
        except (ValueError, RuntimeError, ZeroDivisionError) as e:
            log.info("tune: no %s plot (%s)", name, e)
            continue
        path, figure = folder / f"{name}.png", ax.get_figure(root=True)
        assert figure is not None
        figure.tight_layout()
        figure.savefig(path, dpi=100)
        plt.close(figure)
        out.append(path)
    return out
