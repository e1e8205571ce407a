"""One tuning trial, as its own process: prepare-checkpoint and distributed-train on the
study's staged data, in the trial's own folder.

    python -m tasks.tuning.trial work/tune/<study>/trial-<N>/trial.json

The folder is the trial's layout: `outputs/` (stage-data linked to the study's staged data),
`work/runs/trial/<stage>/` (run directories: the study follows distributed-train's
`events.jsonl`) and `work/checkpoints/`. The trial takes no pipeline lock, writes neither
params.yaml nor dvc.lock and logs nothing to MLflow (the study does, from the events).
The study starts it in its own process group, which it kills to prune; a trial whose study
died kills its own group (the parent watch below), so no orphaned worker trains on.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from enn_core.atomic import write_json
from enn_core.config import load_config
from enn_core.paths import Layout
from enn_core.stages import DISTRIBUTED_TRAIN, PREPARE_CHECKPOINT, STAGE_DATA
from tasks.runner import PipelineSession, execute_stage

TRIAL_FILE = "trial.json"
RUN_ID = "trial"  # the trial's run directories: work/runs/trial/<stage>/


@dataclass(frozen=True)
class TrialJob:
    """What a trial process runs (the JSON file in its folder)."""

    number: int
    config: str  # the study's config file
    overrides: tuple[str, ...]  # the study's --set, then the trial's values and its runtime
    root: str  # the project root (data paths, a custom model's code)
    staged: str  # the study's stage-data output folder
    folder: str

    def write(self) -> Path:
        path = Path(self.folder) / TRIAL_FILE
        write_json(path, asdict(self))
        return path

    @classmethod
    def read(cls, path: Path) -> TrialJob:
        raw = json.loads(path.read_text())
        return cls(**{**raw, "overrides": tuple(raw["overrides"])})


def trial_layout(job: TrialJob) -> Layout:
    folder = Path(job.folder).resolve()
    return Layout(
        root=Path(job.root).resolve(), work=folder / "work", outputs_dir=folder / "outputs"
    )


def events_file(folder: Path) -> Path:
    """distributed-train's events of the trial in `folder` (what the study follows)."""
    return folder / "work" / "runs" / RUN_ID / DISTRIBUTED_TRAIN.name / "events.jsonl"


def checkpoint_files(folder: Path) -> list[Path]:
    """What a trial leaves that the study deletes when it ends: the DCP checkpoints and the
    consolidated init.pt / model.pt (the metrics, history and logs stay)."""
    out = [folder / "work" / "checkpoints"]
    out += sorted((folder / "outputs").glob("*/*.pt")) if (folder / "outputs").is_dir() else []
    return [p for p in out if p.exists() and not p.is_symlink()]


def watch_parent(poll_s: float = 0.5) -> None:
    """Kill this trial's process group (itself and its workers) once its study is gone."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.killpg(os.getpgid(0), signal.SIGKILL)

    threading.Thread(target=watch, name="enn-trial-parent-watch", daemon=True).start()


def run(job: TrialJob) -> None:
    layout = trial_layout(job)
    cfg = load_config(job.config, list(job.overrides))
    staged = STAGE_DATA.output_dir(layout)
    staged.parent.mkdir(parents=True, exist_ok=True)
    if not staged.exists():
        staged.symlink_to(Path(job.staged).resolve(), target_is_directory=True)
    session = PipelineSession(cfg=cfg, config=Path(job.config), layout=layout, run_id=RUN_ID)
    for spec in (PREPARE_CHECKPOINT, DISTRIBUTED_TRAIN):
        execute_stage(spec, session)


def main(argv: list[str]) -> int:
    import logging

    from enn_core.errors import EnnError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    watch_parent()
    job = TrialJob.read(Path(argv[0]))
    try:
        run(job)
    except EnnError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
