"""The doctor with real worker processes.

The workers layer through the real elastic launcher: two CPU workers all-reduce; a rank that
never reaches the all-reduce (an injected hang) fails the check within its timeout, naming
that rank and its phase. The whole doctor on staged data through main() (quick: no compile,
no export). The diagnostics record of real training with injected faults (NaN in a batch,
out-of-memory) names them."""

from __future__ import annotations

import io
import json
import time

import pytest

from enn_core.diagnostics import diagnostics, markdown
from enn_core.doctor import LAYERS, main, workers
from enn_core.stages import DISTRIBUTED_TRAIN, PREPARE_CHECKPOINT
from tests.fixtures.doctor import context, make_config, staged


@pytest.mark.timeout(240)
def test_two_workers_all_reduce(layout):
    checks = workers.run(context(layout, "runtime.pg_timeout_steady_s=30"))
    check = checks[0]
    assert check.status == "ok", check
    assert check.data["workers"] == 2 and check.data["lanes"] == ["gloo"]
    assert not any((layout.work / "doctor").iterdir()), "a passing check leaves no run records"


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


@pytest.mark.timeout(300)
def test_quick_doctor_on_staged_data_passes(layout):
    staged(layout.root)
    out = io.StringIO()
    code = main(make_config(), layout, quick=True, as_json=True, out=out)
    doc = json.loads(out.getvalue())
    assert code == 0, [c for c in doc["checks"] if c["status"] == "fail"]
    assert {c["layer"] for c in doc["checks"]} == set(LAYERS)
    skipped = {(c["layer"], c["name"]) for c in doc["checks"] if c["status"] == "skip"}
    assert {("kernels", "compile"), ("export", "torch.export")} <= skipped


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault", ["nan", "oom"])
def test_injected_fault_is_named_in_the_record(tmp_path, fault):
    from enn_core.config import load_config
    from enn_core.paths import Layout
    from enn_core.stage import make_context
    from enn_core.stages.demo import stage_synthetic

    tiny = [
        "data.synthetic.n_months=4",
        "data.synthetic.n_daytypes=2",
        "data.synthetic.n_sections=4",
        "data.synthetic.n_hours=6",
        "model.d_model=16",
        "model.heads=2",
        "model.layers=1",
        "model.embed_dim=4",
        "train.epochs=1",
        "train.batch_size=8",
        "train.warmup_steps=1",
        "train.patience=0",
        "runtime.world_size=1",
        "runtime.progress=false",
        "runtime.threads_per_worker=1",
    ]
    cfg = load_config(
        None, [*tiny, f"fault.kind={fault}", "fault.phase=step", "fault.step=2"], allow_faults=True
    )
    (tmp_path / "params.yaml").write_text("{}\n")
    layout = Layout.for_root(tmp_path)
    stage_synthetic(tmp_path, n_months=4, n_daytypes=2, n_sections=4, n_hours=6)
    PREPARE_CHECKPOINT.work(cfg, make_context(cfg, layout, PREPARE_CHECKPOINT, "setup"))
    ctx = make_context(cfg, layout, DISTRIBUTED_TRAIN, "faulty")
    DISTRIBUTED_TRAIN.work(cfg, ctx)
    diag = diagnostics(ctx.run_dir)
    if fault == "nan":
        assert diag["nonfinite"][0]["step"] == 2 and diag["nonfinite"][0]["tensor"].startswith(
            "batch.features"
        )
        assert "non-finite batch.features" in markdown(diag)
    else:
        assert diag["oom_backoffs"][0]["step"] == 2
        assert (
            diag["oom_backoffs"][0]["micro_batch_after"]
            == diag["oom_backoffs"][0]["micro_batch_before"] // 2
        )
    assert diag["workers"]["0"]["phase"] == "done"
    assert diag["choices"]["attention"] in ("flash", "math")
