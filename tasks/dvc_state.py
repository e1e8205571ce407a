"""DVC owns "is this stage stale?": content hashes of code, params and data.

The Prefect flow asks `stage_status` before running a stage and skips it when DVC says it is
up to date; after running it, `commit` records the stage in dvc.lock (and caches its outputs),
so that `dvc status` is clean and `dvc repro` does nothing after a flow run.
"""

from __future__ import annotations

from pathlib import Path

from enn_core.paths import dvc_name


def has_dvc(root: Path) -> bool:
    return (root / ".dvc").is_dir() and (root / "dvc.yaml").is_file()


def stage_status(root: Path, stage: str) -> tuple[bool, str]:
    """(up_to_date, why). `why` names what changed, in DVC's words."""
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        status = repo.status(targets=[dvc_name(stage)])
    if not status:
        return True, "up to date (dvc status clean)"
    return False, f"changed: {status}"


def commit(root: Path, stage: str) -> None:
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        repo.commit(dvc_name(stage), force=True)
