"""`enn gc`: what tuning and training leave behind, removed by the `gc:` retention policy.

- training checkpoint fingerprints (`work/checkpoints/<fp>/`): the newest `gc.keep_fingerprints`
  and the one the pipeline's current outputs were trained under (params.yaml + the staged data,
  what dvc.lock points at) stay; an older one goes when it finished (COMPLETE) or is older than
  `gc.keep_days` (an interrupted run nobody resumed);
- finished trials' folders (`work/tune/<study>/trial-N/` with an `end.json`), unless that
  study runs now (its lock is held); the study's database stays;
- run directories (`work/runs/<id>/`) older than `gc.keep_days`;
- the artifacts of FAILED and KILLED MLflow runs older than `gc.keep_days` (local artifact
  stores only), never a run a registered model version was made from; the run stays, tagged.

Nothing under `outputs/` or the DVC cache is touched.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from enn_core.config import RunConfig
from enn_core.errors import EnnError, LockError
from enn_core.paths import Layout
from enn_core.stages import STAGE_DATA
from tasks.lock import pipeline_lock

log = logging.getLogger("enn.gc")
DAY_S = 86400.0


@dataclass(frozen=True)
class Removal:
    """One path gc removes (or would), its size and why."""

    path: Path
    size: int
    why: str
    run_id: str | None = None  # an MLflow run whose artifacts these are


def size_of(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def current_fingerprint(cfg: RunConfig, layout: Layout) -> str | None:
    """The fingerprint the pipeline's params and staged data train under (None without data)."""
    staged = STAGE_DATA.output_dir(layout)
    if not (staged / "manifest.json").is_file():
        return None
    from enn_core.data.dataset import StagedDataset
    from enn_core.train.fingerprint import fingerprint

    try:
        return fingerprint(cfg, StagedDataset(staged).fingerprint).digest
    except EnnError:  # stale staged data: nothing current to protect
        return None


def old_checkpoints(cfg: RunConfig, layout: Layout, now: float) -> list[Removal]:
    root = layout.checkpoints
    if not root.is_dir():
        return []
    dirs = sorted((d for d in root.iterdir() if d.is_dir()), key=lambda d: -d.stat().st_mtime)
    current = current_fingerprint(cfg, layout)
    out = []
    for d in dirs[cfg.gc.keep_fingerprints :]:
        if current and d.name.startswith(current[:12]) or d.name == current:
            continue
        finished = (d / "COMPLETE").exists()
        old = now - d.stat().st_mtime > cfg.gc.keep_days * DAY_S
        if finished or old:
            why = "finished" if finished else f"unfinished, older than {cfg.gc.keep_days:g} days"
            out.append(Removal(d, size_of(d), f"checkpoint fingerprint ({why})"))
    return out


def finished_trials(layout: Layout) -> list[Removal]:
    out = []
    tune = layout.work / "tune"
    for folder in sorted(p for p in tune.glob("*") if p.is_dir()) if tune.is_dir() else []:
        try:
            with pipeline_lock(folder.with_suffix(".lock"), "enn gc"):
                out += [
                    Removal(t, size_of(t), "finished trial")
                    for t in sorted(folder.glob("trial-*"))
                    if (t / "end.json").is_file()
                ]
        except LockError:
            log.info("gc: study %s is running; its trials stay", folder.name)
    return out


def old_run_dirs(cfg: RunConfig, layout: Layout, now: float) -> list[Removal]:
    runs = layout.work / "runs"
    if not runs.is_dir():
        return []
    limit = cfg.gc.keep_days * DAY_S
    return [
        Removal(d, size_of(d), f"run directory older than {cfg.gc.keep_days:g} days")
        for d in sorted(runs.iterdir())
        if d.is_dir() and now - d.stat().st_mtime > limit
    ]


def failed_run_artifacts(cfg: RunConfig, layout: Layout, now: float) -> list[Removal]:
    if not cfg.tracking.enabled or not layout.mlflow_dir.is_dir():
        return []
    from mlflow.tracking import MlflowClient

    client = MlflowClient(cfg.tracking.uri or layout.mlflow_uri)
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    if exp is None:
        return []
    registered = {v.run_id for v in client.search_model_versions()}
    cutoff = int((now - cfg.gc.keep_days * DAY_S) * 1000)
    out = []
    ended = [
        run
        for status in ("FAILED", "KILLED")
        for run in client.search_runs(
            [exp.experiment_id], f"attributes.status = '{status}'", max_results=5000
        )
    ]
    for run in ended:
        uri = urlparse(run.info.artifact_uri)
        if run.info.run_id in registered or uri.scheme not in ("", "file"):
            continue
        if (run.info.end_time or run.info.start_time or 0) > cutoff:
            continue
        path = Path(uri.path)
        if path.is_dir() and any(path.iterdir()):
            why = f"artifacts of {run.info.status} run {run.info.run_name}"
            out.append(Removal(path, size_of(path), why, run.info.run_id))
    return out


def plan(cfg: RunConfig, layout: Layout, now: float | None = None) -> list[Removal]:
    now = time.time() if now is None else now
    out = old_checkpoints(cfg, layout, now)
    if cfg.gc.trials:
        out += finished_trials(layout)
    out += old_run_dirs(cfg, layout, now)
    if cfg.gc.failed_runs:
        out += failed_run_artifacts(cfg, layout, now)
    return out


def remove(cfg: RunConfig, layout: Layout, removals: list[Removal]) -> int:
    """Delete what `plan` listed; the bytes freed."""
    freed = 0
    client = None
    for r in removals:
        if r.path.is_dir():
            shutil.rmtree(r.path, ignore_errors=True)
        else:
            r.path.unlink(missing_ok=True)
        freed += r.size
        if r.run_id:
            if client is None:
                from mlflow.tracking import MlflowClient

                client = MlflowClient(cfg.tracking.uri or layout.mlflow_uri)
            client.set_tag(r.run_id, "enn.gc", "artifacts removed")
    return freed
