"""Workers layer through the real elastic launcher: two CPU workers all-reduce; a rank that
never reaches the all-reduce (an injected hang) fails the check within its timeout, naming
that rank and its phase."""

from __future__ import annotations

import time

import pytest

from enn_core.doctor import workers
from tests.fixtures.doctor import context


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_two_workers_all_reduce(layout):
    checks = workers.run(context(layout, "runtime.pg_timeout_steady_s=30"))
    check = checks[0]
    assert check.status == "ok", check
    assert check.data["workers"] == 2 and check.data["lanes"] == ["gloo"]
    assert not any((layout.work / "doctor").iterdir()), "a passing check leaves no run records"


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_blocked_all_reduce_fails_within_the_timeout_naming_the_rank(layout):
    ctx = context(
        layout,
        "runtime.pg_timeout_steady_s=5",
        "fault.kind=hang",
        f"fault.phase={workers.PHASE}",
        "fault.rank=1",
        "fault.seconds=600",
    )
    t0 = time.time()
    check = workers.run(ctx)[0]
    elapsed = time.time() - t0
    assert check.status == "fail", check
    assert "rank 1 hung in phase doctor_allreduce" in check.detail
    assert "stacks" in check.fix and check.data["run_dir"] in check.fix
    # spawn (a few seconds per process on a loaded 2-core machine) + the 5 s timeout + stack dumps
    assert elapsed < 2 * ctx.cfg.runtime.spawn_budget_s + 3 * 5
