"""The one MLflow helper: parent run per pipeline run, child run per stage, events forwarded.

enn_core never imports mlflow; stages write `events.jsonl` in their run directory and this
module forwards it (live, from a thread, for long stages). Runs are created through
`MlflowClient`, never the fluent "active run" API, because Prefect runs tasks in threads.

Lifecycle rules:
- a stage that fails marks its child run and the parent FAILED, with the error as a tag;
- a run left RUNNING by a killed process is marked KILLED at the next start (`sweep_killed`);
- a `dvc repro` of several stages groups them under one parent: the parent is keyed by the
  `dvc` process that runs the stages, re-opened by each stage and closed after it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from enn_core.config import RunConfig, to_logged
from enn_core.config.urls import TRACKING_FIX, check_no_credentials, redact_text, redact_url

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

    from tasks.tracking.registry import Registration

# mlflow is imported inside the functions that use it: importing this module has no side
# effects (`import mlflow` writes its telemetry state and an environment variable unless the
# entry point contained the environment first, tasks/env.py).
from enn_core.errors import ConfigError, NoSpaceError, Preempted, StoreError, TransientError
from enn_core.events import EVENTS_FILE
from enn_core.paths import Layout
from enn_core.stages import STAGE_DATA, StageSpec
from tasks.tracking.auth import CREDENTIALS, check_model_name, model_held, refused_credentials
from tasks.tracking.uris import client_for, use_store
from tasks.ui import mlflow_run_url

TAG_PID = "enn.pid"
TAG_PID_CREATED = "enn.pid_created"
TAG_HOST = "enn.host"
TAG_GROUP = "enn.group"
TAG_ERROR = "enn.error"  # why a run failed or was killed
TAG_KIND = "enn.kind"
TAG_FLOW = "enn.flow"
TAG_CHANGES = "enn.changes"  # JSON: what differs from the params file (flows/params_file.py)
TAG_NUMBER = "enn.number"  # the flow's run count: `training #3`
NUMBER_WINDOW = 20  # the newest parents whose numbers the next one follows
MAX_PARAM_LEN = 500
# Tracking URIs of a store on this machine (a run group's other nodes record elsewhere)
LOCAL_STORES: tuple[str, ...] = ("sqlite:", "file:", "/")
# MLflow 3 opens an experiment in the view its kind names; without it, the GenAI view.
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}


def _flatten(d: Any, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    else:
        out[prefix.rstrip(".")] = json.dumps(d) if not isinstance(d, str) else d
    return out


def git_commit(root: Path) -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        )
        commit = out.stdout.strip() if out.returncode == 0 else "unknown"
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


class Tracker:
    """MLflow runs for one pipeline run. Disabled (every call a no-op) when tracking is off."""

    def __init__(self, cfg: RunConfig, layout: Layout) -> None:
        self.enabled = cfg.tracking.enabled
        self.layout = layout
        # set whenever tracking is on; every use is behind `self.enabled`
        self.client: MlflowClient = None  # type: ignore[assignment]
        self.experiment_id = ""
        self.system_metrics = cfg.tracking.log_system_metrics
        self._monitors: dict[str, Any] = {}  # run id -> MLflow's SystemMetricsMonitor
        if not self.enabled:
            return
        uri = cfg.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI") or layout.mlflow_uri
        if not cfg.tracking.uri:  # the environment's, checked as tracking.uri is
            check_no_credentials(uri, "MLFLOW_TRACKING_URI", TRACKING_FIX)
        self.uri = uri
        layout.mlflow_dir.mkdir(parents=True, exist_ok=True)
        from mlflow.exceptions import MlflowException

        use_store(uri)
        probe_server(uri)
        try:
            self.client = client_for(uri)
            exp = self.client.get_experiment_by_name(cfg.tracking.experiment)
        except Exception as e:  # noqa: BLE001 - any failure to open the store, named below
            raise store_error(uri, e) from e
        if exp is None:
            loc = layout.mlflow_artifacts.as_uri() if uri.startswith("sqlite") else None
            try:
                self.experiment_id = self.client.create_experiment(
                    cfg.tracking.experiment, artifact_location=loc, tags=EXPERIMENT_KIND
                )
            except MlflowException as e:  # another host (a job array's task) made it first
                if e.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
                exp = self.client.get_experiment_by_name(cfg.tracking.experiment)
                if exp is None:
                    raise
        if exp is not None and exp.lifecycle_stage == "deleted":  # MLflow refuses runs in it
            raise ConfigError(
                f"MLflow experiment {cfg.tracking.experiment!r} (tracking.experiment) was "
                f"deleted; restore it (mlflow experiments restore -x {exp.experiment_id}, with "
                "MLFLOW_TRACKING_URI set to tracking.uri), set another tracking.experiment, or "
                f"delete it for good (mlflow gc --experiment-ids {exp.experiment_id})"
            )
        if exp is not None:
            self.experiment_id = exp.experiment_id
            for k, v in EXPERIMENT_KIND.items():
                if exp.tags.get(k) != v:
                    self.client.set_experiment_tag(self.experiment_id, k, v)
        self.sweep_killed()

    # -- run lifecycle -------------------------------------------------------------------
    def own_tags(self) -> dict[str, str]:
        p = psutil.Process()
        return {
            TAG_PID: str(p.pid),
            TAG_PID_CREATED: f"{p.create_time():.3f}",
            TAG_HOST: socket.gethostname(),
            **scheduler_tags(),
        }

    def start_parent(
        self,
        name: str,
        tags: dict[str, str],
        group: str | None = None,
        cfg: RunConfig | None = None,
        data: str = "",
        wait_s: float = 0.0,
    ) -> str | None:
        """The pipeline's parent run, holding the resolved parameters (`params.yaml`'s keys,
        dotted) so Compare lines them up with the results `summarize` adds at the end. With a
        `group`, the run of that group when there is one (waiting up to `wait_s` for the
        process that makes it), now held by this process."""
        if not self.enabled:
            return None
        if group:
            # a local store is this machine's alone: the other nodes' parents are elsewhere
            shared = not self.uri.startswith(LOCAL_STORES)
            found = self._group_run(group, wait_s if shared else 0.0)
            if found is not None:
                run_id = found.info.run_id
                from mlflow.entities import RunTag

                self.client.update_run(run_id, status="RUNNING")
                held = [RunTag(k, v) for k, v in self.own_tags().items()]
                self.client.log_batch(run_id, tags=held)  # who holds it now (sweep_killed)
                if TAG_ERROR in found.data.tags:  # an earlier holder's, killed or failed
                    self.client.delete_tag(run_id, TAG_ERROR)
                self._monitor(run_id, resumed=True)
                return str(run_id)
            if wait_s and shared:  # waited in vain: a parent of its own, out of the group
                group = None
        params = _flatten(to_logged(cfg)) if cfg is not None else {}
        all_tags = {
            **self.own_tags(),
            **source_tags(name, tags.get("enn.git_commit", "")),
            TAG_KIND: "pipeline",
            TAG_FLOW: name,
            **tags,
        }
        if group:
            all_tags[TAG_GROUP] = group
        number = self._next_number(name)
        all_tags[TAG_NUMBER] = str(number)
        run_name = self._parent_name(name, number, data, tags)
        run = self.client.create_run(self.experiment_id, run_name=run_name, tags=all_tags)
        self.log_params(run.info.run_id, params)
        self._monitor(run.info.run_id)
        return run.info.run_id

    def _group_run(self, group: str, wait_s: float) -> Any:
        """The group's parent run (the oldest, should two exist), waiting up to `wait_s`."""
        deadline = time.monotonic() + wait_s
        while True:
            found = self.client.search_runs(
                [self.experiment_id],
                f"tags.`{TAG_GROUP}` = '{group}'",
                max_results=1,
                order_by=["attributes.start_time ASC"],
            )
            if found:
                return found[0]
            if time.monotonic() >= deadline:
                if wait_s:
                    logging.getLogger("enn").warning(
                        "MLflow: no parent run of %s after %.0f s (its first task makes it): "
                        "this process records under a parent run of its own",
                        group,
                        wait_s,
                    )
                return None
            time.sleep(1.0)

    def _monitor(self, run_id: str, resumed: bool = False) -> None:
        """`tracking.log_system_metrics`: MLflow's system metrics (`system/cpu_...`, memory, disk,
        network; what `mlflow.start_run(log_system_metrics=True)` starts) on the parent run
        while the pipeline runs, sampled every 10 s (MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL)."""
        if not self.system_metrics:
            return
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(run_id, resume_logging=resumed, tracking_uri=self.uri)
        monitor.start()
        self._monitors[run_id] = monitor

    def _next_number(self, flow: str) -> int:
        """The flow's next run number: one more than the highest `enn.number` among its newest
        parents (a few runs read; loading every run to count them took 0.7 s on a store of
        ten, and grows with it). Several, not the newest alone: a node whose clock is behind,
        or a deleted run, must not make a number come twice. A store whose newest parents
        have none (made before the tag) counts them, once."""
        newest = self.client.search_runs(
            [self.experiment_id],
            f"tags.`{TAG_FLOW}` = '{flow}'",
            max_results=NUMBER_WINDOW,
            order_by=["attributes.start_time DESC"],
        )
        if not newest:
            return 1
        said = [r.data.tags.get(TAG_NUMBER, "") for r in newest]
        numbers = [int(n) for n in said if n.isascii() and n.isdigit() and len(n) < 10]
        if numbers:  # a tag anyone with the store could write: small ASCII numbers only
            return max(numbers) + 1
        every = self.client.search_runs(
            [self.experiment_id], f"tags.`{TAG_FLOW}` = '{flow}'", max_results=1000
        )
        return len(every) + 1

    def _parent_name(self, flow: str, number: int, data: str, tags: dict[str, str]) -> str:
        """`training #3 synthetic train.lr=0.02`: the flow, its run number, the data and what
        differs from the pipeline's params file (a --config file's name, each --set: the tag
        `enn.changes`), never a diff against whichever run came before; on a tracking server,
        which several machines share, the host as well (`training #3 @node1 synthetic`)."""
        try:
            changed = [str(c) for c in json.loads(tags.get(TAG_CHANGES) or "[]")]
        except ValueError:
            changed = []
        parts = [flow, f"#{number}"]
        if self.uri.startswith(("http://", "https://")):  # early: the UI's column is narrow
            parts.append(f"@{socket.gethostname()}")
        parts += [data, *changed[:3]]
        if len(changed) > 3:
            parts.append(f"(+{len(changed) - 3})")
        return " ".join(p for p in parts if p)[:250]

    def log_params(self, run_id: str, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        batch = [Param(k, v[:MAX_PARAM_LEN]) for k, v in params.items()]
        for i in range(0, len(batch), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(run_id, params=batch[i : i + 100])

    def end(self, run_id: str | None, status: str = "FINISHED", error: str | None = None) -> None:
        if not self.enabled or run_id is None:
            return
        if monitor := self._monitors.pop(run_id, None):
            monitor.finish()  # its last samples are flushed while the run still runs
        if error:
            self.client.set_tag(run_id, TAG_ERROR, error[:5000])
        self.client.set_terminated(run_id, status=status)
        if self.uri.startswith(("http://", "https://")):  # the log file's copy of MLflow's lines
            url = mlflow_run_url(self.uri, self.experiment_id, run_id)
            logging.getLogger("tasks.tracking").info("MLflow run %s %s: %s", run_id, status, url)

    @contextlib.contextmanager
    def child(
        self, stage: str, parent_id: str | None, run_dir: Path, params: dict, tags: dict[str, str]
    ) -> Iterator[str | None]:
        """A child run for one stage; events in `run_dir` are forwarded while it runs."""
        if not self.enabled:
            yield None
            return
        all_tags = {**self.own_tags(), TAG_KIND: "stage", "enn.stage": stage, **tags}
        if parent_id:
            all_tags["mlflow.parentRunId"] = parent_id
        run_id = self.client.create_run(
            self.experiment_id, run_name=stage, tags=all_tags
        ).info.run_id
        self.log_params(run_id, _flatten(params))
        forwarder = EventForwarder(self.client, run_id, run_dir)
        forwarder.start()
        try:
            yield run_id
        except BaseException as e:
            forwarder.stop()
            msg = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            self.end(run_id, ended_status(e), msg)
            if parent_id and not isinstance(e, TransientError):  # a transient error may be retried
                self.end(parent_id, ended_status(e), f"stage {stage} failed: {msg}")
            raise
        forwarder.stop()
        self.end(run_id, "FINISHED")

    def log_artifact(
        self, run_id: str | None, path: Path, artifact_path: str | None = None
    ) -> None:
        if self.enabled and run_id and Path(path).exists():
            self.client.log_artifact(run_id, str(path), artifact_path)

    def set_tags(self, run_id: str | None, tags: dict[str, Any]) -> None:
        if self.enabled and run_id:
            for k, v in tags.items():
                self.client.set_tag(run_id, k, str(v))

    def after_stage(
        self,
        spec: StageSpec,
        run_id: str | None,
        layout: Layout,
        cfg: RunConfig,
        lineage: dict[str, str],
        run_dir: Path,
    ) -> Registration | None:
        """Artifacts, plots, lineage and (after export) the registered model of one stage."""
        if not self.enabled or run_id is None:
            return None
        from mlflow.exceptions import MlflowException

        from tasks.tracking import models, plots, registry

        out = spec.output_dir(layout)
        tags = {**lineage, **dvc_lineage(layout.root)}
        self.set_tags(run_id, tags)
        for name in spec.artifacts:
            self.log_artifact(run_id, out / name)
        plot_dir = run_dir / "plots"
        plot_dir.mkdir(parents=True, exist_ok=True)
        for kind in spec.plots:
            for png in plots.PLOTS[kind](layout, plot_dir):
                self.log_artifact(run_id, png, "plots")
        if spec.registers_model:
            name = models.model_name(cfg, layout.root)
            try:
                result = registry.register(self.client, run_id, layout, name, tags, cfg.validate)
            except MlflowException as e:  # registered by another user since the run started
                if refused_credentials(e).startswith("403"):
                    raise model_held(name, self.uri) from None
                raise
            self.set_tags(run_id, {f"enn.registry.{k}": v for k, v in result.as_tags().items()})
            return result
        return None

    def check_model_name(self, cfg: RunConfig, specs: tuple[StageSpec, ...]) -> None:
        """Before any stage runs, when one of `specs` registers a model: that this user may
        add versions to its registered model (tasks.tracking.auth.check_model_name)."""
        if not self.enabled or not any(s.registers_model for s in specs):
            return
        from tasks.tracking import models

        check_model_name(self.client, models.model_name(cfg, self.layout.root), self.uri)

    def summarize(
        self,
        parent_id: str | None,
        layout: Layout,
        specs: tuple[StageSpec, ...],
        registration: Registration | None,
    ) -> None:
        """The parent run's headline results (docs/metrics.md), from the outputs the pipeline
        now has (also those of stages DVC skipped as up to date), its dataset input, and the
        champion decision."""
        if not self.enabled or parent_id is None:
            return
        from tasks.tracking import summary

        summary.write_parent(self.client, parent_id, layout, specs, registration)

    def sweep_killed(self) -> list[str]:
        """Mark runs left RUNNING by a process that is gone (on this host) as KILLED."""
        killed = []
        host = socket.gethostname()
        for run in self.client.search_runs(
            [self.experiment_id], "attributes.status = 'RUNNING'", max_results=500
        ):
            tags = run.data.tags
            if tags.get(TAG_HOST) != host or TAG_PID not in tags:
                continue
            if _process_alive(int(tags[TAG_PID]), tags.get(TAG_PID_CREATED)):
                continue
            self.client.set_tag(
                run.info.run_id, TAG_ERROR, "process ended without closing the run (killed)"
            )
            self.client.set_terminated(run.info.run_id, status="KILLED")
            killed.append(run.info.run_id)
        return killed


# What a scheduler that started this process says about its job (launcher-set variables):
# the runs of one SLURM job (and of its requeued restarts) are found by `enn.slurm.job_id`.
SCHEDULER_VARS = {
    "SLURM_JOB_ID": "enn.slurm.job_id",
    "SLURM_ARRAY_JOB_ID": "enn.slurm.array_job_id",
    "SLURM_ARRAY_TASK_ID": "enn.slurm.array_task_id",
    "SLURM_RESTART_COUNT": "enn.slurm.restart_count",
}


def scheduler_tags() -> dict[str, str]:
    """Tags of the job this process runs in; a value that is not a number is not SLURM's."""
    return {
        tag: os.environ[var]
        for var, tag in SCHEDULER_VARS.items()
        if os.environ.get(var, "").isdigit()
    }


def source_tags(name: str, commit: str) -> dict[str, str]:
    """MLflow's Source column: the flow's module (or the `enn` command), and its git commit."""
    from enn_core.stages import FLOWS

    tags = {
        "mlflow.source.type": "LOCAL",
        "mlflow.source.name": f"flows/{name}.py" if name in FLOWS else name,
    }
    if commit and commit != "unknown":
        tags["mlflow.source.git.commit"] = commit.removesuffix("-dirty")
    return tags


def probe_server(uri: str, timeout_s: float = 10.0) -> None:
    """A tracking server that does not answer within seconds is one line at once, instead of
    MLflow's seven retries over about four minutes (seen with a server that had stopped). A
    server that answers anything (a proxy's 401 included) is left to MLflow's client."""
    if not uri.startswith(("http://", "https://")):
        return
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout_s):  # noqa: S310
            pass
    except urllib.error.HTTPError:
        return
    except (OSError, ValueError) as e:
        raise store_error(uri, e) from e


def store_error(uri: str, error: Exception) -> StoreError | NoSpaceError | ConfigError:
    """The MLflow store at `uri` cannot be opened: one line naming the file (or server),
    the cause and the fix (a server that refused the credentials: the variables to check)."""
    shown = redact_url(uri)
    refused = refused_credentials(error)
    if refused:
        return ConfigError(
            f"{shown}: the MLflow tracking server refused this user ({refused}); check "
            f"{CREDENTIALS}: a user it knows, with its password"
        )
    cause = str(getattr(error, "orig", None) or error).strip().splitlines()[0][:200]
    cause = redact_text(cause)
    if uri.startswith("sqlite:///") and "disk is full" in cause:
        return NoSpaceError.at(uri.removeprefix("sqlite:///"), "the MLflow store")
    if uri.startswith("sqlite:///"):
        db = uri.removeprefix("sqlite:///")
        return StoreError(
            f"{db}: the MLflow store cannot be read ({cause}); move it aside to start a new "
            f"one (mv {db} {db}.broken; earlier runs stay in the moved file) or restore it "
            "from a backup"
        )
    return StoreError(
        f"{shown}: the MLflow tracking store did not answer ({cause}); check tracking.uri and "
        "that the server runs"
    )


def ended_status(error: BaseException) -> str:
    """MLflow's status of a run that `error` ended: KILLED when it was stopped from outside
    (Ctrl-C, SIGTERM, a cancelled flow run, a preempted or cancelled batch job: `Preempted`,
    the workers saved), FAILED otherwise."""
    return "KILLED" if isinstance(error, (KeyboardInterrupt, Preempted)) else "FAILED"


def dvc_lineage(root: Path) -> dict[str, str]:
    """The DVC hash of the staged data, from dvc.lock (empty before stage-data is locked)."""
    import yaml

    lock = root / "dvc.lock"
    if not lock.exists():
        return {}
    stages = (yaml.safe_load(lock.read_text()) or {}).get("stages", {})
    outs = stages.get(STAGE_DATA.dvc_name, {}).get("outs", [])
    return {"enn.dvc_staged_data_md5": str(outs[0].get("md5", ""))} if outs else {}


def _process_alive(pid: int, created: str | None) -> bool:
    try:
        p = psutil.Process(pid)
        if created is not None and abs(p.create_time() - float(created)) > 0.01:
            return False  # the pid was reused
        return p.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, ValueError):
        return False


class EventForwarder:
    """Forwards `events.jsonl` lines to an MLflow run, every second and once more at stop."""

    def __init__(self, client: MlflowClient, run_id: str, run_dir: Path, interval: float = 1.0):
        self.client, self.run_id, self.path = client, run_id, Path(run_dir) / EVENTS_FILE
        self.interval = interval
        self._offset = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"events-{run_id[:8]}", daemon=True)
        self.events: list[dict] = []
        self._params: set[str] = set()  # MLflow params are immutable: log each key once

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.flush()
        if self.events:
            self.client.log_text(
                self.run_id, "\n".join(json.dumps(e) for e in self.events), "events.jsonl"
            )

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.flush()
            except Exception:  # a full or locked store: stop() flushes once more and raises
                logging.getLogger("enn.tracking").debug("event forwarding stopped", exc_info=True)
                return

    def flush(self) -> None:
        """Send what the events file gained since the last flush."""
        from mlflow.entities import Metric, Param, RunTag

        metrics, params, tags = [], [], []
        now = int(time.time() * 1000)
        for rec in self._new_records():
            kind = rec.get("type")
            if kind == "metric":
                when = int(rec.get("time", 0) * 1000) or now
                metrics.append(Metric(rec["name"], rec["value"], when, rec.get("step") or 0))
            elif kind == "param" and rec["name"] not in self._params:
                self._params.add(rec["name"])  # MLflow params are immutable: each key once
                value = rec["value"] if isinstance(rec["value"], str) else json.dumps(rec["value"])
                params.append(Param(rec["name"], value[:MAX_PARAM_LEN]))
            elif kind == "artifact" and Path(rec["path"]).exists():
                self.client.log_artifact(self.run_id, rec["path"], rec.get("artifact_path"))
            elif kind == "event":
                self.events.append(rec)
                fields = json.dumps(rec.get("fields", {}))[:5000]
                tags.append(RunTag(f"event.{rec['name']}", fields))
        for i in range(0, len(metrics), 900):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 900])
        if params or tags:
            self.client.log_batch(self.run_id, params=params, tags=tags)

    def _new_records(self) -> list[dict[str, Any]]:
        """The complete lines appended to the events file since the last call."""
        if not self.path.exists():
            return []
        with open(self.path, encoding="utf-8") as f:
            f.seek(self._offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind("\n") + 1]
        self._offset += len(complete.encode("utf-8"))
        return [json.loads(line) for line in complete.splitlines() if line.strip()]
