"""One tuning trial in its own process group (`python -m tasks.tuning.trial <folder>/trial.json`):
prepare-checkpoint and distributed-train on the study's staged data, in its folder, with no lock,
params file or MLflow of its own; it dies with its study (docs/design.md, "Tuning")."""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from enn_core.atomic import write_json
from enn_core.config import load_config
from enn_core.errors import EnnError
from enn_core.paths import Layout
from enn_core.runtime.parent import die_with_parent, exit_process
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
        write_json(Path(self.folder) / TRIAL_FILE, asdict(self))
        return Path(self.folder) / TRIAL_FILE


def events_file(folder: Path) -> Path:
    """distributed-train's events of the trial in `folder` (what the study follows)."""
    return folder / "work" / "runs" / RUN_ID / DISTRIBUTED_TRAIN.name / "events.jsonl"


def run(job: TrialJob) -> None:
    folder = Path(job.folder).resolve()
    layout = Layout(Path(job.root).resolve(), work=folder / "work", outputs_dir=folder / "outputs")
    cfg = load_config(job.config, list(job.overrides))
    staged = STAGE_DATA.output_dir(layout)
    staged.parent.mkdir(parents=True, exist_ok=True)
    if not staged.exists():
        staged.symlink_to(Path(job.staged).resolve(), target_is_directory=True)
    session = PipelineSession(cfg=cfg, config=Path(job.config), layout=layout, run_id=RUN_ID)
    for spec in (PREPARE_CHECKPOINT, DISTRIBUTED_TRAIN):
        execute_stage(spec, session)


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    die_with_parent()
    raw = json.loads(Path(argv[0]).read_text())
    job = TrialJob(**{**raw, "overrides": tuple(raw["overrides"])})
    try:
        run(job)
    except EnnError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    exit_process(main(sys.argv[1:]))
