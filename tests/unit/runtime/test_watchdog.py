"""The launcher's watchdog on synthetic heartbeats: it names the silent rank, not the peer
that waits for it in a collective, and waits while only the victim is stale; on one node of
several, it waits out the rendezvous and names only ranks it has seen."""

from __future__ import annotations

import json
import time
from pathlib import Path

from enn_core.runtime.heartbeat import Heartbeat, heartbeat_path, read_heartbeats
from enn_core.runtime.launch import Watchdog


def beat(run_dir, rank, *, age, phase="first_forward", in_collective=False, frame="x.py:1 in f"):
    path = heartbeat_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    now = time.time()
    rec = {
        "rank": rank,
        "pid": 1,
        "phase": phase,
        "step": 0,
        "progress_time": now - age,
        "beat_time": now,
        "in_collective": in_collective,
        "frame": frame,
    }
    path.write_text(json.dumps(rec))


def test_names_the_rank_outside_the_collective(tmp_path):
    w = Watchdog(tmp_path, 2, hang_timeout_s=10, budgets={})
    beat(tmp_path, 0, age=12, in_collective=True, frame="torch/distributed/c10d.py:1 in all_gather")
    beat(tmp_path, 1, age=5)
    assert w.check(time.time()) is None  # only the victim is stale yet: wait for the culprit
    beat(tmp_path, 1, age=11, frame="fault.py:97 in at")
    v = w.check(time.time())
    assert (v.rank, v.phase, v.waiting) == (1, "first_forward", [0]) and "fault.py" in v.frame


def test_no_heartbeat_past_the_spawn_budget_names_the_missing_rank(tmp_path):
    w = Watchdog(tmp_path, 2, hang_timeout_s=1, budgets={"spawn": 1})
    beat(tmp_path, 0, age=0, phase="step")
    assert w.check(time.time()) is None
    v = w.check(time.time() - 5)
    assert (v.rank, v.phase) == (1, "spawn")


def test_phase_budgets_and_done_ranks(tmp_path):
    w = Watchdog(tmp_path, 2, hang_timeout_s=1, budgets={"compile": 100})
    beat(tmp_path, 0, age=50, phase="compile")
    beat(tmp_path, 1, age=50, phase="done")
    assert w.check(time.time()) is None


def test_worker_heartbeat_sees_its_main_thread(tmp_path):
    hb = Heartbeat(tmp_path, 3, interval=0.05).start()
    hb.phase("step", 7)
    time.sleep(0.2)
    rec = read_heartbeats(tmp_path)[3]
    hb.stop()
    assert (rec["phase"], rec["step"], rec["in_collective"]) == ("step", 7, False)
    assert "test_watchdog.py" in rec["frame"]
    assert read_heartbeats(tmp_path)[3]["phase"] == "done"


def _beat(run_dir: Path, rank: int, age: float, phase: str = "step") -> None:
    path = heartbeat_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    now = time.time()
    path.write_text(
        json.dumps(
            {
                "rank": rank,
                "pid": 1,
                "phase": phase,
                "step": 3,
                "frame": "x.py:1 in f",
                "progress_time": now - age,
                "beat_time": now,
                "in_collective": False,
            }
        )
    )


def test_watchdog_of_a_node_that_owns_global_ranks_2_and_3(tmp_path):
    w = Watchdog(
        tmp_path, 2, hang_timeout_s=1, budgets={"spawn": 1}, local_only=True, rendezvous_s=5
    )
    _beat(tmp_path, 3, age=0)
    assert w.check(time.time() - 6) is None  # still inside the rendezvous wait
    v = w.check(time.time() - 8)  # rank 2 never beat: this node cannot name it
    assert v.rank is None and v.phase == "spawn" and "seen: ranks [3]" in v.frame
    assert v.message(tmp_path).startswith("a worker of this node hung in phase spawn")
    _beat(tmp_path, 2, age=5)  # both beat; rank 2 then went silent outside a collective
    v = w.check(time.time())
    assert (v.rank, v.phase, v.step) == (2, "step", 3)
