"""`dvc exp show --only-changed`, as the README gave it, was 859 characters wide right after
the Quick start (every code and output hash differs until dvc.lock is committed); the --drop
that made it readable sat in the middle of a table cell. The command docs/getting-started.md
gives (in a code block of its own) drops
every code and output column of dvc.yaml and keeps the metrics and parameters (measured on a
tiny project after `enn run` and `dvc exp run`: 866 columns without it, 91 with it)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def _command() -> list[str]:
    page = (ROOT / "docs" / "getting-started.md").read_text()
    found = re.findall(r"^(\.venv/bin/dvc exp show --only-changed.*)$", page, re.M)
    assert found, "docs/getting-started.md gives no `.venv/bin/dvc exp show --only-changed` line"
    return shlex.split(found[0])


def test_the_documented_exp_show_drops_every_code_and_output_column_and_no_result():
    argv = _command()
    drop = re.compile("|".join(argv[i + 1] for i, a in enumerate(argv) if a == "--drop"))
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"].values()
    paths, metrics = set(), set()
    for stage in stages:
        for key in ("deps", "outs"):
            for item in stage.get(key) or []:
                path = item if isinstance(item, str) else next(iter(item))
                paths.add(path.replace("${data.path}", params["data"]["path"]))
        for item in stage.get("metrics") or []:
            metrics.add(item if isinstance(item, str) else next(iter(item)))
    kept = [p for p in paths if not drop.match(p)]
    assert not kept, f"columns the documented command keeps (hash columns): {kept}"
    # the results and the parameters stay: DVC names them by their keys
    names = ["val/mae", "test/mae", "train/epochs_run", "train.lr", "model.d_model"]
    assert not [n for n in names if drop.match(n)], argv
    assert {"outputs/metrics/validate.json"} <= metrics  # where val/mae and test/mae come from
