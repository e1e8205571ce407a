"""A study in MLflow: one parent run (`tune <study>`), one child run per trial.

The parent (tag `enn.kind: tune`, `enn.tune.study`) is found again when a study resumes, and
by every host of a shared study (hosts that start at once and both create one keep the
earliest and delete their own). A trial's child is made by the host that runs it (tag
`enn.host`) and holds its values as parameters, `epoch/<metric>` per epoch as the study reads
them, `tune/objective` and the tag `enn.tune.state` (complete, pruned, failed; stale when
another host failed it for its missed heartbeats). When a host's study stops, the parent gets
the table (`tune/trials.csv`, `tune/trials.json`), the best values as tags
`enn.tune.best.<key>`, counts as metrics and Optuna's plots (`plots/*.png`, matplotlib); it
stays RUNNING while other hosts' trials run.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import tempfile
import warnings
from pathlib import Path
from typing import Any

from enn_core.config import RunConfig
from enn_core.config.tune import dimensions, points
from enn_core.paths import Layout
from tasks.tracking import Tracker
from tasks.tracking.runs import TAG_KIND, ended_status
from tasks.tuning.study import Hooks, RunningTrial, TrialEnd

log = logging.getLogger("enn.tune")
TAG_STUDY = "enn.tune.study"
TAG_STATE = "enn.tune.state"
TAG_TRIAL = "enn.tune.trial"


class StudyTracker(Hooks):
    """MLflow runs of one study (every call a no-op when tracking is off)."""

    def __init__(self, cfg: RunConfig, layout: Layout, study: str) -> None:
        self.tracker = Tracker(cfg, layout)
        self.metric = cfg.tune.metric
        self.dims = dimensions(cfg.tune)
        self.study = study
        self.parent: str | None = None
        self.children: dict[int, str] = {}

    @property
    def client(self) -> Any:
        return self.tracker.client

    def start(self, tags: dict[str, str]) -> str | None:
        if not self.tracker.enabled:
            return None
        own = self.tracker._own_tags()
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
        if not self.tracker.enabled:
            return
        for run in self.client.search_runs(
            [self.tracker.experiment_id],
            f"tags.`{TAG_STUDY}` = '{self.study}' and tags.`{TAG_TRIAL}` = '{number}' "
            "and attributes.status = 'RUNNING'",
            max_results=10,
        ):
            self.tracker.set_tags(run.info.run_id, {TAG_STATE: "stale"})
            self.tracker.end(run.info.run_id, "KILLED", "its host stopped beating (stale)")

    def started(self, trial: RunningTrial) -> None:
        if not self.tracker.enabled or self.parent is None:
            return
        tags = {
            **self.tracker._own_tags(),
            "mlflow.parentRunId": self.parent,
            TAG_KIND: "trial",
            TAG_STUDY: self.study,
            TAG_TRIAL: str(trial.number),
            TAG_STATE: "running",
        }
        run = self.client.create_run(
            self.tracker.experiment_id, run_name=f"trial {trial.number}", tags=tags
        )
        self.children[trial.number] = run.info.run_id
        ran = points(trial.trial.params, self.dims)  # the values the trial runs
        self.tracker.log_params(run.info.run_id, {k: str(v) for k, v in ran.items()})

    def reported(self, trial: RunningTrial, epoch: int, value: float) -> None:
        child = self.children.get(trial.number)
        if child:
            self.client.log_metric(child, f"epoch/{self.metric}", value, step=epoch)

    def ended(self, trial: RunningTrial, end: TrialEnd) -> None:
        child = self.children.pop(trial.number, None)
        if not child:
            return
        if end.value is not None:
            self.client.log_metric(child, "tune/objective", end.value)
        self.tracker.set_tags(
            child, {TAG_STATE: end.state, "enn.tune.seconds": f"{end.seconds:.1f}"}
        )
        log_file = trial.folder / "trial.log"
        self.tracker.log_artifact(child, log_file)
        self.tracker.end(child, "FAILED" if end.state == "failed" else "FINISHED")

    def finish(self, study: Any, rows: list[dict[str, Any]], error: BaseException | None) -> None:
        """The table, best values, counts and plots on the parent; its status."""
        if not self.tracker.enabled or self.parent is None:
            return
        for child in self.children.values():  # interrupted trials
            self.tracker.set_tags(child, {TAG_STATE: "interrupted"})
            self.tracker.end(child, "KILLED")
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            write_table(rows, folder)
            for name in ("trials.csv", "trials.json"):
                self.tracker.log_artifact(self.parent, folder / name, "tune")
            for png in plots(study, folder):
                self.tracker.log_artifact(self.parent, png, "plots")
        counts: dict[str, float] = {}
        for row in rows:
            key = f"tune/n_{row['state']}"
            counts[key] = counts.get(key, 0) + 1
        for name, value in counts.items():
            self.client.log_metric(self.parent, name, value)
        done = [r for r in rows if r["state"] == "complete" and r["value"] is not None]
        if done:
            top = min(done, key=lambda r: r["value"])
            self.client.log_metric(self.parent, "tune/best_value", top["value"])
            skip = {"trial", "state", "value", "epochs", "seconds"}
            ran = points({k: v for k, v in top.items() if k not in skip}, self.dims)
            self.tracker.set_tags(
                self.parent,
                {f"enn.tune.best.{k}": v for k, v in ran.items()}
                | {"enn.tune.best.trial": top["trial"]},
            )
        if error is None and any(r["state"] == "running" for r in rows):
            return  # other hosts' trials run on: the last host to stop ends the parent
        status = "FINISHED" if error is None else ended_status(error)
        self.tracker.end(self.parent, status, None if error is None else str(error))


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


def plots(study: Any, folder: Path) -> list[Path]:
    """Optuna's optimization history and parameter importances as PNGs (matplotlib backend;
    importances need two complete trials)."""
    from optuna.trial import TrialState
    from optuna.visualization import matplotlib as ovm

    from tasks.tracking.plots import _pyplot

    complete = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
    plt = _pyplot()
    out = []
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
        path = folder / f"{name}.png"
        ax.figure.tight_layout()
        ax.figure.savefig(path, dpi=100)
        plt.close(ax.figure)
        out.append(path)
    return out
