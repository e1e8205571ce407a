"""The bottleneck verdict of a real 2-worker FSDP2 run on gloo counts the time the ranks are
blocked in FSDP2's own collectives (enn_core.runtime.comm_clock).

A slow link is injected inside FSDP2's own collectives (`fault.kind=comm_delay`): in rank 1's
reduce-scatters, so that rank 0, the one that records telemetry, never sleeps and what it
records is the time it waits in the real gloo reduce-scatter for its slow peer; and in rank
0's all-gathers. Either run must be communication-bound in its `bottleneck` events and its
epoch history; the same run without the delay must not be.

The shapes are larger than the other distributed tests' (a 16 x 24 grid, d_model 64, 48 rows
per rank per step): on two shared cores each gloo collective costs milliseconds of scheduling
latency, so a tiny model's steps really are dominated by their eight-odd collectives.
"""

from __future__ import annotations

import pytest

from enn_core.events import read_events
from enn_core.paths import Layout
from enn_core.telemetry import BOUND_SHARE, read_verdicts
from tests.fixtures.distributed import cfg_of, make_project, outputs, run_train

pytestmark = pytest.mark.timeout(300)

SHAPE = (
    "data.synthetic.n_months=12",
    "data.synthetic.n_replicates=6",
    "data.synthetic.n_sections=16",
    "data.synthetic.n_hours=24",
    "model.d_model=64",
    "model.heads=4",
)
TRAIN = (*SHAPE, "train.epochs=2", "train.batch_size=96")


def slow_link(collective: str, rank: int) -> tuple[str, ...]:
    """0.3 s inside each of `rank`'s FSDP2 collectives of that kind (3 FSDP2 modules: the two
    blocks and the root, so about 0.9 s per step against about 0.6 s of compute)."""
    return (
        "fault.kind=comm_delay",
        f"fault.phase={collective}",
        f"fault.rank={rank}",
        "fault.seconds=0.3",
    )


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Layout:
    return make_project(tmp_path_factory.mktemp("comm") / "proj", *SHAPE)


def train_and_read(project: Layout, *extra: str) -> tuple[dict, list[dict], list[dict]]:
    """(summary, the `bottleneck` events rank 0 recorded, the published epoch history)."""
    summary, run_dir = run_train(project, cfg_of(*TRAIN, *extra))
    history, _ = outputs(project)
    return summary, read_verdicts(read_events(run_dir)), history["epochs"]


def comm_shares(verdicts: list[dict]) -> list[float]:
    return [round(v["shares"].get("communication", 0.0), 3) for v in verdicts]


@pytest.fixture(scope="module")
def healthy(project) -> tuple[dict, list[dict], list[dict]]:
    return train_and_read(project)


def test_the_run_without_a_delay_is_not_communication_bound(healthy):
    _, verdicts, epochs = healthy
    print("communication share without a delay:", comm_shares(verdicts))
    assert [v["epoch"] for v in verdicts] == [0, 1]
    for v, row in zip(verdicts, epochs, strict=True):
        assert v["verdict"] != "communication-bound", v
        # FSDP2's collectives were timed all the same: a real, small share
        assert 0.0 < v["shares"]["communication"] < BOUND_SHARE, v
        assert row["bottleneck"] == v["verdict"] and 0.0 < row["comm_share"] < BOUND_SHARE


@pytest.mark.parametrize(("collective", "rank"), [("reduce_scatter", 1), ("all_gather", 0)])
def test_a_slow_fsdp2_collective_makes_the_run_communication_bound(
    project, healthy, collective, rank
):
    summary, verdicts, epochs = train_and_read(project, *slow_link(collective, rank))
    print(f"communication share, {collective} slowed on rank {rank}:", comm_shares(verdicts))
    assert [v["epoch"] for v in verdicts] == [0, 1]
    for v, row in zip(verdicts, epochs, strict=True):
        assert v["verdict"] == "communication-bound", v
        assert v["shares"]["communication"] >= BOUND_SHARE and "in collectives" in v["reason"]
        assert row["bottleneck"] == "communication-bound" and row["comm_share"] >= BOUND_SHARE
    # the timing and the delay change when the ranks compute, never what they compute
    ranks, healthy_ranks = summary["ranks"], healthy[0]["ranks"]
    assert ranks[0]["step_losses_sha"] == ranks[1]["step_losses_sha"]
    assert ranks[0]["step_losses_sha"] == healthy_ranks[0]["step_losses_sha"]
