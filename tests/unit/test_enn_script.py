"""scripts/enn, what dvc.yaml's commands run without an activated environment: the checkout's
.venv/bin/enn, also from the copy `dvc exp run --temp` runs in (`.dvc/tmp/exps/<name>/`, no
.venv there), else the `enn` on PATH, else a one-line error."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from tests.fixtures.project import ROOT

SCRIPT = ROOT / "scripts" / "enn"
BARE = {"PATH": "/usr/bin:/bin"}  # no environment activated


def _fake_enn(path: Path, name: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\necho "{name} enn $*"\n')
    path.chmod(0o755)


def _script_in(root: Path) -> Path:
    dst = root / "scripts" / "enn"
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(SCRIPT, dst)
    return dst


def _run(script: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(script), "stage-data"],
        cwd=script.parent.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_a_temp_experiment_runs_the_checkouts_enn(tmp_path):
    checkout = tmp_path / "proj"
    _fake_enn(checkout / ".venv" / "bin" / "enn", "checkout's")
    temp = _script_in(checkout / ".dvc" / "tmp" / "exps" / "tmp8f3k2a")
    out = _run(temp, BARE)
    assert (out.returncode, out.stdout) == (0, "checkout's enn stage-data\n"), out.stderr
    # a copy with a .venv of its own uses that one
    _fake_enn(temp.parent.parent / ".venv" / "bin" / "enn", "copy's")
    assert _run(temp, BARE).stdout == "copy's enn stage-data\n"
    # the checkout itself
    assert _run(_script_in(checkout), BARE).stdout == "checkout's enn stage-data\n"


def test_without_a_venv_the_enn_on_path_else_one_error_line(tmp_path):
    script = _script_in(tmp_path / "proj" / ".dvc" / "tmp" / "exps" / "tmp1")
    _fake_enn(tmp_path / "bin" / "enn", "PATH's")
    out = _run(script, {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin"})
    assert out.stdout == "PATH's enn stage-data\n", out.stderr
    out = _run(script, BARE)
    assert out.returncode == 127
    assert out.stderr == (
        f"error: no enn: run 'bash scripts/setup.sh' in {tmp_path / 'proj'} "
        "(or install the project with pip)\n"
    )
