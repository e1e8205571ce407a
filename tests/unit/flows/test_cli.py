"""The `enn` command line (flows/cli.py): help for every subcommand, config errors from the
console script, the exit codes listed once and shown in docs/getting-started.md."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.project import ROOT, clean_env


def test_cli_help_for_every_subcommand(capsys):
    from enn_core.stages import TRAINING
    from flows.cli import main

    for cmd in (*(s.name for s in TRAINING), "run"):
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0
        text = capsys.readouterr().out
        assert "--set KEY=VALUE" in text and "--config" in text, cmd
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "stage-data" in capsys.readouterr().out


@pytest.mark.timeout(60)
def test_console_script_reports_config_errors(tmp_path):
    (tmp_path / "params.yaml").write_text("train:\n  epoch: 3\n")
    enn = Path(sys.executable).parent / "enn"
    out = subprocess.run(
        [str(enn), "stage-data"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=55,
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert lines == [
        f"error: {tmp_path / 'params.yaml'}: unknown config key 'train.epoch'; "
        "did you mean 'train.epochs'? (docs/config.md)"
    ]


def test_exit_codes_are_listed_once_and_the_docs_show_them():
    from enn_core.errors import exit_codes
    from flows.cli import build_parser

    codes = exit_codes()
    assert {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 75, 130, 143} == set(codes)
    page = (ROOT / "docs" / "getting-started.md").read_text()
    for code, meaning in codes.items():
        assert f"\n- `{code}`: {meaning}\n" in page, code
    epilog = " ".join((build_parser().epilog or "").split())  # entries wrap at 100 columns
    assert all(f"{code} {' '.join(meaning.split())}" in epilog for code, meaning in codes.items())


def test_ui_help_names_both_uis(capsys):
    from flows.cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    listed = re.search(r"^\s+ui\s+(.*(?:\n\s{6,}.*)*)", capsys.readouterr().out, re.M)
    assert listed and "MLflow UI" in listed.group(1) and "Prefect UI" in listed.group(1)
    with pytest.raises(SystemExit):
        main(["ui", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "The MLflow UI" in text and "the Prefect UI" in text and "Ctrl-C stops both" in text


def test_a_stages_help_says_what_it_reads_and_writes_from_its_spec(capsys):
    """Issue 32: `enn <stage> --help` listed only --config, --set and -v."""
    from enn_core.stages import TRAINING
    from flows.cli import main

    for spec in TRAINING:
        with pytest.raises(SystemExit):
            main([spec.name, "--help"])
        text = capsys.readouterr().out
        writes = f"writes: outputs/{spec.name}/ ({', '.join(spec.outputs)})"
        assert writes in text and "reads: " in text, text
        for upstream in spec.inputs:
            assert f"outputs/{upstream.name}/" in text.split("reads: ")[1], (spec.name, text)
    with pytest.raises(SystemExit):
        main(["validate", "--help"])
    text = capsys.readouterr().out
    assert (
        "reads: params.yaml (section validate); outputs/stage-data/, outputs/distributed-train/"
        in text
    )
    assert "outputs/metrics/validate.json (dvc metrics)" in text


def test_a_stopped_run_says_that_running_it_again_resumes():
    import argparse

    from flows.report import again

    for argv in (["run"], ["distributed-train"]):
        assert "run the same command again to resume" in again(argparse.Namespace(command=argv[0]))
    assert "resume the study" in again(argparse.Namespace(command="tune"))
    assert again(argparse.Namespace(command="ui")) == ""  # Ctrl-C is how a server stops


def _enn(cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    enn = Path(sys.executable).parent / "enn"
    return subprocess.run(
        [str(enn), *argv], cwd=cwd, capture_output=True, text=True, env=clean_env(), timeout=55
    )


@pytest.mark.timeout(120)
def test_flow_both_refuses_what_one_process_cannot_run_before_anything_starts(tmp_path):
    """`enn run --flow both` (training, then prediction, in one process): `--until` (which
    flow's stage?) and a prediction pipeline whose work directory is not the training run's
    are one line each, exit 2, before the lock or a Prefect API."""
    (tmp_path / "params.yaml").write_text("train:\n  epochs: 3\n")
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    (tmp_path / "prediction").mkdir()
    (tmp_path / "prediction" / "dvc.yaml").write_text("stages: {}\n")
    pred = tmp_path / "prediction" / "params.yaml"
    pred.write_text("runtime:\n  work_dir: ../work\n")

    out = _enn(tmp_path, "run", "--flow", "both", "--until", "validate")
    assert out.returncode == 2, out
    assert out.stderr.strip().splitlines() == [
        "error: --until validate with --flow both: --until stops one flow; run "
        "`enn run --until STAGE` or `enn run --flow prediction --until STAGE` "
        "(docs/getting-started.md)"
    ]

    # the prediction must find what this training registers: the same registered model
    out = _enn(tmp_path, "run", "--flow", "both", "--set", "tracking.registered_model=mine")
    assert out.returncode == 2, out
    assert out.stderr.strip().splitlines() == [
        "error: --flow both: tracking.registered_model is 'mine' for the training run and '' in "
        f"{pred}; make them agree, or run `enn run`, then `enn run --flow prediction` "
        "(docs/config.md)"
    ]

    pred.write_text("runtime:\n  work_dir: work\n")  # prediction/work: another store
    out = _enn(tmp_path, "run", "--flow", "both")
    assert out.returncode == 2, out
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith(
        f"error: --flow both: runtime.work_dir is '{tmp_path}/work' for the training run and "
        f"'{tmp_path}/prediction/work' in {pred}"
    ), line
    assert not (tmp_path / "work" / "pipeline.lock").exists()
    assert not list((tmp_path / "work" / "logs").glob("*-api.log"))


def test_sigterm_says_what_it_stopped():
    """A server command (`enn ui`, `enn deploy`, `enn serve`) holds servers, not workers or the
    pipeline lock: its SIGTERM line says so; a pipeline command's names its workers and lock."""
    import argparse

    from flows.cli import terminated

    for command in ("ui", "deploy", "serve"):
        line = terminated(argparse.Namespace(command=command))
        assert line == "terminated (SIGTERM): its servers stopped", line
    line = terminated(argparse.Namespace(command="validate"))
    assert line == "terminated (SIGTERM): workers stopped, lock released", line
