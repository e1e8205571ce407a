"""The `enn` command line (flows/cli.py): help for every subcommand, config errors from the
console script, the exit codes listed once and shown in the README."""

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
        "did you mean 'train.epochs'?"
    ]


def test_exit_codes_are_listed_once_and_the_readme_shows_them():
    from enn_core.errors import exit_codes
    from flows.cli import build_parser

    codes = exit_codes()
    assert {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 75, 130, 143} == set(codes)
    readme = (ROOT / "README.md").read_text()
    for code, meaning in codes.items():
        assert f"| {code} | {meaning.replace('|', '/')} |" in readme, code
    epilog = build_parser().epilog or ""
    assert all(f"{code:>3}  {meaning}" in epilog for code, meaning in codes.items())


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
