"""Keep every tool offline and inside the project's work directory.

`contain(layout)` must run before prefect or mlflow is first imported (both read their
settings at import time). Importing a module never calls it: the entry points do, explicitly.
`enn` (flows/cli.py) calls it before importing anything of Prefect or MLflow, once it has
loaded the config; a flow run that a Prefect worker started (prefect is imported by then)
calls it for the tool settings only (`groups=("tools",)`, before mlflow is imported); the
worker's own Prefect settings are the worker's environment (docs/scale-out.md).

What it sets (docs/getting-started.md lists them):
- telemetry off: DO_NOT_TRACK=true, PREFECT_SERVER_ANALYTICS_ENABLED=false,
  MLFLOW_DISABLE_TELEMETRY=true, DVC_NO_ANALYTICS=1, MLFLOW_SKIP_PIP_REQUIREMENTS_CHECK=true;
- PREFECT_HOME, the Prefect local result storage and an absolute MLFLOW_TRACKING_URI (SQLite)
  under the work directory; results serialized as JSON, never pickle.
Values a user already exported (e.g. PREFECT_API_URL of a real server, an MLflow server URI)
are left alone: that is how the pipeline scales out to existing servers.

And the work directory's files (`private_stores`): the umask gets `o-w` (no folder enn or its
servers make is world-writable, whatever the umask was); the SQLite stores enn owns (MLflow's
`mlflow.db`, Prefect's `prefect.db`) are created 0600 before the tools open them, and narrowed
to 0600 when an older run left them readable; DVC's site cache folder, which DVC makes 0777 on
purpose for a machine-wide cache, is made first, as the umask says.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from enn_core.atomic import private_file, umask
from enn_core.paths import ENV_WORK_DIR, Layout
from tasks.store_seeds import seed

PREFECT = "prefect"  # settings Prefect reads when it is imported
TOOLS = "tools"  # MLflow, DVC, git and telemetry: read when those are imported or run
FORCED = {
    "DO_NOT_TRACK": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DVC_NO_ANALYTICS": "1",
    "MLFLOW_SKIP_PIP_REQUIREMENTS_CHECK": "true",
    # MLflow's records go to this process's handlers (flows/console.py), not a console
    # handler of its own that prints every INFO line
    "MLFLOW_CONFIGURE_LOGGING": "false",
    # MLflow writes "View run ... at: URL" and "View experiment at: URL" to stdout for every
    # run it ends on a tracking server (each stage, each trial); the log file keeps each run's
    # URL instead (tasks/tracking/runs.py, Tracker.end), the summary's `look:` line the parent's
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
}


def contained_env(layout: Layout, groups: tuple[str, ...] = (PREFECT, TOOLS)) -> dict[str, str]:
    """The environment variables that keep the tools offline and under `layout.work`."""
    out = dict(FORCED)
    if PREFECT in groups:
        out.update(prefect_env(layout))
    if TOOLS in groups:
        out.update(
            {
                "MLFLOW_TRACKING_URI": layout.mlflow_uri,
                "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false",
                "DVC_SITE_CACHE_DIR": str(layout.dvc_site_cache),
                "GIT_PYTHON_REFRESH": "quiet",
                # a download's progress bar is noise in a pipeline's console
                "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
                # matplotlib's font cache and config under work/, not ~/.config
                "MPLCONFIGDIR": str(layout.work / "matplotlib"),
            }
        )
    return out


# Prefect's own console handler, which a flow-run process (of `enn deploy`, of a work pool's
# worker: flows.training.POOL_JOB_VARIABLES) uses until the flow sets up enn's console
# (flows/training.py: flow_console): its INFO lines ("Beginning flow run ...", a deployment's
# pull steps) go to the Prefect UI's log, not the terminal
PREFECT_CONSOLE_QUIET = {"PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "WARNING"}


def prefect_env(layout: Layout) -> dict[str, str]:
    prefect = layout.prefect_home
    return {
        "PREFECT_HOME": str(prefect),
        "PREFECT_LOCAL_STORAGE_PATH": str(prefect / "storage"),
        "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "false",
        "PREFECT_RESULTS_DEFAULT_SERIALIZER": "json",
        "PREFECT_LOGGING_TO_API_BATCH_INTERVAL": "0.5",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
        "PREFECT_UI_ENABLED": "false",
        "PREFECT_LOGGING_EXTRA_LOGGERS": "enn",
        # enn's logger sends to the API within flow runs only; a line logged before the flow
        # starts (the temporary API's address, now said while the flow's modules import)
        # stays on the console and in the log file, without Prefect's UserWarning about it
        "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
        **PREFECT_CONSOLE_QUIET,
    }


_OURS: set[str] = set()  # keys this module set (a later, better-informed call may change them)


def project_layout(root: Path, work_dir: str) -> Layout:
    """The layout of the project at `root` with `runtime.work_dir`; under a DVC experiment in a
    temporary copy, the work directory stays the parent repository's."""
    follow_experiment_parent(root, work_dir)
    return Layout.for_root(root, work_dir)


def follow_experiment_parent(root: Path, work_dir: str) -> None:
    """Under `dvc exp run --temp` (and queued experiments) a stage runs in a throwaway copy of
    the repository (.dvc/tmp/exps/...); DVC_ROOT names the parent repository. Keep the work
    directory (MLflow store, run directories, checkpoints) the parent's, through ENN_WORK_DIR,
    or the experiment's runs vanish with the copy."""
    parent = os.environ.get("DVC_ROOT")
    if not parent or not os.environ.get("DVC_EXP_BASELINE_REV") or ENV_WORK_DIR in os.environ:
        return
    if Path(work_dir).is_absolute():
        return
    repo = next((d for d in (root, *root.parents) if (d / ".dvc").is_dir()), None)
    if repo is None or repo.resolve() == Path(parent).resolve():
        return  # a workspace experiment: already in the parent
    os.environ[ENV_WORK_DIR] = str((Path(parent) / root.relative_to(repo) / work_dir).resolve())


def contain(
    layout: Layout,
    *,
    override: bool = False,
    groups: tuple[str, ...] = (PREFECT, TOOLS),
    tracking_uri: str = "",
) -> Layout:
    """Apply `contained_env` to os.environ and create the work directory. Values the user
    exported are kept (unless `override`); values an earlier call of this function set are
    replaced. `tracking_uri` (the config's `tracking.uri`): a server's or another store's
    means no local MLflow store is made."""
    os.umask(umask() | 0o002)  # before anything is made: no world-writable folder or file
    layout.work.mkdir(parents=True, exist_ok=True)
    watched = ("prefect", "mlflow") if PREFECT in groups else ("mlflow",)
    already = [m for m in watched if m in sys.modules]
    changed = []
    for key, value in contained_env(layout, groups).items():
        if key in FORCED or override or key not in os.environ or key in _OURS:
            if key not in FORCED:
                _OURS.add(key)
            if os.environ.get(key) != value:
                changed.append(key)
            os.environ[key] = value
    private_stores(layout, local_tracking=not tracking_uri or tracking_uri == layout.mlflow_uri)
    if already and changed:
        # Settings read at import time cannot change now; say so instead of silently ignoring.
        import warnings

        warnings.warn(
            f"contain() called after importing {already}; their settings may be stale", stacklevel=2
        )
    return layout


def private_stores(layout: Layout, local_tracking: bool = True) -> None:
    """The work directory's stores only their owner reads, and DVC's site cache as the umask
    says (see the module's docstring); stores the user moved elsewhere are theirs, and no
    local MLflow store is made for a run that tracks elsewhere (`tracking.uri`)."""
    # a new database starts migrated (tasks/store_seeds.py)
    if local_tracking and os.environ.get("MLFLOW_TRACKING_URI") == layout.mlflow_uri:
        seed(layout.mlflow_dir / "mlflow.db", "mlflow")
        private_file(layout.mlflow_dir / "mlflow.db")
    own_prefect = os.environ.get("PREFECT_HOME") == str(layout.prefect_home)
    if own_prefect and not os.environ.get("PREFECT_API_DATABASE_CONNECTION_URL"):
        seed(layout.prefect_home / "prefect.db", "prefect")
        private_file(layout.prefect_home / "prefect.db")
    mode = 0o777 & ~umask()
    for folder in (layout.dvc_site_cache, layout.dvc_site_cache / "repo"):
        folder.mkdir(mode=mode, exist_ok=True)
        st = folder.lstat()
        if st.st_uid == os.getuid() and st.st_mode & 0o777 & ~mode:  # DVC made it 0777
            folder.chmod(mode)
