"""The `tabular` preset on tabular data where a linear model is strong, as a new user brings it:
scikit-learn's diabetes set (442 rows, 10 numeric features; shipped inside scikit-learn,
nothing is downloaded) written as a CSV with a fold column, fixed 5-fold (rows assigned to
folds by a seeded permutation), through the real stages (stage-data -> prepare-checkpoint ->
distributed-train -> validate) with configs/tabular.yaml. The fold column splits the rows and
is not a model input.

Per fold it reads validate's metrics: the model's test MAE beside RidgeCV on the same encoded
features (validate's `ridge`), gradient-boosted trees (`gbt`) and the per-cell mean, all on
the same rows. The target: mean MAE at most ridge's plus 1%.

    OMP_NUM_THREADS=1 .venv/bin/python bench/quality_tabular.py [--seeds 0] [--set key=value]

A script, not a test: it prints the per-fold table and writes --json
(default work/quality_tabular.json).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.quality_expressway import run_one, session  # noqa: E402
from enn_core.config import load_config  # noqa: E402
from enn_core.paths import Layout  # noqa: E402
from enn_core.stages import STAGE_DATA  # noqa: E402
from tasks.runner import execute_stage  # noqa: E402

CONFIG = ROOT / "configs" / "tabular.yaml"  # the preset and its measured train settings
FOLDS = 5
FEATURES = ("age", "sex", "bmi", "bp", "s1", "s2", "s3", "s4", "s5", "s6")


def write_csv(path: Path) -> None:
    from sklearn.datasets import load_diabetes

    frame = load_diabetes(as_frame=True).frame
    rng = np.random.default_rng(0)
    frame["fold"] = [f"f{k}" for k in rng.permutation(len(frame)) % FOLDS]
    frame.to_csv(path, index=False)


def fold_config(csv: Path, fold: int, seed: int, extra: list[str]):
    folds = "[" + ", ".join(f"[f{k}]" for k in range(FOLDS)) + "]"
    return load_config(
        CONFIG,
        [
            "data.source=csv",
            f"data.path={csv}",
            f"data.feature_columns=[{', '.join(FEATURES)}]",
            "data.label_columns=[target]",
            "data.categorical=[]",
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--folds", type=int, nargs="+", default=list(range(FOLDS)))
    ap.add_argument("--set", dest="extra", action="append", default=[])
    ap.add_argument("--json", type=Path, default=ROOT / "work" / "quality_tabular.json")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="enn-tabular-"))
    rows: list[dict] = []
    try:
        csv = tmp / "diabetes.csv"
        write_csv(csv)
        for f in args.folds:
            root = tmp / f"fold{f}"
            root.mkdir()
            layout = Layout.for_root(root)
            for s in args.seeds:
                cfg = fold_config(csv, f, s, args.extra)
                if s == args.seeds[0]:
                    execute_stage(STAGE_DATA, session(layout, cfg, csv, f"fold{f}-data"))
                row = run_one(layout, cfg, csv, f, s)
                rows.append(row)
                print(
                    f"fold {f} seed {s}: test MAE {row['test_mae']:.2f} (ridge "
                    f"{row['ridge_mae']:.2f}, gbt {row['gbt_mae']:.2f}, mean "
                    f"{row['naive_cell_mean_mae']:.2f}), epochs {row['epochs_run']} "
                    f"(best {row['best_epoch']}), {row['wall_s']:.0f} s",
                    flush=True,
                )
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(rows, indent=1, default=str))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("\nfold | seed | model MAE | ridge MAE | gbt MAE | mean | model / ridge")
    for r in rows:
        ratio = r["test_mae"] / r["ridge_mae"]
        print(
            f"{r['fold']:4d} | {r['seed']:4d} | {r['test_mae']:9.2f} | {r['ridge_mae']:9.2f} | "
            f"{r['gbt_mae']:7.2f} | {r['naive_cell_mean_mae']:6.2f} | {ratio:6.3f}"
        )
    model = float(np.mean([r["test_mae"] for r in rows]))
    ridge = float(np.mean([r["ridge_mae"] for r in rows]))
    gbt = float(np.mean([r["gbt_mae"] for r in rows]))
    verdict = "HOLDS" if model <= 1.01 * ridge else "FAILS"
    print(
        f"mean: model {model:.2f}, ridge {ridge:.2f}, gbt {gbt:.2f}; model <= ridge + 1%: "
        f"{verdict} (ratio {model / ridge:.3f})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
