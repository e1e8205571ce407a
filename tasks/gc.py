"""`enn gc`: what tuning and training leave behind, removed by the `gc:` retention policy.

- training checkpoint fingerprints (`work/checkpoints/<fp>/`, and in a configured
  `checkpoint.dir` the folders holding distributed-train's `fingerprint.json`): the newest
  `gc.keep_fingerprints` and the one the pipeline's current outputs were trained under
  (params.yaml + the staged data, what dvc.lock points at) stay; an older one goes when it
  finished (COMPLETE) or is older than `gc.keep_days` (an interrupted run nobody resumed);
- finished trials' folders (`work/tune/<study>/trial-N/` with an `end.json`), unless that
  study runs now (its lock is held); the study's database stays;
- run directories (`work/runs/<id>/`) older than `gc.keep_days`;
- the artifacts of FAILED and KILLED MLflow runs, and of runs marked deleted (MLflow's own
  lifecycle: the UI's delete), older than `gc.keep_days` (local artifact stores only), never a
  run a registered model version was made from; the run stays, tagged.

gc deletes only inside the roots it owns, each category in its own: the work directory's
`checkpoints/`, `tune/` and `runs/`, the local artifact root `work/mlflow/artifacts/`, and the
configured `checkpoint.dir`. Every path is resolved first: one that leads outside its root (an
artifact location the MLflow store names, a folder reached through a link) is left alone and
named; a link is removed as a link, never followed. The plan is made once and `--dry-run`
prints it; the real run removes exactly what it lists. `mlflow gc` is not called: it purges
every deleted experiment and logged model too, following whatever artifact location the store
names. Nothing under `outputs/` or the DVC cache is touched.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse

from enn_core.config import RunConfig
from enn_core.errors import EnnError, LockError
from enn_core.paths import Layout
from enn_core.stages import STAGE_DATA
from tasks.lock import pipeline_lock
from tasks.tracking.uris import client_for

log = logging.getLogger("enn.gc")
DAY_S = 86400.0
FINGERPRINT_FILE = "fingerprint.json"  # what distributed-train writes first in a fingerprint


@dataclass(frozen=True)
class Removal:
    """One path gc removes (or would), its size, why, and the root it lies under."""

    path: Path
    size: int
    why: str
    root: Path
    run_id: str | None = None  # an MLflow run whose artifacts these are


@dataclass(frozen=True)
class Skipped:
    """A path the policy picked that lies outside gc's roots: left alone, named."""

    path: Path
    why: str


@dataclass
class Plan:
    removals: list[Removal] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)

    def consider(self, path: Path, root: Path, why: str, run_id: str | None = None) -> None:
        """Remove `path` when it lies under `root` (`owned`); else name it as left alone."""
        if owned(path, root):
            self.removals.append(Removal(path, size_of(path), why, root, run_id))
        else:
            self.skipped.append(Skipped(path, f"{why}; it lies outside {root}"))


def owned(path: Path, root: Path) -> bool:
    """Whether removing `path` removes only what lies under `root`: a link is judged by the
    folder it sits in (removing it removes the link), anything else by where it resolves."""
    try:
        top = root.resolve()
        where = path.parent.resolve() / path.name if path.is_symlink() else path.resolve()
    except (OSError, RuntimeError, ValueError):  # a link loop, a NUL byte in the name
        return False
    return where != top and where.is_relative_to(top)


def size_of(path: Path) -> int:
    """Bytes under `path`, links not followed (a link counts as itself)."""
    try:
        if path.is_symlink() or not path.is_dir():
            return path.lstat().st_size
    except OSError:
        return 0
    total = 0
    for folder, _, files in os.walk(path):  # followlinks=False
        for name in files:
            try:
                st = os.lstat(os.path.join(folder, name))
            except OSError:
                continue
            total += st.st_size
    return total


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


def checkpoint_roots(cfg: RunConfig, layout: Layout) -> list[tuple[Path, bool]]:
    """(root, shared): the work directory's checkpoints and the configured `checkpoint.dir`
    (shared: only folders holding a fingerprint.json there are distributed-train's)."""
    roots = [(layout.checkpoints, False)]
    if cfg.checkpoint.dir:
        configured = layout.resolve(cfg.checkpoint.dir)
        if configured.resolve() != layout.checkpoints.resolve():
            roots.append((configured, True))
    return roots


def old_checkpoints(cfg: RunConfig, layout: Layout, now: float, plan: Plan) -> None:
    current = current_fingerprint(cfg, layout)
    for root, shared in checkpoint_roots(cfg, layout):
        if not root.is_dir():
            continue
        dirs = [
            d
            for d in root.iterdir()
            if d.is_dir() and (not shared or (d / FINGERPRINT_FILE).is_file())
        ]
        dirs.sort(key=lambda d: -d.stat().st_mtime)
        for d in dirs[cfg.gc.keep_fingerprints :]:
            if current and d.name.startswith(current[:12]) or d.name == current:
                continue
            finished = (d / "COMPLETE").exists()
            old = now - d.stat().st_mtime > cfg.gc.keep_days * DAY_S
            if finished or old:
                why = (
                    "finished" if finished else f"unfinished, older than {cfg.gc.keep_days:g} days"
                )
                plan.consider(d, root, f"checkpoint fingerprint ({why})")


def finished_trials(layout: Layout, plan: Plan) -> None:
    tune = layout.work / "tune"
    for folder in sorted(p for p in tune.glob("*") if p.is_dir()) if tune.is_dir() else []:
        try:
            with pipeline_lock(folder.with_suffix(".lock"), "enn gc"):
                for t in sorted(folder.glob("trial-*")):
                    if (t / "end.json").is_file():
                        plan.consider(t, tune, "finished trial")
        except LockError:
            log.info("gc: study %s is running; its trials stay", folder.name)


def old_run_dirs(cfg: RunConfig, layout: Layout, now: float, plan: Plan) -> None:
    runs = layout.work / "runs"
    if not runs.is_dir():
        return
    limit = cfg.gc.keep_days * DAY_S
    for d in sorted(runs.iterdir()):
        if d.is_dir() and now - d.lstat().st_mtime > limit:
            plan.consider(d, runs, f"run directory older than {cfg.gc.keep_days:g} days")


def artifact_path(uri: str) -> Path | None:
    """The local folder an artifact URI names (None for a server's or a remote store, and for
    a name no file can have)."""
    parsed = urlparse(uri)
    if parsed.scheme not in ("", "file"):
        return None
    path = unquote(parsed.path)
    return None if "\x00" in path else Path(path)


def failed_run_artifacts(cfg: RunConfig, layout: Layout, now: float, plan: Plan) -> None:
    if not cfg.tracking.enabled or not layout.mlflow_dir.is_dir():
        return
    from mlflow.entities import ViewType

    client = client_for(cfg.tracking.uri or layout.mlflow_uri)
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    if exp is None:
        return
    registered = {v.run_id for v in client.search_model_versions()}
    cutoff = int((now - cfg.gc.keep_days * DAY_S) * 1000)
    ended = [
        run
        for status in ("FAILED", "KILLED")
        for run in client.search_runs(
            [exp.experiment_id], f"attributes.status = '{status}'", max_results=5000
        )
    ]
    ended += client.search_runs([exp.experiment_id], "", ViewType.DELETED_ONLY, 5000)
    root = layout.mlflow_artifacts
    for run in {r.info.run_id: r for r in ended}.values():
        path = artifact_path(run.info.artifact_uri or "")
        if run.info.run_id in registered or path is None:
            continue
        if (run.info.end_time or run.info.start_time or 0) > cutoff:
            continue
        state = "deleted" if run.info.lifecycle_stage == "deleted" else run.info.status
        why = f"artifacts of {state} run {run.info.run_name}"
        if not path.is_absolute():
            plan.skipped.append(Skipped(path, f"{why}; a relative artifact location"))
        elif path.is_symlink() or (path.is_dir() and any(path.iterdir())):
            plan.consider(path, root, why, run.info.run_id)


def plan(cfg: RunConfig, layout: Layout, now: float | None = None) -> Plan:
    """What the policy removes (each under its root) and what it leaves alone, once."""
    now = time.time() if now is None else now
    out = Plan()
    old_checkpoints(cfg, layout, now, out)
    if cfg.gc.trials:
        finished_trials(layout, out)
    old_run_dirs(cfg, layout, now, out)
    if cfg.gc.failed_runs:
        failed_run_artifacts(cfg, layout, now, out)
    return out


def remove(cfg: RunConfig, layout: Layout, removals: list[Removal]) -> dict[Path, str]:
    """Delete what `plan` listed (each checked again: a path swapped for a link since is left);
    returns why each path that could not be removed was not."""
    failed: dict[Path, str] = {}
    client = None
    for r in removals:
        try:
            if not owned(r.path, r.root):
                raise OSError(f"it now lies outside {r.root}")
            if r.path.is_symlink() or not r.path.is_dir():
                r.path.unlink(missing_ok=True)
            else:
                shutil.rmtree(r.path)  # never follows a link inside (fd-based on Linux)
        except OSError as e:
            failed[r.path] = str(e.strerror or e)
            continue
        if r.run_id:
            if client is None:
                client = client_for(cfg.tracking.uri or layout.mlflow_uri)
            if client.get_run(r.run_id).info.lifecycle_stage == "active":
                client.set_tag(r.run_id, "enn.gc", "artifacts removed")
    return failed
