"""DVC owns "is this stage stale?": content hashes of code, params and data.

The Prefect flow asks `stage_status` before running a stage and skips it when DVC says it is
up to date; after running it, `commit` records the stage in dvc.lock (and caches its outputs),
so that `dvc status` is clean and `dvc repro` does nothing after a flow run.

`root` is the pipeline's folder (the one holding its dvc.yaml and params.yaml): the
repository root for the training pipeline, `prediction/` for the prediction pipeline.
"""

from __future__ import annotations

import logging
from pathlib import Path

from enn_core.stages import StageSpec


def repo_root(root: Path) -> Path | None:
    for d in (root, *root.parents):
        if (d / ".dvc").is_dir():
            return d
    return None


def has_dvc(root: Path) -> bool:
    return repo_root(root) is not None and (root / "dvc.yaml").is_file()


def owns(root: Path, config: str | Path) -> bool:
    """Whether DVC decides staleness for a run of `config`: only for the pipeline's own
    params.yaml, the file its dvc.yaml reads. A run from another config file (an overlay such
    as configs/expressway.yaml) is not the run DVC describes: asking `dvc status` could skip a
    stage whose real inputs changed, and `dvc commit` would record params.yaml's values for
    outputs made from other ones."""
    return has_dvc(root) and Path(config).resolve() == (root / "params.yaml").resolve()


def _target(root: Path, spec: StageSpec) -> tuple[Path, str]:
    """(the DVC project holding the pipeline, the stage as a target). The target's path is
    absolute: DVC reads a relative one from the current directory, and `enn run --flow
    prediction` from the project root would otherwise name the training pipeline's stage of
    that name (the prediction pipeline is a DVC project of its own)."""
    repo = repo_root(root)
    assert repo is not None, f"{root} is not inside a DVC repository"
    return repo, f"{(root / 'dvc.yaml').resolve()}:{spec.dvc_name}"


# The loggers whose level turns DVC's and dvc-data's progress bars off (their Tqdm classes).
PROGRESS_LOGGERS = ("dvc.progress", "dvc_data.callbacks")


def _repo_class() -> type:
    """DVC's Repo, with DVC's loggers handing their records to this process's handlers
    (`import dvc` gives them console handlers of their own, which print "Updating lock file"
    on stdout once per stage, twice with ours): its INFO lines go to the log file only.

    DVC's progress bars are off: in a terminal, every time it takes its repository lock it
    draws "Waiting to acquire lock. If DVC froze, see `hardlink_lock` ..." for a moment, even
    when nobody else holds it (a newcomer read it as a hang, once per stage), and committing a
    stage drew dvc-data's "Checking cache in '.dvc/cache/files/md5'" bar. Each library's bars
    are off when its progress logger is above ERROR (`dvc.progress`, `dvc_data.callbacks`);
    nothing else logs there."""
    from dvc.repo import Repo

    for name in ("dvc", "dvc_objects", "dvc_data"):
        logging.getLogger(name).handlers.clear()
    for bars in PROGRESS_LOGGERS:
        logging.getLogger(bars).setLevel(logging.CRITICAL)
    return Repo


def stage_status(root: Path, spec: StageSpec) -> tuple[bool, str]:
    """(up_to_date, why). `why` names what changed, in DVC's words."""
    Repo = _repo_class()  # noqa: N806 - DVC's class

    repo_dir, target = _target(root, spec)
    with Repo(str(repo_dir)) as repo:
        status = repo.status(targets=[target])
    if not status:
        return True, "up to date (dvc status clean)"
    return False, f"changed: {status}"


def all_fresh(root: Path, specs: tuple[StageSpec, ...]) -> bool:
    """Whether every stage of `specs` is up to date: a run of them would do nothing."""
    Repo = _repo_class()  # noqa: N806 - DVC's class

    if not specs:
        return True
    repo_dir = _target(root, specs[0])[0]
    with Repo(str(repo_dir)) as repo:
        return not repo.status(targets=[_target(root, s)[1] for s in specs])


def commit(root: Path, spec: StageSpec) -> None:
    Repo = _repo_class()  # noqa: N806 - DVC's class

    repo_dir, target = _target(root, spec)
    with Repo(str(repo_dir)) as repo:
        repo.commit(target, force=True)
