"""Shared fixtures for every tier.

- `tiny_overrides` / `tiny_config`: a run config small enough for a test (synthetic data).
- `layout`: a project layout rooted in a temp dir (outputs/, work/).
- `project`: a temp git repo holding a copy of this project's code, with DVC initialised and
  a tiny params.yaml; its `run()` executes commands there with that copy first on PYTHONPATH,
  the environment contained under its own work/ (Prefect local API on SQLite, MLflow SQLite).
- `prefect_home_shared`: one Prefect home per test session, so the local API's migrations run once.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    """The test process is an entry point too: telemetry off before any test imports prefect
    or mlflow in-process (tasks/env.py's FORCED values; each project's commands get their own
    contained environment through `contained_env`)."""
    from tasks.env import FORCED

    os.environ.update(FORCED)


COPIED = (
    "enn_core",
    "tasks",
    "flows",
    "prediction",
    "dvc.yaml",
    "params.yaml",
    "pyproject.toml",
    ".dvcignore",
    ".gitignore",
    "scripts/enn",  # what dvc.yaml's commands run
)

TINY: dict = {
    "data": {
        "synthetic": {
            "n_months": 4,
            "n_daytypes": 2,
            "n_directions": 2,
            "n_sections": 4,
            "n_hours": 6,
            "n_replicates": 3,
            "seed": 0,
        }
    },
    "model": {"d_model": 16, "heads": 2, "layers": 1, "embed_dim": 4},
    "train": {"epochs": 20, "batch_size": 8, "lr": 0.01, "warmup_steps": 5, "patience": 0},
    "runtime": {"world_size": 1, "progress": False, "hang_timeout_s": 60.0},
    "predict": {"chunk_rows": 16, "batch_size": 16},
}


def tiny_overrides(extra: dict | None = None) -> list[str]:
    """TINY (and `extra`) as `--set key=value` strings."""
    out: list[str] = []

    def walk(d: dict, prefix: str) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                out.append(
                    f"{prefix}{k}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}"
                )

    walk(TINY, "")
    if extra:
        walk(extra, "")
    return out


@pytest.fixture
def tiny_config():
    from enn_core.config import load_config

    return load_config(None, tiny_overrides(), allow_faults=True)


@pytest.fixture
def layout(tmp_path):
    from enn_core.paths import Layout

    (tmp_path / "params.yaml").write_text("{}\n")
    return Layout.for_root(tmp_path)


def contained_env(root: Path, **extra: str) -> dict[str, str]:
    """A clean environment for a child process working in project `root`."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PREFECT_", "MLFLOW_", "DVC_", "ENN_", "DO_NOT_TRACK"))
    }
    env.update(
        {
            "PYTHONPATH": str(root),
            "ENN_ALLOW_FAULTS": "1",
            "OMP_NUM_THREADS": "1",
            "PATH": f"{Path(sys.executable).parent}:{env.get('PATH', '')}",
        }
    )
    env.update(extra)
    return env


@dataclass
class Project:
    root: Path
    env: dict

    def run(
        self, *cmd: str, check: bool = True, timeout: float = 600, **kw
    ) -> subprocess.CompletedProcess:
        out = subprocess.run(
            list(cmd),
            cwd=kw.pop("cwd", self.root),
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            **kw,
        )
        if check and out.returncode != 0:
            raise AssertionError(
                f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
            )
        return out

    def python(self, code: str, **kw) -> subprocess.CompletedProcess:
        return self.run(sys.executable, "-c", code, **kw)

    def set_params(self, overrides: list[str]) -> None:
        from flows.params_file import apply_overrides

        apply_overrides(self.root / "params.yaml", overrides)

    def git_commit(self, message: str = "snapshot") -> None:
        self.run("git", "add", "-A")
        self.run("git", "commit", "-qm", message, "--allow-empty")


def make_project(
    dest: Path, prefect_home: Path | None = None, stages: tuple[str, ...] | None = None
) -> Project:
    """Copy the project's code into `dest`, make it a git + DVC repo with tiny params."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    (dest / ".dvc").mkdir()
    shutil.copy2(ROOT / ".dvc" / "config", dest / ".dvc" / "config")
    (dest / ".dvc" / ".gitignore").write_text("/config.local\n/tmp\n/cache\n")
    (dest / ".dvc" / "config.local").write_text(
        f"[core]\n    site_cache_dir = {dest / 'work' / 'dvc-site-cache'}\n"
    )
    if stages is not None:  # a pipeline of only these stages (and what they need)
        shutil.rmtree(dest / "prediction")  # its deps name training stages that are not there
        dvc = yaml.safe_load((dest / "dvc.yaml").read_text())
        keep = {s.replace("-", "_") for s in stages}  # dvc.yaml's keys for these stage names
        dvc["stages"] = {k: v for k, v in dvc["stages"].items() if k in keep}
        (dest / "dvc.yaml").write_text(yaml.safe_dump(dvc, sort_keys=False))
    extra = {"PREFECT_HOME": str(prefect_home)} if prefect_home else {}
    project = Project(dest, contained_env(dest, **extra))
    project.set_params(tiny_overrides())
    if (dest / "prediction" / "params.yaml").exists():  # new data of the same shape, another seed
        from flows.params_file import apply_overrides

        synth = [o for o in tiny_overrides() if o.startswith("data.synthetic.") and "seed" not in o]
        apply_overrides(dest / "prediction" / "params.yaml", synth + ["runtime.progress=false"])
    project.run("git", "init", "-q")
    project.run("git", "config", "user.email", "test@example.invalid")
    project.run("git", "config", "user.name", "test")
    project.git_commit("tiny project")
    return project


@pytest.fixture(scope="session")
def prefect_home_shared(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("prefect-home")


@pytest.fixture
def project(tmp_path, prefect_home_shared) -> Project:
    return make_project(tmp_path / "proj", prefect_home_shared)


@pytest.fixture
def tmpfs():
    """mount(path, size='1m', ro=False): a tmpfs at `path`, unmounted after the test (full
    and read-only disks; tests run as root, and skip only where mount is not permitted)."""
    mounted: list[Path] = []

    def mount(path: Path, size: str = "1m", ro: bool = False) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        opts = f"size={size}" + (",ro" if ro else "")
        out = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True
        )
        if out.returncode != 0:
            pytest.skip(f"mount -t tmpfs is not permitted here: {out.stderr.strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", str(path)], check=False)
