"""The `tabular` preset on public tabular data that installed packages ship (nothing is
downloaded), as a new user brings it: each set written as a CSV with a fold column, fixed
5-fold (rows assigned to folds by a seeded permutation), through the real stages (stage-data ->
prepare-checkpoint -> distributed-train -> validate) with configs/tabular.yaml. The fold column
splits the rows and is not a model input.

Datasets (`--datasets`):
- `diabetes`: scikit-learn's diabetes progression (442 rows, 10 numbers);
- `randhie`: statsmodels' RAND health insurance experiment, outpatient visits `mdvis` (20,190
  rows, 9 numbers; a skewed count label: median 1, mean 2.9, max 77);
- `anes96`: statsmodels' 1996 American National Election Study, party identification `PID`
  (944 rows, 0-6, 9 numbers);
- `grunfeld`: statsmodels' Grunfeld investment data, `invest` (220 rows; the firm a category,
  value, capital and year numbers; skewed: median 52, mean 133). The held-out set: no setting
  was chosen on it.

Per fold it reads validate's metrics: the model's test MAE beside the best naive constant (the
lower test MAE of the training rows' median and mean: the bar is the strictest), RidgeCV on the
same encoded features (validate's `ridge`, absolute or squared error as it chose on the
validation rows) and gradient-boosted trees (`gbt`, likewise; which loss each kept is
printed), all on the same rows. Targets: below the best naive constant in every fold; mean MAE
at most gbt's + 3%.

    OMP_NUM_THREADS=1 .venv/bin/python bench/quality_tabular.py [--datasets diabetes randhie]
        [--seeds 0] [--folds 0 1 2 3 4] [--set key=value]

A script, not a test: it prints the per-fold table and writes --json
(default work/quality_tabular.json), with each fold's validation MAE (what the settings are
chosen on) beside its test MAE.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.quality_expressway import run_one, save_rows, session  # noqa: E402
from enn_core.config import load_config  # noqa: E402
from enn_core.paths import Layout  # noqa: E402
from enn_core.stages import STAGE_DATA, VALIDATE  # noqa: E402
from tasks.runner import execute_stage  # noqa: E402

CONFIG = ROOT / "configs" / "tabular.yaml"  # the preset and its measured train settings
FOLDS = 5
LABEL = "target"


def _diabetes() -> tuple[pd.DataFrame, list[str]]:
    from sklearn.datasets import load_diabetes

    frame = load_diabetes(as_frame=True).frame
    return frame, []


def _statsmodels(name: str, label: str, drop: tuple[str, ...] = ()) -> pd.DataFrame:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import statsmodels.api as sm

        data = getattr(sm.datasets, name).load_pandas().data
    return data.drop(columns=list(drop)).rename(columns={label: LABEL})


def _randhie() -> tuple[pd.DataFrame, list[str]]:
    return _statsmodels("randhie", "mdvis"), []


def _anes96() -> tuple[pd.DataFrame, list[str]]:
    return _statsmodels("anes96", "PID", drop=("popul",)), []  # logpopul is kept


def _grunfeld() -> tuple[pd.DataFrame, list[str]]:
    frame = _statsmodels("grunfeld", "invest")
    frame["firm"] = frame["firm"].astype(str).str.replace(" ", "_")
    return frame, ["firm"]


DATASETS: dict[str, Callable[[], tuple[pd.DataFrame, list[str]]]] = {
    "diabetes": _diabetes,
    "randhie": _randhie,
    "anes96": _anes96,
    "grunfeld": _grunfeld,
}
HELD_OUT = ("grunfeld",)  # no setting was chosen on these


def write_csv(name: str, path: Path) -> tuple[list[str], list[str]]:
    """The dataset as a CSV with a seeded fold column; (feature columns, categorical ones)."""
    frame, categorical = DATASETS[name]()
    frame = frame.rename(columns={"target": LABEL})
    rng = np.random.default_rng(0)
    frame["fold"] = [f"f{k}" for k in rng.permutation(len(frame)) % FOLDS]
    frame.to_csv(path, index=False)
    return [c for c in frame.columns if c not in (LABEL, "fold")], categorical


def fold_config(
    csv: Path, features: list[str], categorical: list[str], fold: int, seed: int, extra: list[str]
):
    folds = "[" + ", ".join(f"[f{k}]" for k in range(FOLDS)) + "]"
    return load_config(
        CONFIG,
        [
            "data.source=csv",
            f"data.path={csv}",
            f"data.feature_columns=[{', '.join(features)}]",
            f"data.label_columns=[{LABEL}]",
            f"data.categorical=[{', '.join(categorical)}]",
            "data.cyclic=[]",
            "data.cyclic_periods=[]",
            "data.cyclic_starts=[]",
            "data.label_axes=[]",
            "data.naive_keys=[]",
            "data.fold_key=fold",
            f"data.folds={folds}",
            f"data.test_fold={fold}",
            f"model.init_seed={seed}",
            f"runtime.seed={seed}",
            "runtime.threads_per_worker=1",
            "runtime.progress=false",
            "tracking.enabled=false",
            *extra,
        ],
    )


def _extra_metrics(layout: Layout) -> dict:
    """What run_one does not read: the naive medians and which loss each fitted baseline kept."""
    out = VALIDATE.output_dir(layout)
    m = json.loads((out / "metrics.json").read_text())
    fits = json.loads((out / "breakdown.json").read_text()).get("baselines", {})
    return {
        "naive_cell_median_mae": m.get("test/naive_cell_median_mae"),
        "val_naive_best_mae": m.get("val/naive_best_mae"),
        "naive_best": m.get("naive_best"),
        **{f"{b}_detail": f.get("detail") for b, f in fits.items()},
        **{f"val_{b}_mae": m.get(f"val/{b}_mae") for b in fits},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--folds", type=int, nargs="+", default=list(range(FOLDS)))
    ap.add_argument("--set", dest="extra", action="append", default=[])
    ap.add_argument("--json", type=Path, default=ROOT / "work" / "quality_tabular.json")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="enn-tabular-"))
    rows: list[dict] = []
    try:
        for name in args.datasets:
            csv = tmp / f"{name}.csv"
            features, categorical = write_csv(name, csv)
            for f in args.folds:
                root = tmp / f"{name}-fold{f}"
                root.mkdir()
                layout = Layout.for_root(root)
                for s in args.seeds:
                    cfg = fold_config(csv, features, categorical, f, s, args.extra)
                    if s == args.seeds[0]:
                        execute_stage(STAGE_DATA, session(layout, cfg, csv, f"fold{f}-data"))
                    row = {"dataset": name, **run_one(layout, cfg, csv, f, s)}
                    row.update(_extra_metrics(layout))
                    rows.append(row)
                    print(
                        f"{name} fold {f} seed {s}: test MAE {row['test_mae']:.4g} (median "
                        f"{row['naive_cell_median_mae']:.4g}, "
                        f"mean {row['naive_cell_mean_mae']:.4g}, "
                        f"ridge {row['ridge_mae']:.4g}, gbt {row['gbt_mae']:.4g}), val MAE "
                        f"{row['val_mae']:.4g}, epochs {row['epochs_run']} (best "
                        f"{row['best_epoch']}), {row['wall_s']:.0f} s",
                        flush=True,
                    )
                    save_rows(args.json, rows)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report(rows)
    return 0


def report(rows: list[dict]) -> None:
    print(
        "\ndataset | fold | seed | model MAE | best constant | ridge | gbt | model / gbt | val MAE"
    )
    for r in rows:
        const = min(r["naive_cell_median_mae"], r["naive_cell_mean_mae"])
        print(
            f"{r['dataset']} | {r['fold']} | {r['seed']} | {r['test_mae']:.4g} | {const:.4g} | "
            f"{r['ridge_mae']:.4g} | {r['gbt_mae']:.4g} | {r['test_mae'] / r['gbt_mae']:.3f} | "
            f"{r['val_mae']:.4g}"
        )
    for name in dict.fromkeys(r["dataset"] for r in rows):
        mine = [r for r in rows if r["dataset"] == name]
        mean = {
            k: float(np.mean([r[k] for r in mine]))
            for k in ("test_mae", "gbt_mae", "ridge_mae", "val_mae")
        }
        beaten = all(
            r["test_mae"] < min(r["naive_cell_median_mae"], r["naive_cell_mean_mae"]) for r in mine
        )
        ratio = mean["test_mae"] / mean["gbt_mae"]
        verdict = "HOLDS" if beaten and ratio <= 1.03 else "FAILS"
        print(
            f"{name}: model {mean['test_mae']:.4g}, ridge {mean['ridge_mae']:.4g}, gbt "
            f"{mean['gbt_mae']:.4g} (model / gbt {ratio:.3f}); below the best constant in every "
            f"fold: {beaten}; validation MAE {mean['val_mae']:.4g} -> {verdict}"
            + (" (held out: no setting chosen on it)" if name in HELD_OUT else "")
        )


if __name__ == "__main__":
    raise SystemExit(main())
