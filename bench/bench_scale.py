"""Millions of rows through every stage, beside what a user would write instead (issue 51).

    .venv/bin/python bench/bench_scale.py [--rows 1e4,1e5,1e6,1e7] [--formats csv,parquet]
                                          [--features 3] [--dir DIR] [--out DIR]
                                          [--set KEY=VALUE ...] [--stages stage-data,...]
                                          [--baselines pandas-read,...]

For each size and format it generates a table with pyarrow's writers (a categorical `store` of
500 levels, a cyclic `weekday`, `--features` numeric features, 24 labels h00..h23) under
`--dir` (default work/bench-scale/, never committed; a table already there is reused), and
runs every stage of the training flow as its own `enn <stage> --config` command, in a project
folder of its own (a params.yaml in a temporary folder, outside any dvc.yaml: the checkout's
params.yaml and outputs/ are untouched; `--keep` keeps it), with the settings
docs/your-data.md gives for a table and for large tables (`train.batch_size: auto`, and
`train.max_steps` to try one quickly: `large_table` below; `--set` adds to them; `--stages`
runs the flow's first stages only, e.g. `--stages stage-data --baselines pandas-read` for
the staging target). Per stage it
prints seconds, rows per second and the peak anonymous memory (RssAnon, sampled every 20 ms:
pages of a memmap read do not count) of the stage's process and of its largest other process
(workers, torchrun). The table and the sampler are tests/fixtures/scale.py's,
which the suite's scale test (tests/e2e/test_table_scale.py) uses too.

Beside them, in the same run, each in a process of its own (its peak memory its own):
- pandas' read_csv / read_parquet and pyarrow's read of the file into float32 arrays;
- a hand-written PyTorch loop (forward, L1 loss, backward, AdamW step) over the staged
  memmaps' training rows, at the training batch and for as many steps, with the prepared model;
- `model(x)` over every staged row at the same batch (no grad);
- scikit-learn's HistGradientBoostingRegressor fitted on the training rows for one label.

Writes `--out`/scale.json, scale.md (a markdown table) and scale.png (seconds and peak
memory against rows, log-log, one line per stage). Not a test: it prints, it never asserts.
Absolute seconds follow the machine's load; compare ratios taken in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from enn_core.train.batch import choose_batch  # noqa: E402
from flows.params_file import apply_overrides  # noqa: E402
from tests.fixtures.scale import LABELS, TreePeaks, features, table_keys, write_table  # noqa: E402

PY = sys.executable
STAGES = [
    "stage-data",
    "prepare-checkpoint",
    "distributed-train",
    "validate",
    "predict",
    "collapse-check",
    "export",
]
MAX_STEPS = 300  # train.max_steps: what docs/your-data.md gives to try a large table quickly


BASELINES = ("pandas-read", "pyarrow-read", "torch-loop", "model(x)", "hist-gbr")


def large_table() -> list[str]:
    """docs/your-data.md's settings for a large table: the batches auto (the defaults), the
    optimizer steps capped; no tracking (the bench measures the stages, not the store)."""
    return [
        "train.epochs=1",
        f"train.max_steps={MAX_STEPS}",
        "tracking.enabled=false",
        "runtime.progress=false",
    ]


def batch_for(rows: int) -> int:
    """The batch `train.batch_size: auto` takes for this table (its training rows: 70%)."""
    return choose_batch("auto", int(rows * 0.7), 1).value


def steps_for(train_rows: int, batch: int) -> int:
    return min(-(-train_rows // batch), MAX_STEPS)


# -- the table ---------------------------------------------------------------------------------


def project(folder: Path, data: Path, fmt: str, n_numeric: int) -> Path:
    """A project folder of its own: params.yaml = the checkout's, its data section set to the
    table as docs/your-data.md says, with the tabular preset."""
    import yaml

    folder.mkdir(parents=True, exist_ok=True)
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    (folder / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    tabular = ["train.loss=l1", "train.lr=0.001", "train.weight_decay=0.1"]  # configs/tabular
    apply_overrides(folder / "params.yaml", [*table_keys(data, n_numeric), *tabular])
    return folder / "params.yaml"


# -- measuring a process tree ------------------------------------------------------------------


def run_tree(argv: list[str], cwd: Path, env: dict[str, str]) -> dict:
    """Run `argv`; its seconds, exit code, output tail and the peak RssAnon (MiB) of the
    process itself and of its largest other process (TreePeaks: sampled every 20 ms)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    with TreePeaks(proc.pid, ["all"]) as peaks:
        out, _ = proc.communicate()
    others = [w for _, w in peaks.peaks if w not in ("enn", "prefect-api", "gone")]
    return {
        "seconds": time.perf_counter() - t0,
        "rc": proc.returncode,
        "tail": out[-2000:],
        "parent_mb": peaks.over("enn") / 1024,
        "worker_mb": max((peaks.over(w) for w in others), default=0) / 1024,
        "workers": len(set(others)),
    }


# -- what a user would write instead (each run as `bench_scale.py --baseline NAME ...`) --------


def _float32_arrays(get, feats: list[str]):
    import numpy as np

    x = np.stack([get(c) for c in feats], axis=1).astype(np.float32)
    y = np.stack([get(c) for c in LABELS], axis=1).astype(np.float32)
    return x, y


def baseline(name: str, path: Path, out: Path, n_numeric: int, batch: int) -> dict:
    """One baseline's work; returns its seconds (the process's peak is sampled outside)."""
    import numpy as np

    feats = features(n_numeric)
    t0 = time.perf_counter()
    info: dict = {}
    if name == "pandas-read":
        import pandas as pd

        df = pd.read_csv(path) if path.suffix == ".csv" else pd.read_parquet(path)
        df["store"] = pd.factorize(df["store"])[0]
        _float32_arrays(lambda c: df[c].to_numpy(), feats)
    elif name == "pyarrow-read":
        import pyarrow.compute as pc
        import pyarrow.csv as pacsv
        import pyarrow.parquet as pq

        t = pacsv.read_csv(path) if path.suffix == ".csv" else pq.read_table(path)

        def get(c: str):
            col = t.column(c)
            if c == "store":
                return pc.dictionary_encode(col).combine_chunks().indices.to_numpy()
            return col.to_numpy()

        _float32_arrays(get, feats)
    elif name in ("torch-loop", "model(x)"):
        info = _torch(name, out, batch)
    elif name == "hist-gbr":
        from sklearn.ensemble import HistGradientBoostingRegressor

        x = np.load(out / "stage-data" / "features.npy", mmap_mode="r")
        y = np.load(out / "stage-data" / "labels.npy", mmap_mode="r")
        train = np.load(out / "stage-data" / "splits" / "train.npy")
        # weekday as a category; store (500 levels) as its code: the model takes at most 255
        m = HistGradientBoostingRegressor(loss="absolute_error", categorical_features=[1])
        m.fit(x[train], y[train, 0])
        info = {"rows": int(len(train)), "iterations": int(m.n_iter_)}
    return {"seconds": time.perf_counter() - t0, "work_s": time.perf_counter() - t0, **info}


def _torch(name: str, out: Path, batch: int) -> dict:
    import numpy as np
    import torch

    from enn_core.checkpoint import load_model

    model, _ = load_model(next((out / "prepare-checkpoint").rglob("*.pt")))
    x = np.load(out / "stage-data" / "features.npy", mmap_mode="r")
    y = np.load(out / "stage-data" / "labels.npy", mmap_mode="r")
    if name == "model(x)":
        with torch.no_grad():
            for s in range(0, len(x), batch):
                model(torch.from_numpy(np.asarray(x[s : s + batch])))
        return {"rows": len(x)}
    train = np.load(out / "stage-data" / "splits" / "train.npy")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    order = np.random.default_rng(0).permutation(train)
    steps = steps_for(len(train), batch)  # as many steps as the pipeline trains
    for s in range(0, steps * batch, batch):
        idx = np.sort(order[s : s + batch])
        xb, yb = torch.from_numpy(x[idx]), torch.from_numpy(y[idx])
        loss = torch.nn.functional.l1_loss(model(xb).reshape(yb.shape), yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return {"rows": steps * batch}


# -- one table ---------------------------------------------------------------------------------


def one_table(rows: int, fmt: str, args: argparse.Namespace) -> list[dict]:
    data = args.dir / f"t{rows}-{args.features}f.{fmt}"
    if not data.exists():
        t = time.perf_counter()
        write_table(data, rows, numeric=args.features)
        size = data.stat().st_size / 2**20
        print(f"  wrote {data} ({size:.0f} MiB) in {time.perf_counter() - t:.0f} s", flush=True)
    # outside any dvc.yaml, so that it is a project of its own (not the checkout's outputs/)
    folder = Path(tempfile.mkdtemp(prefix=f"enn-bench-scale-{fmt}-{rows}-"))
    config = project(folder, data, fmt, args.features)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    sets = [f"--set={s}" for s in [*large_table(), *args.set]]
    out = []
    for stage in args.stages.split(","):
        argv = [PY, "-c", "from flows.cli import entry; entry()", stage, "--config", str(config)]
        r = run_tree([*argv, *sets], folder, env)
        if stage == "distributed-train":  # rows trained on: the steps at the batch
            b = batch_for(rows)
            r["rows"] = steps_for(int(rows * 0.7), b) * b
        out.append(_row(rows, fmt, stage, r))
        if r["rc"] != 0:
            print(f"  {stage} failed (exit {r['rc']}): {r['tail'][-600:]}", flush=True)
            return out
    me = [PY, str(Path(__file__).resolve()), "--baseline"]
    for name in args.baselines.split(","):
        at = [name, str(data), str(folder / "outputs"), str(args.features), str(batch_for(rows))]
        r = run_tree([*me, *at], ROOT, env)
        if r["rc"] != 0:
            print(f"  {name} failed (exit {r['rc']}): {r['tail'][-600:]}", flush=True)
            continue
        res = json.loads(r["tail"].strip().splitlines()[-1])
        out.append(_row(rows, fmt, name, {**r, **res}))
    if not args.keep:
        shutil.rmtree(folder, ignore_errors=True)
    return out


def _work_s(name: str, tail: str) -> float | None:
    """The stage's own seconds, from its "<stage>: done in N s" line (no interpreter start)."""
    for line in reversed(tail.splitlines()):
        for said in (f"{name}: done in ", f"{name}: ran in "):
            if said in line:
                return float(line.split(said)[1].split()[0])
    return None


def _row(rows: int, fmt: str, name: str, r: dict) -> dict:
    done = r.get("rows", rows)  # rows the work went over (training: steps x batch)
    work = r.get("work_s") or _work_s(name, r.get("tail", "")) or r["seconds"]
    row = {
        "rows": rows,
        "format": fmt,
        "stage": name,
        "seconds": round(r["seconds"], 3),
        "work_s": round(work, 3),
        "rows_per_s": round(done / work) if work else None,
        "parent_mb": round(r["parent_mb"], 1),
        "worker_mb": round(r["worker_mb"], 1),
        "workers": r["workers"],
        "ok": r["rc"] == 0,
    }
    workers = f" (workers: {row['workers']}, largest {row['worker_mb']:.1f} MiB)"
    print(
        f"  {fmt:8s} {rows:>9d} {name:20s} {row['seconds']:9.2f} s (work {work:8.2f} s) "
        f"{row['rows_per_s'] or 0:>11,} rows/s  peak {row['parent_mb']:7.1f} MiB"
        + (workers if row["workers"] else ""),
        flush=True,
    )
    return row


# -- report ------------------------------------------------------------------------------------


def write_report(results: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "scale.json").write_text(json.dumps(results, indent=1))
    lines = [
        "| format | rows | stage | seconds (process) | seconds (work) | rows/s (work) "
        "| s per 10^6 rows | peak MiB (process) | peak MiB (largest worker) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        per_m = r["work_s"] / r["rows"] * 1e6
        lines.append(
            f"| {r['format']} | {r['rows']:,} | {r['stage']} | {r['seconds']:.2f} | "
            f"{r['work_s']:.2f} | {r['rows_per_s'] or 0:,} | {per_m:.2f} | {r['parent_mb']:.0f} | "
            f"{r['worker_mb']:.0f} |"
        )
    (out / "scale.md").write_text("\n".join(lines) + "\n")
    _plot(results, out / "scale.png")
    print(f"wrote {out / 'scale.json'}, {out / 'scale.md'}, {out / 'scale.png'}")


def _plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5))
    names = list(dict.fromkeys(r["stage"] for r in results))
    colors = {n: plt.get_cmap("tab20")(i % 20) for i, n in enumerate(names)}  # one per stage
    for fmt, style in (("csv", "-"), ("parquet", "--")):
        for name in names:
            pts = sorted(
                (r["rows"], r["work_s"], max(r["parent_mb"], r["worker_mb"]))
                for r in results
                if r["stage"] == name and r["format"] == fmt and r["ok"]
            )
            if not pts:
                continue
            n, s, m = zip(*pts, strict=True)
            kw = {"color": colors[name], "marker": "o", "label": f"{name} ({fmt})"}
            axes[0].plot(n, s, style, **kw)
            axes[1].plot(n, m, style, **kw)
    for ax, what in zip(axes, ("seconds", "peak anonymous memory, MiB"), strict=True):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("rows")
        ax.set_ylabel(what)
        ax.grid(True, which="both", alpha=0.3)
    axes[1].legend(fontsize=7, ncol=2)
    fig.suptitle("bench/bench_scale.py: every stage against rows (solid: CSV, dashed: Parquet)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--baseline":
        name, path, out, n, batch = sys.argv[2:7]
        print(json.dumps(baseline(name, Path(path), Path(out), int(n), int(batch))))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", default="1e4,1e5,1e6,1e7", help="comma-separated row counts")
    ap.add_argument("--formats", default="csv,parquet", help="csv, parquet or both")
    ap.add_argument("--features", type=int, default=3, help="numeric features (3 to 30)")
    ap.add_argument("--dir", type=Path, default=ROOT / "work" / "bench-scale")
    ap.add_argument("--out", type=Path, default=None, help="report folder (default: --dir)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--keep", action="store_true", help="keep each table's project folder")
    ap.add_argument(
        "--stages",
        default=",".join(STAGES),
        help="the first stages of the flow to run, in its order (e.g. stage-data: staging "
        "against pandas-read and pyarrow-read, which need no staged arrays)",
    )
    ap.add_argument(
        "--baselines",
        default=",".join(BASELINES),
        help="which (torch-loop, model(x) and hist-gbr read the staged arrays: the same for "
        "both formats of a size)",
    )
    args = ap.parse_args()
    args.dir = args.dir.resolve()
    args.dir.mkdir(parents=True, exist_ok=True)
    if args.stages.split(",") != STAGES[: len(args.stages.split(","))]:
        ap.error(f"--stages: the flow's first stages in its order, from {','.join(STAGES)}")
    sizes = [int(float(s)) for s in args.rows.split(",")]
    formats = [f.strip() for f in args.formats.split(",")]
    settings = large_table() + args.set
    print(
        f"bench_scale: rows {sizes}, formats {formats}, {args.features} numeric features, "
        f"settings {settings}; load average {os.getloadavg()[0]:.1f}"
    )
    results: list[dict] = []
    for rows in sizes:
        for fmt in formats:
            results += one_table(rows, fmt, args)
    write_report(results, args.out or args.dir)


if __name__ == "__main__":
    main()
