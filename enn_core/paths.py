"""The project layout: where each stage writes, and the work directory.

    <root>/params.yaml, dvc.yaml         the pipeline as DVC sees it
    <root>/outputs/<stage>/               each stage's outputs (DVC-tracked, replaced atomically)
    <root>/work/                          git- and DVC-ignored:
        prefect/                          PREFECT_HOME (local API on SQLite, results as JSON)
        mlflow/mlflow.db, mlflow/artifacts MLflow store and artifacts
        dvc-site-cache/                   DVC's site cache (core.site_cache_dir)
        runs/<run-id>/<stage>/            run directories: resolved config, events, logs
        checkpoints/<fingerprint>/        distributed-train's persistent DCP checkpoints
        pipeline.lock                     one pipeline run at a time
        tune/<study>.db, tune/<study>/    `enn tune`'s Optuna study and its trials' folders

Stages and their names live in the stage registry (enn_core/stages/); a stage's output folder
is `spec.output_dir(layout)`, `layout.outputs / <name>`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from enn_core.errors import ConfigError

RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@+-]{0,199}$")

# The short list of environment variables the project reads (documented in docs/getting-started.md).
ENV_WORK_DIR = "ENN_WORK_DIR"  # override the work directory (absolute path)


def find_root(start: str | Path | None = None) -> Path:
    """The project root: the nearest directory at or above `start` holding params.yaml."""
    here = Path(start or os.getcwd()).resolve()
    for d in (here, *here.parents):
        if (d / "params.yaml").exists():
            return d
    return here


def project_root(config: str | Path) -> Path:
    """The project a config file runs in: the nearest directory at or above the file that
    holds a dvc.yaml (a pipeline: the repository root for params.yaml, prediction/ for
    prediction/params.yaml), so an overlay such as configs/expressway.yaml runs in the
    project, with its outputs, work directory and relative data paths, not in configs/.
    A config file with no pipeline above it is its own project (its directory)."""
    start = Path(config).resolve().parent
    for d in (start, *start.parents):
        if (d / "dvc.yaml").is_file():
            return d
    return start


def checkout_root(root: str | Path) -> Path:
    """The project a pipeline folder belongs to (the repository root for `prediction/`, which
    is a DVC project of its own): the outermost folder at or above `root` holding `.dvc/`
    inside the git repository that holds `root` (a DVC project inside a larger git tree, a
    home folder kept in git, is its own project), else that git repository's root, else the
    outermost `.dvc/` folder; `root` itself without either."""
    start = Path(os.path.abspath(root))
    chain = (start, *start.parents)
    git = next((d for d in chain if (d / ".git").exists()), None)
    inside = chain if git is None else chain[: chain.index(git) + 1]
    dvc = [d for d in inside if (d / ".dvc").is_dir()]
    if dvc:
        return dvc[-1]
    return git if git is not None else start


def pipeline_params(flow: str, start: str | Path | None = None) -> Path:
    """The params.yaml of pipeline `flow` ("training": `<project>/params.yaml`, "prediction":
    `<project>/prediction/params.yaml`) from any folder of the project (`prediction/`
    included), so a command run there does that pipeline's work, never the other's."""
    here = find_root(start)
    top = checkout_root(here)
    if not (top / "params.yaml").is_file():
        top = here
    return top / "prediction" / "params.yaml" if flow == "prediction" else top / "params.yaml"


@dataclass(frozen=True)
class Layout:
    root: Path
    work: Path
    outputs_dir: Path | None = None
    """Where the stages write when not `<root>/outputs` (a tuning trial's own folder)."""

    @classmethod
    def for_root(cls, root: str | Path, work_dir: str = "work") -> Layout:
        root = Path(root).resolve()
        env = os.environ.get(ENV_WORK_DIR)
        work = Path(env) if env else (root / work_dir)
        return cls(root=root, work=work.resolve())

    @property
    def outputs(self) -> Path:
        """The pipeline's outputs (each stage's folder, the metrics and plots DVC reads)."""
        return self.outputs_dir if self.outputs_dir is not None else self.root / "outputs"

    @property
    def prefect_home(self) -> Path:
        return self.work / "prefect"

    @property
    def mlflow_dir(self) -> Path:
        return self.work / "mlflow"

    @property
    def mlflow_uri(self) -> str:
        return f"sqlite:///{self.mlflow_dir / 'mlflow.db'}"

    @property
    def mlflow_artifacts(self) -> Path:
        return self.mlflow_dir / "artifacts"

    @property
    def dvc_site_cache(self) -> Path:
        return self.work / "dvc-site-cache"

    @property
    def checkpoints(self) -> Path:
        return self.work / "checkpoints"

    @property
    def lock_file(self) -> Path:
        return self.work / "pipeline.lock"

    def run_dir(self, run_id: str, stage: str) -> Path:
        """`work/runs/<run id>/<stage>/`; the id is a name, never a path (under an external
        launcher it comes from the environment: TORCHELASTIC_RUN_ID)."""
        if not RUN_ID.match(run_id) or ".." in run_id:
            raise ConfigError(
                f"run id {run_id[:80]!r} is not a name (letters, digits, '_', '.', '-'; no '..'): "
                "give the launcher's --rdzv-id (TORCHELASTIC_RUN_ID) such a value"
            )
        return self.work / "runs" / run_id / stage

    def resolve(self, path: str | Path) -> Path:
        """A user path from config, relative to the project root."""
        p = Path(path)
        return p if p.is_absolute() else (self.root / p)
