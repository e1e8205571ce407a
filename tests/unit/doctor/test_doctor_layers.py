"""Model, kernels, precision, distributed and checkpoint layers: each passes on a healthy
setup and goes to warn or fail, naming the cause, on a broken one."""

from __future__ import annotations

import json

from enn_core.doctor import checkpoints, distributed, kernels, model, precision
from enn_core.doctor.report import Recorder
from tests.fixtures.doctor import context, staged


def _by_name(checks) -> dict:
    return {c.name: c for c in checks}


def test_model_builds_and_runs_on_staged_data(layout):
    staged(layout.root)
    checks = _by_name(model.run(context(layout)))
    assert checks["build"].status == "ok" and "staged data" in checks["build"].detail
    assert checks["forward"].status == "ok" and "finite" in checks["forward"].detail


def test_model_without_staged_data_says_synthetic(layout):
    checks = _by_name(model.run(context(layout)))
    assert checks["build"].status == "ok"
    assert "synthetic manifest (no staged data" in checks["build"].detail


def test_model_build_failure_names_the_manifest_field(layout):
    path = staged(layout.root)
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["label_stats"]["std"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    checks = _by_name(model.run(context(layout)))
    assert checks["build"].status == "fail"
    assert "label_stats lacks mean/std" in checks["build"].detail


def test_attention_reports_the_backend_that_ran(layout):
    checks = _by_name(kernels.run(context(layout)))
    att = checks["attention"]
    assert att.status == "ok" and att.data["backend"] == "flash"
    assert "model forward on it matches math" in att.detail
    assert checks["compile"].status == "skip" and "--quick" in checks["compile"].detail


def test_forced_math_attention_is_reported(layout):
    att = _by_name(kernels.run(context(layout, "train.attention=math")))["attention"]
    assert att.data["backend"] == "math" and att.detail.startswith("math runs")


def test_cuda_only_attention_on_cpu_fails(layout):
    att = _by_name(kernels.run(context(layout, "train.attention=efficient")))["attention"]
    assert att.status == "fail" and "CUDA-only" in att.detail
    assert "train.attention=auto" in att.fix


def test_compile_failure_falls_back_with_the_reason(layout):
    ctx = context(layout, quick=False)
    rec = Recorder("kernels")
    kernels.compile_check(ctx, rec, ctx.model(), backend="no_such_backend")
    check = rec.checks[0]
    assert check.status == "warn" and "fell back to eager" in check.detail
    assert "no_such_backend" in check.detail


def test_precision_on_cpu(layout):
    checks = _by_name(precision.run(context(layout)))
    assert checks["dtypes"].status == "ok" and checks["dtypes"].data["fp32"]["works"]
    assert checks["decision"].status == "ok" and "-> fp32" in checks["decision"].detail


def test_emulated_fp16_on_cpu_warns(layout):
    check = _by_name(precision.run(context(layout, "train.precision=fp16")))["decision"]
    assert check.status == "warn" and "emulated" in check.detail
    assert "train.precision=fp32" in check.fix


def test_distributed_healthy_config(layout):
    checks = _by_name(distributed.run(context(layout)))
    assert [c.status for c in checks.values()] == ["ok", "ok", "ok"]
    assert "gloo" in checks["backend"].detail
    assert checks["timeouts"].data["pg_timeout_s"] == 300.0


def test_missing_cuda_device_fails(layout):
    check = _by_name(distributed.run(context(layout, "runtime.device=cuda")))["backend"]
    assert check.status == "fail" and "runtime.device=cuda" in check.detail


def test_risky_distributed_settings_warn(layout):
    checks = _by_name(
        distributed.run(
            context(
                layout,
                "runtime.start_method=fork",
                "runtime.task_timeout_s=60",
                "runtime.pg_timeout_s=300",
            )
        )
    )
    assert (
        checks["world size"].status == "warn" and "start_method=spawn" in checks["world size"].fix
    )
    assert (
        checks["timeouts"].status == "warn"
        and "before a stuck rank is named" in checks["timeouts"].detail
    )


def test_dcp_round_trip_ok(layout):
    checks = _by_name(checkpoints.run(context(layout)))
    assert (
        checks["dcp round trip"].status == "ok" and "bit-exact" in checks["dcp round trip"].detail
    )
    assert checks["consolidated"].status == "skip"
    assert not any(layout.checkpoints.iterdir()), "the round trip leaves nothing behind"


def test_dcp_round_trip_on_read_only_checkpoint_dir_fails(layout, tmpfs):
    tmpfs(layout.checkpoints, size="1m", ro=True)
    check = _by_name(checkpoints.run(context(layout)))["dcp round trip"]
    assert check.status == "fail" and "Read-only file system" in check.detail


def test_dcp_round_trip_on_full_checkpoint_dir_fails(layout, tmpfs):
    tmpfs(layout.checkpoints, size="64k")
    check = _by_name(checkpoints.run(context(layout)))["dcp round trip"]
    assert check.status == "fail" and "No space left on device" in check.detail
    assert "runtime.work_dir" in check.fix
