"""A pipeline session whose run has distributed-train with one worker starts that worker early
(a spare, enn_core/runtime/spare.py); one that knows nothing will run, or whose training
starts several workers or restarts, starts none; none is left when the session ends."""

from __future__ import annotations

import pytest

from enn_core.config import load_config
from enn_core.paths import Layout
from enn_core.runtime.spare import _spare
from enn_core.stages import DISTRIBUTED_TRAIN, PREPARE_CHECKPOINT, STAGE_DATA
from tasks.session import pipeline_session

RUN = (STAGE_DATA, PREPARE_CHECKPOINT, DISTRIBUTED_TRAIN)


@pytest.mark.parametrize(
    ("sets", "specs", "spare", "started"),
    [
        ([], RUN, True, True),
        ([], RUN, False, False),  # the flow found every stage up to date
        ([], RUN[:2], True, False),  # `--until prepare-checkpoint`
        (["runtime.world_size=2"], RUN, True, False),  # torchrun starts two
        (["runtime.max_restarts=1"], RUN, True, False),  # torchrun's agent restarts
    ],
)
def test_a_session_starts_a_spare_only_for_a_one_worker_training(
    tmp_path, sets, specs, spare, started
):
    (tmp_path / "params.yaml").write_text("{}\n")
    cfg = load_config(None, ["tracking.enabled=false", "runtime.device=cpu", *sets])
    layout = Layout.for_root(tmp_path)
    with pipeline_session(
        cfg, tmp_path / "params.yaml", layout, "training", specs=specs, spare=spare
    ):
        made = list(_spare)
        assert bool(made) is started
    assert not _spare
    for s in made:
        assert s.proc.returncode is not None  # killed with the session: nothing left running
