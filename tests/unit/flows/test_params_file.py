"""What `--set` does to config files (flows/params_file.py), through the `enn` command:

- a `--config` file is never written: the value is that run's (its config.yaml holds it);
- the pipeline's params.yaml gets only the keys whose value changes, every other byte kept
  (a hand-written file: aligned comments, an indented list, a long line);
- a path inside the project is recorded relative to the pipeline's folder, one outside is
  kept out of the tracked file (the run is its own, DVC stays out of it), with the reason.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from tests.fixtures.cli import enn
from tests.fixtures.project import ROOT

# params.yaml as a person edits it: a comment aligned by hand, a list indented under its key
# (as configs/expressway.yaml writes its folds), a line longer than ruamel's width
HAND_EDITS = {
    "  val_fold: -1\n": "  val_fold: -1          # validation: a seeded share of the rows\n",
    "  enqueue: []\n": (
        "  enqueue:\n"
        "    - {train.lr: 0.01, train.weight_decay: 0.01, model.d_model: 32}\n"
        "    - {train.lr: 0.003, train.weight_decay: 0.001, model.d_model: 16}\n"
    ),
    "  enabled: true\n": "  enabled: false   # no MLflow in this test\n",
    "  progress: true\n": "  progress: false\n",
}


def hand_written(text: str) -> str:
    for old, new in HAND_EDITS.items():
        assert old in text, old
        text = text.replace(old, new, 1)
    return text


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A checkout: params.yaml (hand-edited), dvc.yaml, configs/overlay.yaml (the same values,
    as another config file) and the prediction pipeline's folder."""
    root = tmp_path / "proj"
    (root / ".dvc").mkdir(parents=True)
    (root / "dvc.yaml").write_text("stages: {}\n")
    text = hand_written((ROOT / "params.yaml").read_text())
    text = text.replace("  path: enn_core/data/synthetic.py\n", "  path: ''\n", 1)
    (root / "params.yaml").write_text(text)
    (root / "configs").mkdir()
    (root / "configs" / "overlay.yaml").write_text(text)
    (root / "prediction" / ".dvc").mkdir(parents=True)  # its own DVC project, as the real one
    shutil.copy(ROOT / "prediction" / "dvc.yaml", root / "prediction" / "dvc.yaml")
    shutil.copy(ROOT / "prediction" / "params.yaml", root / "prediction" / "params.yaml")
    return root


def changed_lines(before: str, after: str) -> list[tuple[str, str]]:
    old, new = before.splitlines(keepends=True), after.splitlines(keepends=True)
    assert len(old) == len(new), "lines were added or removed"
    return [(a, b) for a, b in zip(old, new, strict=True) if a != b]


def staged_params(root: Path) -> dict:
    return json.loads((root / "outputs" / "stage-data" / "params.json").read_text())


def test_set_never_writes_a_config_file(project, capsys):
    """`enn <stage> --config configs/x.yaml --set k=v` used to rewrite the file (tracked in
    git: the next MLflow commit tag read "dirty") and re-indent lines it did not change."""
    overlay = project / "configs" / "overlay.yaml"
    before, params = overlay.read_bytes(), (project / "params.yaml").read_bytes()
    code, err = enn(
        project, "stage-data", "--config", "configs/overlay.yaml", "--set", "data.split_seed=3"
    )
    assert code == 0, err
    assert overlay.read_bytes() == before and (project / "params.yaml").read_bytes() == params
    out = capsys.readouterr().out
    assert "params: configs/overlay.yaml unchanged (data.split_seed=3 for this run only)" in out
    assert any("--set never writes overlay.yaml" in line for line in err), err
    assert staged_params(project)["data"]["split_seed"] == 3  # the run used it
    (resolved,) = (project / "work" / "runs").glob("*/stage-data/config.yaml")
    assert yaml.safe_load(resolved.read_text())["data"]["split_seed"] == 3


def test_set_on_params_yaml_changes_only_the_lines_of_changed_keys(project, capsys):
    params = project / "params.yaml"
    before = params.read_text()
    code, err = enn(
        project,
        "stage-data",
        "--set",
        "data.split_seed=3",
        "--set",
        "data.val_fraction=0.15",  # the file's value: not a change
        "--set",
        "runtime.seed=1",  # how to run: this run only
    )
    assert code == 0, err
    assert changed_lines(before, params.read_text()) == [("  split_seed: 0\n", "  split_seed: 3\n")]
    out = capsys.readouterr().out
    assert (
        "params: params.yaml changed (data.split_seed: 0 -> 3; runtime.seed=1 for this run only)"
        in out
    )
    assert any("runtime.seed=1 for this run only" in line for line in err), err


def test_a_path_outside_the_project_is_kept_out_of_params_yaml(project, tmp_path, capsys):
    """The prediction flow's `--set data.path=` with a file outside the project wrote its
    absolute path into prediction/params.yaml (a tracked file, then true on one machine only)."""
    outside = tmp_path / "elsewhere" / "synthetic.py"
    outside.parent.mkdir()
    shutil.copy(ROOT / "enn_core" / "data" / "synthetic.py", outside)
    params = project / "params.yaml"
    before = params.read_bytes()
    code, err = enn(
        project, "stage-data", "--set", f"data.path={outside}", "--set", "data.split_seed=3"
    )
    assert code == 0, err
    assert params.read_bytes() == before  # nothing of this run's --set: the file describes no run
    # one short line, once (issue 54: about 450 characters with absolute paths, said twice)
    out = capsys.readouterr().out
    said = [line for line in [*err, *out.splitlines()] if "outside the project" in line]
    assert len(said) == 1, said
    assert said[0].startswith("params: params.yaml unchanged (data.path lies outside the project")
    assert "DVC neither skips nor records its stages" in said[0] and len(said[0]) < 150, said
    assert str(outside) not in out + " ".join(err)  # its path is in config.yaml and MLflow
    assert staged_params(project)["data"]["path"] == str(outside)


def test_paths_inside_the_project_are_recorded_relative_to_the_pipeline(project):
    from flows.params_file import record_overrides

    new = project / "data" / "new.csv"
    record_overrides(project / "params.yaml", [f"data.path={new}", f"checkpoint.dir={new.parent}"])
    text = (project / "params.yaml").read_text()
    assert "  path: data/new.csv\n" in text and "  dir: data\n" in text
    prediction = project / "prediction" / "params.yaml"  # its paths resolve from prediction/
    record_overrides(prediction, [f"data.path={new}", f"predict.model={project}/m/model.pt"])
    text = prediction.read_text()
    assert "  path: ../data/new.csv\n" in text and "  model: ../m/model.pt\n" in text


def test_a_path_of_the_repository_is_inside_the_prediction_pipelines_project(project, capsys):
    """`enn run --flow prediction --set data.path=$PWD/data/new.csv` said the file "lies outside
    the project": the root was found by the nearest .dvc/, and prediction/ has its own."""
    from flows.params_file import plan

    new = project / "data" / "new.csv"
    p = plan(project / "prediction" / "params.yaml", [f"data.path={new}"])
    assert p.write == ("data.path=../data/new.csv",) and not p.kept_out and not p.one_off()
    git_home = project.parent  # a home folder kept in git: the DVC project is still its own
    (git_home / ".git").mkdir()
    assert plan(project / "params.yaml", [f"data.path={git_home}/x.csv"]).kept_out


def test_a_stage_of_the_prediction_pipeline_runs_there_from_any_folder(project, capsys):
    """`enn stage-data --pipeline prediction` from the project root read params.yaml and wrote
    outputs/stage-data/ (the training pipeline's); from prediction/ `enn stage-data` did the
    prediction pipeline's work with the training stage."""
    from enn_core.paths import pipeline_params

    pred = project / "prediction" / "params.yaml"
    for where in (project, project / "prediction", project / "configs"):
        assert pipeline_params("prediction", where) == pred
        assert pipeline_params("training", where) == project / "params.yaml"
    code, err = enn(project, "stage-data", "--pipeline", "prediction", "--config", "params.yaml")
    assert code == 2 and "the prediction pipeline's stage-data" in err[-1], err
    assert "is the training pipeline's params.yaml" in err[-1] and len(err) == 1
    assert not (project / "outputs").exists() and not (project / "prediction" / "outputs").exists()


def test_the_plan_says_what_each_set_does(project):
    from flows.params_file import plan

    params, prediction = project / "params.yaml", project / "prediction" / "params.yaml"
    p = plan(params, [f"data.path={project}/d.csv", "checkpoint.dir=work/ck", "runtime.seed=2"])
    assert p.run == ("data.path=d.csv", "checkpoint.dir=work/ck", "runtime.seed=2")
    assert p.write == p.run[:2] and p.once == ("runtime.seed=2",) and not p.one_off()
    kept = plan(prediction, ["data.path=../../elsewhere.csv", "predict.chunk_rows=4"])
    assert kept.kept_out == ("data.path=../../elsewhere.csv",) and not kept.write
    assert "lies outside the project" in kept.one_off()
    refs = plan(prediction, ["predict.model=models:/enn-x@champion"])  # a reference, no path
    assert refs.write == ("predict.model=models:/enn-x@champion",)
    overlay = plan(project / "configs" / "overlay.yaml", ["train.lr=0.02"])
    assert overlay.once == ("train.lr=0.02",) and not overlay.write and not overlay.one_off()


def test_a_run_stopped_before_any_stage_finished_says_the_file_was_restored(project):
    """Ctrl-C during the first stage put params.yaml back, but the closing summary said
    "params: params.yaml changed (train.epochs: 25 -> 200)"."""
    import logging

    from flows.params_file import recorded_overrides

    path = project / "params.yaml"
    before = path.read_bytes()
    with pytest.raises(KeyboardInterrupt):
        with recorded_overrides(path, ["train.epochs=200"], logging.getLogger("t")) as rec:
            assert rec.summary().startswith("params: params.yaml changed (train.epochs:")
            raise KeyboardInterrupt
    assert path.read_bytes() == before and rec.restored
    assert rec.summary() == (
        "params: params.yaml unchanged (restored, no stage finished: train.epochs: "
        f"{yaml.safe_load(before)['train']['epochs']} -> 200 undone)"
    )


def test_the_advice_after_a_stop_says_what_the_same_command_runs_again(project, monkeypatch):
    """After Ctrl-C during validate of an `enn run --config` run the message said finished
    stages are skipped; the same command re-ran stage-data, prepare-checkpoint and trained
    again from epoch 1 (DVC neither skips nor records a --config run; a finished training
    starts over)."""
    from flows.parser import build_parser
    from flows.report import again

    monkeypatch.chdir(project)
    parse = build_parser().parse_args
    said = again(parse(["run", "--config", "configs/overlay.yaml"]))
    assert "runs every stage again" in said and "DVC skips the stages" not in said, said
    assert "else trains from epoch 1" in said
    outside = again(parse(["run", "--set", f"data.path={project.parent}/x.csv"]))
    assert "runs every stage again" in outside and "outside the project" in outside, outside
    own = again(parse(["run", "--set", "train.epochs=3"]))
    assert "DVC skips the stages that finished" in own, own


def test_a_deployments_run_never_writes_a_tracked_file(project):
    """A Prefect deployment run with overrides, picked up by a work-pool worker, rewrote that
    worker's params.yaml ("train.epochs: 25 -> 2"): pooled checkouts drifted from their commit."""
    from flows.params_file import once_lines, record_overrides

    params = project / "params.yaml"
    before = params.read_bytes()
    p, changes = record_overrides(params, ["train.epochs=2", "runtime.seed=1"], deployed=True)
    assert params.read_bytes() == before and changes == []
    assert p.once == ("train.epochs=2", "runtime.seed=1") and "deployment" in p.one_off()
    (line,) = once_lines(p)
    assert "train.epochs=2, runtime.seed=1 for this run only" in line
    assert "DVC neither skips nor records its stages" in line
