"""`enn stage-data` loads no torch (issue 51): staging is numpy and pyarrow; importing torch
for the run's diagnostics record cost the command 1.5 s of CPU (4-5 s on a loaded machine),
counted in its "done in" time, which pandas' read of the same table does not pay."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from tests.fixtures.data import table_rows, write_table_csv

ROOT = Path(__file__).resolve().parents[3]

CHILD = """
import json, sys
from flows.cli import entry
sys.argv = ["enn", "stage-data", "--config", "params.yaml", *json.loads(sys.argv[1])]
try:
    entry()
finally:
    print(json.dumps({"torch": "torch" in sys.modules}))
"""


def test_the_stage_data_command_imports_no_torch(tmp_path):
    header, rows = table_rows(60)
    write_table_csv(tmp_path / "t.csv", rows, header)
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    sets = [
        "tracking.enabled=false",
        "runtime.progress=false",
        "data.source=csv",
        f"data.path={tmp_path / 't.csv'}",
        "data.categorical=[region,month]",
        "data.label_columns=[y0,y1,y2,y3]",
        "data.label_shape=[2,2]",
        "data.naive_keys=[region]",
    ]
    out = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps([f"--set={s}" for s in sets])],
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "stage-data: done in" in out.stdout
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"torch": False}
    # the diagnostics record is still written, from the same modules
    (diag,) = tmp_path.glob("work/runs/*/stage-data/diagnostics.json")
    assert json.loads(diag.read_text())["errors"] == []
