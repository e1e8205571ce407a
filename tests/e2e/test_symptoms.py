"""Each symptom of the operational risk map, provoked through the training flow's own Prefect
tasks and named where the user looks: the stage's diagnostics record (diagnostics.json in its
run directory), its MLflow run, and the Prefect artifacts of the flow run.

The module fixture runs one child process (one temporary Prefect server for all): it stages the
data and trains a healthy model once (stage-data -> prepare-checkpoint -> distributed-train ->
collapse-check), then runs each symptom as its own flow run of only the stage concerned:

- starvation: distributed-train with the batch loader slowed to 20x the step's compute;
- nan / oom: distributed-train with a NaN injected into a batch / an out-of-memory at step 2;
- hang: distributed-train on 2 ranks, rank 1 hangs in its first forward;
- attention: distributed-train forced onto the math attention backend;
- collapse: collapse-check on a checkpoint whose head is zero (one map for every input);
- export: export of a prediction path ending in an operator ONNX cannot translate.

The project has no dvc.yaml, so the flow runs every stage it is given (DVC's skipping is
tested in test_pipeline.py). The loader and the operator are injected by test code in the
child (a sitecustomize hook that reaches the spawned workers; a custom torch operator), since
the fault facility has no phase inside the loader's timing and no operator fault.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.fixtures.project import Project, make_project

pytestmark = pytest.mark.timeout(1200)
ONE_EPOCH = ["train.epochs=1"]
PLAN = [
    {
        "name": "baseline",
        "stages": ["stage-data", "prepare-checkpoint", "distributed-train", "collapse-check"],
        "overrides": ["train.epochs=10"],
    },
    {"name": "export", "stages": ["export"], "overrides": [], "inject": "unsupported_op"},
    {"name": "collapse", "stages": ["collapse-check"], "overrides": [], "inject": "constant_model"},
    {
        "name": "nan",
        "stages": ["distributed-train"],
        "overrides": [*ONE_EPOCH, "fault.kind=nan", "fault.phase=step", "fault.step=2"],
    },
    {
        "name": "oom",
        "stages": ["distributed-train"],
        "overrides": [*ONE_EPOCH, "fault.kind=oom", "fault.phase=step", "fault.step=2"],
    },
    {
        "name": "attention",
        "stages": ["distributed-train"],
        "overrides": [*ONE_EPOCH, "train.attention=math"],
    },
    {
        "name": "starvation",
        "stages": ["distributed-train"],
        "overrides": ONE_EPOCH,
        "inject": "slow_loader",
    },
    {
        "name": "hang",
        "stages": ["distributed-train"],
        "overrides": [
            *ONE_EPOCH,
            "runtime.world_size=2",
            "runtime.hang_timeout_s=10",
            "fault.kind=hang",
            "fault.phase=first_forward",
            "fault.rank=1",
        ],
    },
]

SLOW_LOADER_HOOK = '''"""Test hook: with ENN_TEST_SLOW_LOADER=<factor>, the trainer's batch
loader sleeps <factor> x the time since its previous call (the step's compute), at most 2 s, in
every process started with this folder on PYTHONPATH (the spawned training workers included)."""
import os

if os.environ.get("ENN_TEST_SLOW_LOADER"):
    import time

    import enn_core.train.step as _step

    _factor, _load, _last = float(os.environ["ENN_TEST_SLOW_LOADER"]), _step.micro_batches, [None]

    def _slow_loader(*args, **kwargs):
        if _last[0] is not None:
            time.sleep(min(_factor * (time.perf_counter() - _last[0]), 2.0))
        out = _load(*args, **kwargs)
        _last[0] = time.perf_counter()
        return out

    _step.micro_batches = _slow_loader
'''

DRIVER = '''"""Each plan item as its own flow run of the named training stages (their Prefect
tasks); writes the flow run's state and its artifacts, read back through the Prefect client."""
import json
import os
import sys
import time
from pathlib import Path

from tasks.env import contain, project_layout

contain(project_layout(Path.cwd(), "work"))  # the entry point's first step, before prefect

from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter, FlowRunFilter, FlowRunFilterId, TaskRunFilter,
)

from enn_core.stages import lookup
from flows.training import run_stages


@flow(name="symptom", persist_result=False)
def symptom(stages: list, overrides: list) -> dict:
    return run_stages("symptom", "params.yaml", overrides, tuple(lookup(s) for s in stages))


def constant_model():
    """A checkpoint whose head and per-cell read-out are zero: one map for every input."""
    import torch

    path = Path("outputs/distributed-train/model.pt")
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    for name, t in ckpt["state_dict"].items():
        if name.startswith("head.out.") or name == "cell_readout":
            t.zero_()
    torch.save(ckpt, path)


def unsupported_op():
    """The exported prediction path ends in a custom operator with no ONNX translation."""
    import torch

    import enn_core.export as export

    @torch.library.custom_op("enntest::twist", mutates_args=())
    def twist(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @twist.register_fake
    def _(x):
        return torch.empty_like(x)

    base = export.PredictionPath

    class Twisted(base):
        def forward(self, x):
            return twist(super().forward(x))

    export.PredictionPath = Twisted
    return lambda: setattr(export, "PredictionPath", base)


def slow_loader():
    os.environ["ENN_TEST_SLOW_LOADER"] = "20"  # read by the sitecustomize hook in the workers
    return lambda: os.environ.pop("ENN_TEST_SLOW_LOADER")


def main(plan_path, out_dir):
    params = Path("params.yaml")
    original = params.read_text()
    for item in json.loads(Path(plan_path).read_text()):
        t0 = time.time()
        params.write_text(original)  # every symptom starts from the same parameters
        inject = {"constant_model": constant_model, "unsupported_op": unsupported_op,
                  "slow_loader": slow_loader}.get(item.get("inject"), lambda: None)
        undo = inject()
        try:
            state = symptom(item["stages"], item["overrides"], return_state=True)
        finally:
            if undo:
                undo()
        run_id = state.state_details.flow_run_id
        with get_client(sync_client=True) as client:
            arts = client.read_artifacts(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])),
                task_run_filter=TaskRunFilter(), artifact_filter=ArtifactFilter(), limit=200,
                offset=0, sort="KEY_ASC")
        out = {"flow_run_id": str(run_id), "state": state.type.value, "message": state.message,
               "seconds": round(time.time() - t0, 1),
               "artifacts": {a.key: {"type": a.type, "data": a.data} for a in arts}}
        Path(out_dir, item["name"] + ".json").write_text(json.dumps(out, default=str))
        print("symptom", item["name"], state.type.value, out["seconds"], "s", flush=True)


if __name__ == "__main__":  # spawned training workers re-import this file
    main(sys.argv[1], sys.argv[2])
'''


@dataclass
class Provoked:
    project: Project
    results: dict[str, dict]
    client: object  # mlflow.tracking.MlflowClient on the project's store
    downloads: Path


@dataclass
class Seen:
    """One symptom where the user looks."""

    state: str
    record: dict  # diagnostics.json in the stage's run directory
    run: object  # the stage's MLflow run
    mlflow_record: dict  # diagnostics.json as logged to that run
    markdown: str  # the stage's diagnostics artifact in Prefect
    artifacts: dict[str, dict]  # every Prefect artifact of the flow run, by key


@pytest.fixture(scope="module")
def provoked(tmp_path_factory, prefect_home_shared) -> Provoked:
    tmp = tmp_path_factory.mktemp("symptoms")
    project = make_project(tmp / "proj", prefect_home_shared)
    (project.root / "dvc.yaml").unlink()  # the flow runs every stage it is given
    (tmp / "hooks").mkdir()
    (tmp / "hooks" / "sitecustomize.py").write_text(SLOW_LOADER_HOOK)
    (tmp / "driver.py").write_text(DRIVER)
    (tmp / "plan.json").write_text(json.dumps(PLAN))
    (tmp / "results").mkdir()
    project.env["PYTHONPATH"] = f"{tmp / 'hooks'}:{project.root}"
    out = project.run(
        sys.executable,
        str(tmp / "driver.py"),
        str(tmp / "plan.json"),
        str(tmp / "results"),
        timeout=1100,
    )
    results = {p.stem: json.loads(p.read_text()) for p in (tmp / "results").glob("*.json")}
    assert set(results) == {item["name"] for item in PLAN}, out.stdout[-3000:]
    assert results["baseline"]["state"] == "COMPLETED", results["baseline"]["message"]
    print(" ".join(f"{k} {v['seconds']} s;" for k, v in results.items()))
    from mlflow.tracking import MlflowClient  # telemetry off: tests/conftest.py

    uri = f"sqlite:///{project.root / 'work' / 'mlflow' / 'mlflow.db'}"
    return Provoked(project, results, MlflowClient(tracking_uri=uri), tmp / "downloads")


def seen(p: Provoked, name: str, stage: str) -> Seen:
    result = p.results[name]
    flow_run = result["flow_run_id"]
    record = json.loads(
        (p.project.root / "work" / "runs" / flow_run / stage / "diagnostics.json").read_text()
    )
    exp = p.client.get_experiment_by_name("enn")
    runs = p.client.search_runs(
        [exp.experiment_id],
        f"tags.`prefect.flow_run_id` = '{flow_run}' and tags.`enn.stage` = '{stage}'",
    )
    assert len(runs) == 1, [r.info.run_name for r in runs]
    dst = p.downloads / name
    dst.mkdir(parents=True, exist_ok=True)
    logged = Path(p.client.download_artifacts(runs[0].info.run_id, "diagnostics.json", str(dst)))
    arts = result["artifacts"]
    return Seen(
        result["state"],
        record,
        runs[0],
        json.loads(logged.read_text()),
        arts[f"{stage}-diagnostics"]["data"],
        arts,
    )


def table(artifact: dict) -> list[dict]:
    data = artifact["data"]
    return json.loads(data) if isinstance(data, str) else data


def test_data_starvation_is_data_bound(provoked):
    s = seen(provoked, "starvation", "distributed-train")
    assert s.state == "COMPLETED"
    for record in (s.record, s.mlflow_record):
        last = record["bottleneck"][-1]
        assert last["verdict"] == "data-bound" and last["shares"]["data"] >= 0.3, last
    assert json.loads(s.run.data.tags["event.bottleneck"])["verdict"] == "data-bound"
    assert s.run.data.metrics["telemetry/bottleneck/data_share"] >= 0.3
    assert (
        "bottleneck: data-bound in the last epoch" in s.markdown
        and "| 0 | data-bound |" in s.markdown
    )
    # the same stage with the loader at full speed is not data-bound
    healthy = seen(provoked, "attention", "distributed-train")
    assert healthy.record["bottleneck"][-1]["verdict"] != "data-bound"


def test_nan_in_a_batch_names_the_tensor_and_the_step(provoked):
    s = seen(provoked, "nan", "distributed-train")
    assert s.state == "COMPLETED"  # the step is skipped, training goes on
    for record in (s.record, s.mlflow_record):
        first = record["nonfinite"][0]
        assert (
            first["tensor"].startswith("batch.features")
            and first["step"] == 2
            and first["rank"] == 0
        )
    tag = json.loads(s.run.data.tags["event.nonfinite_skip"])
    assert tag["tensor"].startswith("batch.features") and tag["step"] == 2
    assert (
        "non-finite batch.features[micro 0]" in s.markdown and "at step 2 on rank 0" in s.markdown
    )
    rows = {r["name"]: r["value"] for r in table(s.artifacts["distributed-train-table"])}
    assert rows["skipped_steps"] == 1


def test_hang_names_the_rank_and_the_phase(provoked):
    s = seen(provoked, "hang", "distributed-train")
    named = "rank 1 hung in phase first_forward"
    assert s.state == "FAILED"
    for record in (s.record, s.mlflow_record):
        assert (
            record["stage_error"]["type"] == "WorkerError"
            and named in record["stage_error"]["message"]
        )
        assert record["workers"]["1"]["phase"] == "first_forward"
        assert any(p.endswith("rank-1.txt") for p in record["stacks"])
    assert s.run.info.status == "FAILED" and named in s.run.data.tags["enn.error"]
    assert s.run.data.params["resolved.workers.rank1_phase"] == "first_forward"
    assert f"- stage failed: WorkerError: attempt 0: {named}" in s.markdown
    assert "| 1 | first_forward | 0 |" in s.markdown


def test_out_of_memory_leaves_the_back_off_record(provoked):
    s = seen(provoked, "oom", "distributed-train")
    assert s.state == "COMPLETED"
    for record in (s.record, s.mlflow_record):
        b = record["oom_backoffs"][0]
        assert (
            b["step"],
            b["micro_batch_before"],
            b["micro_batch_after"],
            b["accumulation_after"],
        ) == (2, 8, 4, 2)
    assert json.loads(s.run.data.tags["event.oom_backoff"])["micro_batch_after"] == 4
    assert s.run.data.metrics["telemetry/memory/micro_batch"] == 4
    assert "out of memory at step 2: micro-batch 8 -> 4 (accumulation 2)" in s.markdown


def test_collapse_shows_the_candidates_table(provoked, tmp_path):
    s = seen(provoked, "collapse", "collapse-check")
    assert s.state == "FAILED"
    for record in (s.record, s.mlflow_record):
        assert record["stage_error"]["type"] == "CollapseError"
        assert "every candidate collapsed" in record["stage_error"]["message"]
        rows = {r["candidate"]: r for r in record["tables"]["candidates"]}
        assert set(rows) == {"raw", "calibrated", "fp32", "per_sample"}
        assert rows["raw"]["status"] == "failed" and rows["raw"]["spread_median"] == 0.0
        assert (
            rows["raw"]["broadcast_fraction"] == 1.0
            and "broadcast_fraction" in rows["raw"]["failed"]
        )
    assert (
        s.run.info.status == "FAILED"
        and "every candidate collapsed" in s.run.data.tags["enn.error"]
    )
    assert s.run.data.metrics["collapse/raw/spread_median"] == 0.0
    report = json.loads(
        Path(
            provoked.client.download_artifacts(s.run.info.run_id, "report.json", str(tmp_path))
        ).read_text()
    )
    assert report["status"] == "failed" and set(report["candidates"]) == set(rows)
    prefect_rows = {r["candidate"]: r for r in table(s.artifacts["collapse-check-candidates"])}
    assert set(prefect_rows) == set(rows) and prefect_rows["raw"]["status"] == "failed"
    assert "### Candidates" in s.markdown and "| raw | failed |" in s.markdown
    assert "- stage failed: CollapseError: collapse-check: every candidate collapsed" in s.markdown
    # the healthy model's collapse-check passed and published the same table
    ok = provoked.results["baseline"]["artifacts"]
    assert any(r["status"] == "passed" for r in table(ok["collapse-check-candidates"]))


def test_export_of_an_unsupported_operator_names_the_format_and_the_operator(provoked):
    s = seen(provoked, "export", "export")
    named = "export onnx: operator enntest.twist.default has no ONNX translation"
    assert s.state == "FAILED"
    for record in (s.record, s.mlflow_record):
        assert record["stage_error"]["type"] == "ExportError" and record["stage_error"][
            "message"
        ].startswith(named)
    assert s.run.info.status == "FAILED" and named in s.run.data.tags["enn.error"]
    assert named in json.loads(s.run.data.tags["event.export_failed"])["error"]
    assert f"- stage failed: ExportError: {named}" in s.markdown
    assert not (provoked.project.root / "outputs" / "export").exists()  # nothing half-written


def test_forced_math_attention_reports_the_backend(provoked):
    s = seen(provoked, "attention", "distributed-train")
    assert s.state == "COMPLETED"
    for record in (s.record, s.mlflow_record):
        assert record["choices"]["attention"] == "math"
        assert record["choices"]["attention_reason"].startswith("train.attention=math")
    assert s.run.data.params["resolved.runtime.attention"] == "math"
    assert "attention backend math (train.attention=math" in s.markdown
    rows = {r["name"]: r["value"] for r in table(s.artifacts["distributed-train-table"])}
    assert rows["attention"] == "math"
    auto = seen(provoked, "nan", "distributed-train")  # left to choose, it says it chose
    assert auto.record["choices"]["attention_reason"].startswith("auto:")
