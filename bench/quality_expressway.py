"""Issue 4, "Quality on the real data": the spatiotemporal preset against the naive predictors
on the expressway workbook with month folds, THROUGH THE PIPELINE (not a scratch loop).

For each fold (data.test_fold) and seed (model.init_seed = runtime.seed), in a temporary
project directory per fold, it runs the real stage functions through tasks.runner.execute_stage:
stage-data once per fold, then prepare-checkpoint -> distributed-train -> validate per seed.
It reads outputs/validate/metrics.json (test/mae, test/naive_conditional_mae,
test/naive_cell_mean_mae) and computes the collapse measure (enn_core.baselines.collapse_stats)
on the model's test predictions. One training at a time; run it with OMP_NUM_THREADS=1.

    OMP_NUM_THREADS=1 .venv/bin/python bench/quality_expressway.py \
        [--config configs/expressway.yaml] [--folds 0 1 2 3] [--seeds 0 1 2] [--order seed-major]

It is a script, not a test: it prints the per-fold table, each seed's mean and verdict, and
writes the raw results to --json (default work/quality_expressway.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from enn_core.baselines import collapse_stats  # noqa: E402
from enn_core.checkpoint import load_model  # noqa: E402
from enn_core.config import load_config  # noqa: E402
from enn_core.data.dataset import StagedDataset  # noqa: E402
from enn_core.inference import predict_rows  # noqa: E402
from enn_core.paths import Layout  # noqa: E402
from enn_core.stages import (  # noqa: E402
    DISTRIBUTED_TRAIN,
    PREPARE_CHECKPOINT,
    STAGE_DATA,
    VALIDATE,
)
from tasks.runner import PipelineSession, execute_stage  # noqa: E402

TRAIN_STAGES = (PREPARE_CHECKPOINT, DISTRIBUTED_TRAIN, VALIDATE)
FITTED = ("ridge", "gbt")  # validate's fitted baselines (validate.baselines)


def fold_config(config: Path, fold: int, seed: int, extra: list[str]):
    """The run config for one fold and seed; data.path made absolute from the real project root."""
    base = load_config(config)
    data_path = Layout.for_root(ROOT).resolve(base.data.path)
    overrides = [
        f"data.path={data_path}",
        f"data.test_fold={fold}",
        f"model.init_seed={seed}",
        f"runtime.seed={seed}",
        "runtime.threads_per_worker=1",
        "runtime.progress=false",
        "tracking.enabled=false",
        *extra,
    ]
    return load_config(config, overrides)


def parts_mae(layout: Layout, cfg) -> dict:
    """Test MAE of the blend's parts from the same trained model: the network alone and the
    prior alone (empty without a prior)."""
    ds = StagedDataset(STAGE_DATA.output_dir(layout))
    model, _ = load_model(DISTRIBUTED_TRAIN.output_dir(layout) / "model.pt")
    model.eval()
    if model.prior is None:
        return {}
    rows = np.asarray(ds.split("test"))
    target = np.asarray(ds.labels[rows], dtype=np.float64)
    prior = model.prior
    network = lambda x: model.denormalize(model.trunk(model.encoder(x)))  # noqa: E731
    return {
        f"{name}_mae": float(
            np.abs(predict_rows(fn, ds.features, rows, cfg.predict.forward_rows) - target).mean()
        )
        for name, fn in (("network", network), ("prior", prior))
    }


def test_collapse(layout: Layout, cfg, save: Path | None = None) -> dict:
    """Collapse measure of the trained model's test predictions (real units); with `save`, the
    test and validation rows' raw features, labels and predictions go to that .npz."""
    ds = StagedDataset(STAGE_DATA.output_dir(layout))
    model, _ = load_model(DISTRIBUTED_TRAIN.output_dir(layout) / "model.pt")
    model.eval()
    rows = np.asarray(ds.split("test"))
    pred = predict_rows(model.predict, ds.features, rows, cfg.predict.forward_rows)
    if save is not None:
        val = np.asarray(ds.split("val"))
        save.parent.mkdir(parents=True, exist_ok=True)
        np.savez(
            save,
            test_features=np.asarray(ds.features[rows]),
            test_labels=np.asarray(ds.labels[rows]),
            test_pred=pred,
            val_features=np.asarray(ds.features[val]),
            val_labels=np.asarray(ds.labels[val]),
            val_pred=predict_rows(model.predict, ds.features, val, cfg.predict.forward_rows),
        )
    return collapse_stats(
        pred, np.asarray(ds.labels[rows]), cfg.collapse.median_ratio_min, cfg.collapse.p10_ratio_min
    )


# The kernel smoother issue 20 quotes (what a practitioner writes in twenty lines): Gaussian
# weights over the circular month distance (sigma 2 months), the same day type at weight 1 and
# the other day types of its kind at 0.2, the same direction only. Its sigma and 0.2 were tuned
# on the held-out months themselves, so its figure is optimistic. Day types as the workbook's
# sheets spell them: Sunday, Monday-Thursday (weekdays), Friday, Saturday.
DAY_KIND = {"일": "sun", "월": "weekday", "화": "weekday", "수": "weekday", "목": "weekday"}
DAY_KIND |= {"금": "fri", "토": "sat"}
SMOOTHER_SIGMA, SMOOTHER_POOL = 2.0, 0.2


def kernel_smoother_mae(layout: Layout) -> float:
    """Held-out MAE of the kernel smoother fitted on every row of the training months
    (train and validation splits), on the staged test rows."""
    ds = StagedDataset(STAGE_DATA.output_dir(layout))
    keys = ds.row_keys
    month = keys["month"].astype(int).to_numpy()
    day, way = keys["daytype"].to_numpy(), keys["direction"].to_numpy()
    labels = np.asarray(ds.labels, dtype=np.float64)
    fit = np.concatenate([np.asarray(ds.split("train")), np.asarray(ds.split("val"))])
    errors = []
    for row in np.asarray(ds.split("test")):
        gap = np.abs(month[fit] - month[row]) % 12
        gap = np.minimum(gap, 12 - gap)
        same_kind = np.array([DAY_KIND[d] == DAY_KIND[day[row]] for d in day[fit]])
        w_day = np.where(day[fit] == day[row], 1.0, np.where(same_kind, SMOOTHER_POOL, 0.0))
        w = np.exp(-(gap**2) / (2 * SMOOTHER_SIGMA**2)) * w_day * (way[fit] == way[row])
        pred = np.tensordot(w / w.sum(), labels[fit], axes=1)
        errors.append(np.abs(pred - labels[row]).mean())
    return float(np.mean(errors))


def session(layout: Layout, cfg, config: Path, run_id: str) -> PipelineSession:
    return PipelineSession(cfg, config, layout, run_id, tracker=None)


def run_one(
    layout: Layout, cfg, config: Path, fold: int, seed: int, save_dir: Path | None = None
) -> dict:
    """prepare-checkpoint -> distributed-train -> validate for one seed; the row of the table."""
    run = session(layout, cfg, config, f"fold{fold}-seed{seed}")
    t0 = time.perf_counter()
    for spec in TRAIN_STAGES:
        execute_stage(spec, run)
    wall = time.perf_counter() - t0
    metrics = json.loads((VALIDATE.output_dir(layout) / "metrics.json").read_text())
    record = json.loads((DISTRIBUTED_TRAIN.output_dir(layout) / "record.json").read_text())
    return {
        "fold": fold,
        "seed": seed,
        "wall_s": wall,
        "test_mae": metrics["test/mae"],
        "val_mae": metrics.get("val/mae"),
        "naive_conditional_mae": metrics.get("test/naive_conditional_mae"),
        "naive_cell_mean_mae": metrics["test/naive_cell_mean_mae"],
        "naive_conditional_median_mae": metrics.get("test/naive_conditional_median_mae"),
        "naive_cell_median_mae": metrics.get("test/naive_cell_median_mae"),
        "naive_best_mae": metrics.get("test/naive_best_mae"),
        "naive_best": metrics.get("naive_best"),
        **parts_mae(layout, cfg),
        **{f"{b}_mae": metrics.get(f"test/{b}_mae") for b in FITTED},
        "collapse": test_collapse(
            layout, cfg, save_dir / f"fold{fold}-seed{seed}.npz" if save_dir else None
        ),
        "epochs_run": record.get("epochs_run"),
        "best_epoch": record.get("best_epoch"),
        "stopped_early": record.get("stopped_early"),
        "model": cfg.model.preset,
    }


def report(rows: list[dict], folds: list[int], seeds: list[int], command: str) -> None:
    by = {(r["fold"], r["seed"]): r for r in rows}
    head = (
        "fold | "
        + " | ".join(f"model s{s}" for s in seeds)
        + " | cond. naive | cell mean |    ridge |      gbt | smoother"
    )
    print("\n" + head + "\n" + "-" * len(head))
    naive: dict[int, float] = {}
    for f in folds:
        cells = [f"{by[(f, s)]['test_mae']:8.3f}" if (f, s) in by else "       -" for s in seeds]
        any_row = next((by[(f, s)] for s in seeds if (f, s) in by), None)
        if any_row:
            naive[f] = any_row["naive_conditional_mae"]
            fitted = " | ".join(
                f"{any_row.get(f'{b}_mae') or float('nan'):8.3f}" for b in (*FITTED, "smoother")
            )
            tail = (
                f"{any_row['naive_conditional_mae']:11.3f} | "
                f"{any_row['naive_cell_mean_mae']:9.3f} | {fitted}"
            )
        else:
            tail = "          - |         - |        - |        - |        -"
        print(f"{f:4d} | " + " | ".join(cells) + " | " + tail)
    print()
    for s in seeds:
        mine = [by[(f, s)] for f in folds if (f, s) in by]
        if not mine:
            continue
        m = float(np.mean([r["test_mae"] for r in mine]))
        n = float(np.mean([naive[r["fold"]] for r in mine]))
        c = float(np.mean([r["naive_cell_mean_mae"] for r in mine]))
        fitted = "  ".join(
            f"{b} mean {np.mean([r.get(f'{b}_mae') or np.nan for r in mine]):.3f}"
            for b in (*FITTED, "smoother")
        )
        collapsed = [r["fold"] for r in mine if r["collapse"]["collapsed"]]
        spread = ", ".join(
            f"f{r['fold']}: med {r['collapse']['median_ratio']:.2f} "
            f"p10 {r['collapse']['p10_ratio']:.2f}"
            for r in mine
        )
        verdict = "HOLDS" if m < n and not collapsed else "FAILS"
        print(
            f"seed {s}: folds {[r['fold'] for r in mine]}  model mean {m:.3f}  "
            f"cond. naive mean {n:.3f}"
            f"  cell mean {c:.3f}  {fitted}  beats naive: {m < n}"
            f"  collapsed folds: {collapsed or 'none'}"
            f"  -> {verdict}\n   spread ratios: {spread}"
        )
    parts = [r for r in rows if r.get("prior_mae") is not None]
    if parts:
        model = float(np.mean([r["test_mae"] for r in parts]))
        prior = float(np.mean([r["prior_mae"] for r in parts]))
        network = float(np.mean([r["network_mae"] for r in parts]))
        best = float(np.mean([r["naive_best_mae"] for r in parts]))
        print(
            f"\nover {len(parts)} trainings: the model {model:.3f}, the prior alone {prior:.3f}, "
            f"the network alone {network:.3f}, the best naive predictor {best:.3f}; the model "
            f"improves on the prior alone by {100 * (1 - model / prior):.1f}% (issue 34 asks 2%)"
        )
    walls = [r["wall_s"] for r in rows]
    if walls:
        print(
            f"\nwall per training (prepare+train+validate): median {np.median(walls):.0f} s, "
            f"min {min(walls):.0f} s, max {max(walls):.0f} s over {len(walls)} runs"
        )
    print(
        f"threads: OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, cpu count {os.cpu_count()}"
    )
    print(f"reproduce: {command}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "expressway.yaml")
    ap.add_argument("--folds", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument(
        "--order",
        choices=("seed-major", "fold-major"),
        default="seed-major",
        help="seed-major: all folds for the first seed first (what fits in a deadline)",
    )
    ap.add_argument(
        "--deadline", default="", help="UTC HH:MM; start no training expected to end after it"
    )
    ap.add_argument(
        "--set", dest="extra", action="append", default=[], help="more config overrides"
    )
    ap.add_argument("--json", type=Path, default=ROOT / "work" / "quality_expressway.json")
    ap.add_argument(
        "--save-predictions",
        type=Path,
        default=None,
        help="a folder for each training's test and validation predictions (fold{F}-seed{S}.npz)",
    )
    ap.add_argument(
        "--report-only", action="store_true", help="print the table from --json; run nothing"
    )
    args = ap.parse_args(argv)
    if args.report_only:
        report(
            json.loads(args.json.read_text()),
            args.folds,
            args.seeds,
            "(from " + str(args.json) + ")",
        )
        return 0
    os.environ.pop("ENN_WORK_DIR", None)  # each temporary project keeps its own work dir
    command = "OMP_NUM_THREADS=1 .venv/bin/python bench/quality_expressway.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    jobs = (
        [(f, s) for s in args.seeds for f in args.folds]
        if args.order == "seed-major"
        else [(f, s) for f in args.folds for s in args.seeds]
    )
    tmp = Path(tempfile.mkdtemp(prefix="enn-quality-"))
    layouts: dict[int, Layout] = {}
    smoother: dict[int, float] = {}  # per fold: the smoother does not depend on the seed
    rows: list[dict] = []
    try:
        for f, s in jobs:
            if args.deadline and rows and not _fits(args.deadline, rows):
                print(
                    f"stopping before fold {f} seed {s}: the next training would end after "
                    f"{args.deadline} UTC"
                )
                break
            cfg = fold_config(args.config, f, s, args.extra)
            if f not in layouts:  # stage-data once per fold, in the fold's own project dir
                root = tmp / f"fold{f}"
                root.mkdir()
                layouts[f] = Layout.for_root(root)
                execute_stage(STAGE_DATA, session(layouts[f], cfg, args.config, f"fold{f}-data"))
                try:
                    smoother[f] = kernel_smoother_mae(layouts[f])
                except KeyError:  # not the workbook's day types (e.g. synthetic data)
                    smoother[f] = float("nan")
            row = run_one(layouts[f], cfg, args.config, f, s, args.save_predictions)
            row["smoother_mae"] = smoother[f]
            rows.append(row)
            print(
                f"fold {f} seed {s}: test MAE {row['test_mae']:.3f} "
                f"(cond. naive {row['naive_conditional_mae']:.3f}, "
                f"cell mean {row['naive_cell_mean_mae']:.3f}, ridge {row['ridge_mae']:.3f}, "
                f"gbt {row['gbt_mae']:.3f}, smoother {row['smoother_mae']:.3f}), "
                f"collapsed {row['collapse']['collapsed']}, "
                f"epochs {row['epochs_run']} (best {row['best_epoch']}), {row['wall_s']:.0f} s; "
                f"val MAE {row['val_mae']:.3f}; best naive {row['naive_best']} "
                f"{row['naive_best_mae']:.3f}; network alone {row.get('network_mae', np.nan):.3f}, "
                f"prior alone {row.get('prior_mae', np.nan):.3f}",
                flush=True,
            )
            save_rows(args.json, rows)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report(rows, args.folds, args.seeds, command)
    return 0


def save_rows(path: Path, rows: list[dict]) -> None:
    """The raw results so far (after each training: a stopped run keeps what it measured)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1, default=str))


def _fits(deadline: str, rows: list[dict]) -> bool:
    hh, mm = (int(x) for x in deadline.split(":"))
    now = time.gmtime()
    left = (hh * 60 + mm) * 60 - (now.tm_hour * 3600 + now.tm_min * 60 + now.tm_sec)
    return left > max(r["wall_s"] for r in rows) * 1.1


if __name__ == "__main__":
    raise SystemExit(main())
