"""A screen that needs no training: what could a network add to the neighbour prior on a block
of training months it never saw? (issue 34, docs/design.md "Model quality")

For each outer fold of configs/expressway.yaml (test months 01-03, ..., 10-12), the outer
fold's months are removed from a copy of the workbook (the test months are never read) and the
block after it (months 04-06 for fold 0, ..., 01-03 for fold 3) is held out as an inner test;
the model is built on the other six months as prepare-checkpoint builds it, and the prior is
evaluated on its own rows (each leaving its own month out, as in training) and on the held-out
block. Printed, mean over the four blocks:

- the prior alone;
- the prior plus a correction a month-blind network could learn from the training rows: the
  median (or mean) of the prior's leave-one-month-out residual per day type, direction and
  cell (per cell only; shrunk by 0.5); the best such correction bounds what learning the
  prior's residual without the month can add.

    OMP_NUM_THREADS=1 .venv/bin/python bench/prior_screen.py [--set model.prior_width=1.5 ...]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.quality_expressway import session  # noqa: E402
from enn_core.config import load_config  # noqa: E402
from enn_core.data.dataset import StagedDataset  # noqa: E402
from enn_core.model.enn import build_model  # noqa: E402
from enn_core.paths import Layout  # noqa: E402
from enn_core.stages import STAGE_DATA  # noqa: E402
from tasks.runner import execute_stage  # noqa: E402

CONFIG = ROOT / "configs" / "expressway.yaml"
BLOCKS = [["01", "02", "03"], ["04", "05", "06"], ["07", "08", "09"], ["10", "11", "12"]]


def without_months(src: Path, dest: Path, months: list[str]) -> Path:
    """A copy of the workbook without the sheets of `months` (sheet names start `MM월`)."""
    import openpyxl

    wb = openpyxl.load_workbook(src)
    for name in list(wb.sheetnames):
        if name[:2] in months and name[2:3] == "월":
            del wb[name]
    wb.save(dest)
    return dest


def inner_config(workbook: Path, outer: int, extra: list[str]):
    """Folds: the three blocks left; test: the block after the outer fold."""
    blocks = [b for i, b in enumerate(BLOCKS) if i != outer]
    inner = BLOCKS[(outer + 1) % 4]
    folds = "[" + ", ".join("[" + ", ".join(f'"{m}"' for m in b) + "]" for b in blocks) + "]"
    return load_config(
        CONFIG,
        [
            f"data.path={workbook}",
            f"data.folds={folds}",
            f"data.test_fold={blocks.index(inner)}",
            "runtime.progress=false",
            "tracking.enabled=false",
            *extra,
        ],
    )


def screen(root: Path, outer: int, extra: list[str], workbook: Path) -> dict[str, float]:
    cfg = inner_config(workbook, outer, extra)
    layout = Layout.for_root(root)
    execute_stage(STAGE_DATA, session(layout, cfg, CONFIG, f"outer{outer}-data"))
    staged = STAGE_DATA.output_dir(layout)
    ds = StagedDataset(staged)
    model = build_model(cfg.model, ds.manifest.model_data(), data_dir=staged).eval()
    assert model.prior is not None, "set model.prior_weight > 0"
    own = np.sort(np.concatenate([ds.split("train"), ds.split("val")]))
    test = np.asarray(ds.split("test"))
    with torch.no_grad():
        p_own = model.prior(torch.as_tensor(np.asarray(ds.features[own]))).numpy()
        p_test = model.prior(torch.as_tensor(np.asarray(ds.features[test]))).numpy()
    y_own, y_test = np.asarray(ds.targets[own]), np.asarray(ds.targets[test])
    keys = ds.row_keys
    k_own = [tuple(r) for r in keys.iloc[own][["daytype", "direction"]].to_numpy()]
    k_test = [tuple(r) for r in keys.iloc[test][["daytype", "direction"]].to_numpy()]
    resid = y_own - p_own
    out = {"prior": float(np.abs(p_test - y_test).mean())}
    for stat in ("median", "mean"):
        f = np.median if stat == "median" else np.mean
        cell = f(resid, axis=0)
        groups = {k: f(resid[[i for i, g in enumerate(k_own) if g == k]], axis=0) for k in k_own}
        by_key = np.stack([groups.get(k, cell) for k in k_test])
        for shrink in (1.0, 0.5):
            out[f"+{stat} per key x{shrink}"] = float(
                np.abs(p_test + shrink * by_key - y_test).mean()
            )
            out[f"+{stat} per cell x{shrink}"] = float(
                np.abs(p_test + shrink * cell - y_test).mean()
            )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", dest="extra", action="append", default=[])
    ap.add_argument("--outer", type=int, nargs="+", default=[0, 1, 2, 3])
    args = ap.parse_args(argv)
    cfg = load_config(CONFIG)
    src = Layout.for_root(ROOT).resolve(cfg.data.path)
    tmp = Path(tempfile.mkdtemp(prefix="enn-prior-screen-"))
    rows = []
    try:
        for k in args.outer:
            wb = without_months(Path(src), tmp / f"outer{k}.xlsx", BLOCKS[k])
            (tmp / f"o{k}").mkdir()
            r = screen(tmp / f"o{k}", k, args.extra, wb)
            rows.append(r)
            print(f"outer {k}: " + ", ".join(f"{n} {v:.3f}" for n, v in r.items()), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("mean over blocks: ")
    for name in rows[0]:
        print(f"  {name:26s} {np.mean([r[name] for r in rows]):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
