"""Who owns what: DVC decides staleness, Prefect executes, both see the same state.

Runs on a two-stage pipeline (stage-data -> prepare-checkpoint) in a temp git + DVC repo:
real `enn run` flows on Prefect's local API, real `dvc repro`, real `enn <stage>` commands.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml

from tests.fixtures.project import make_project

pytestmark = pytest.mark.timeout(900)
TWO = ("stage-data", "prepare-checkpoint")


def flow(project, *extra: str, check: bool = True):
    out = project.run("enn", "run", "--until", "prepare-checkpoint", *extra, check=check)
    return out, dict(re.findall(r"^(\S+)\s+(ran|skipped)\s", out.stdout, re.M))


def dvc_clean(project) -> bool:
    out = project.run(
        "dvc", "status", "dvc.yaml"
    )  # the training pipeline (prediction/ has its own)
    return "Data and pipelines are up to date" in out.stdout


@pytest.fixture
def two_stage(tmp_path, prefect_home_shared):
    return make_project(tmp_path / "proj", prefect_home_shared, stages=TWO)


def test_flow_then_dvc_is_clean_and_repro_is_noop(two_stage):
    _, status = flow(two_stage)
    assert status == {"stage-data": "ran", "prepare-checkpoint": "ran"}
    assert dvc_clean(two_stage)
    out = two_stage.run("dvc", "repro")
    assert "Data and pipelines are up to date" in out.stdout, out.stdout
    _, again = flow(two_stage)
    assert again == {"stage-data": "skipped", "prepare-checkpoint": "skipped"}


def test_dvc_repro_then_flow_skips_every_stage(two_stage):
    out = two_stage.run("dvc", "repro")
    assert (
        "Running stage 'stage_data'" in out.stdout
        and "Running stage 'prepare_checkpoint'" in out.stdout
    )
    # the stages of one `dvc repro` are grouped under one MLflow parent run
    from tests.e2e.test_tracking import runs

    all_runs = runs(two_stage)
    parents = [r for r in all_runs if r.data.tags.get("enn.kind") == "pipeline"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED", [
        r.info.run_name for r in parents
    ]
    children = [
        r for r in all_runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id
    ]
    assert sorted(r.info.run_name for r in children) == sorted(TWO)
    out, status = flow(two_stage)
    assert status == {"stage-data": "skipped", "prepare-checkpoint": "skipped"}
    # nothing ran: no MLflow parent run copying the last results (issue 32), and it says so
    assert "every stage is up to date (dvc status clean): nothing to run" in out.stderr
    after = [r for r in runs(two_stage) if r.data.tags.get("enn.kind") == "pipeline"]
    assert [r.info.run_id for r in after] == [parents[0].info.run_id]


def test_an_overlay_config_runs_in_the_project_and_dvc_stays_out(two_stage):
    """`enn run --config configs/<file>.yaml --set ...` (an overlay like
    configs/expressway.yaml): the project root stays the repository (outputs/, work/, data
    paths relative to it); DVC, whose dvc.yaml reads params.yaml, neither skips the stages nor
    records the run; and `--set` leaves the tracked file as it was (it used to rewrite it, and
    the run's commit tag read "dirty"): the value is the run's, in its config and MLflow."""
    p = two_stage
    _, first = flow(p)
    assert first == {"stage-data": "ran", "prepare-checkpoint": "ran"} and dvc_clean(p)
    lock = (p.root / "dvc.lock").read_text()
    overlay = yaml.safe_load((p.root / "params.yaml").read_text())
    overlay["data"]["split_seed"] = 7
    (p.root / "configs").mkdir(exist_ok=True)
    (p.root / "configs" / "overlay.yaml").write_text(yaml.safe_dump(overlay))
    p.git_commit("an overlay")
    written = (p.root / "configs" / "overlay.yaml").read_bytes()
    out, status = flow(p, "--config", "configs/overlay.yaml", "--set", "data.test_fraction=0.2")
    # DVC calls both stages up to date for params.yaml; this run is of another file: both run
    assert status == {"stage-data": "ran", "prepare-checkpoint": "ran"}, out.stdout
    assert "is not this pipeline's params.yaml" in out.stdout + out.stderr
    assert (p.root / "configs" / "overlay.yaml").read_bytes() == written
    assert p.run("git", "status", "--porcelain", "--untracked-files=no").stdout == ""
    summary = "params: configs/overlay.yaml unchanged (data.test_fraction=0.2 for this run only)"
    assert summary in out.stdout, out.stdout
    assert not any((p.root / "configs" / d).exists() for d in ("outputs", "work"))
    manifest = json.loads((p.root / "outputs" / "stage-data" / "manifest.json").read_text())
    assert manifest["split_definition"]["seed"] == 7
    staged = json.loads((p.root / "outputs" / "stage-data" / "params.json").read_text())
    assert staged["data"]["test_fraction"] == 0.2
    from tests.e2e.test_tracking import runs

    (parent,) = runs(p, "tags.`enn.kind` = 'pipeline' and params.`data.test_fraction` = '0.2'")
    assert not parent.data.tags["enn.git_commit"].endswith("-dirty"), parent.data.tags
    assert "configs/overlay.yaml unchanged" in parent.data.tags["enn.overrides"]
    assert (p.root / "dvc.lock").read_text() == lock, "a run DVC does not describe is not recorded"
    assert not dvc_clean(p)  # its outputs are not what dvc.lock holds: `dvc repro` restores them
    assert "Running stage 'stage_data'" in p.run("dvc", "repro").stdout and dvc_clean(p)


def test_a_path_outside_the_project_keeps_the_run_out_of_params_and_dvc(two_stage, tmp_path):
    """`--set data.path=<a file outside the project>` wrote its absolute path into the tracked
    params file. Now the file stays as it was, the console says why, and DVC, whose params.yaml
    does not describe this run, neither skips nor records its stages."""
    p = two_stage
    outside = tmp_path / "elsewhere" / "synthetic.py"  # the generator, as data.path names it
    outside.parent.mkdir()
    outside.write_bytes((p.root / "enn_core" / "data" / "synthetic.py").read_bytes())
    out, status = flow(p, "--set", f"data.path={outside}", "--set", "data.split_seed=5")
    assert status == {"stage-data": "ran", "prepare-checkpoint": "ran"}, out.stdout
    assert p.run("git", "status", "--porcelain", "--untracked-files=no").stdout == ""
    assert not (p.root / "dvc.lock").exists(), "DVC recorded a run params.yaml does not describe"
    said = " ".join((out.stdout + out.stderr).split())
    assert "data.path lies outside the project" in said, said[-3000:]
    assert "DVC neither skips nor records its stages" in said
    assert "params: params.yaml unchanged (" in out.stdout
    staged = json.loads((p.root / "outputs" / "stage-data" / "params.json").read_text())
    assert staged["data"]["path"] == str(outside) and staged["data"]["split_seed"] == 5


def test_changes_rerun_exactly_the_dependent_stages(two_stage):
    p = two_stage
    # npy input, so "the data behind an unchanged path" can change
    rng = np.random.default_rng(0)
    np.save(p.root / "x.npy", rng.normal(size=(64, 3)).astype(np.float32))
    np.save(p.root / "y.npy", rng.normal(size=(64, 4)).astype(np.float32))
    p.set_params(
        [
            "data.source=npy",
            "data.path=x.npy",
            "data.labels_path=y.npy",
            "data.categorical=[]",
            "data.cyclic=[]",
            "data.cyclic_periods=[]",
            "data.cyclic_starts=[]",
            "data.label_axes=[]",
            "data.naive_keys=[]",
            "model.preset=tabular",
        ]
    )
    _, first = flow(p)
    assert first == {"stage-data": "ran", "prepare-checkpoint": "ran"}

    # a param of the model section: only prepare-checkpoint
    _, status = flow(p, "--set", "model.d_model=32")
    assert status == {"stage-data": "skipped", "prepare-checkpoint": "ran"}

    # enn_core code that only prepare-checkpoint runs
    with open(p.root / "enn_core" / "init_checkpoint.py", "a") as f:
        f.write("\n# a code change\n")
    _, status = flow(p)
    assert status == {"stage-data": "skipped", "prepare-checkpoint": "ran"}

    # the data behind the unchanged path x.npy: both
    np.save(p.root / "x.npy", rng.normal(size=(64, 3)).astype(np.float32))
    _, status = flow(p)
    assert status == {"stage-data": "ran", "prepare-checkpoint": "ran"}
    assert dvc_clean(p)


def test_two_pipeline_runs_never_interleave(two_stage):
    p = two_stage
    first = subprocess.Popen(
        [
            "enn",
            "stage-data",
            "--set",
            "fault.kind=delay",
            "--set",
            "fault.phase=stage-data",
            "--set",
            "fault.seconds=30",
        ],
        cwd=p.root,
        env=p.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lock = p.root / "work" / "pipeline.lock"
        deadline = time.time() + 60
        while time.time() < deadline and not (lock.exists() and lock.read_text().strip()):
            time.sleep(0.2)
        second = p.run("enn", "run", "--until", "prepare-checkpoint", check=False)
        assert second.returncode == 8, second.stderr[-2000:]
        assert "another pipeline run holds this work directory" in second.stderr
        assert f"pid {first.pid}" in second.stderr
        stage = p.run("enn", "prepare-checkpoint", check=False)
        assert stage.returncode == 8
    finally:
        first.kill()
        first.wait(timeout=30)
    assert sys.platform.startswith("linux")
