"""Benchmark: predict's chunked, resumable loop vs a plain batched `model.predict(x)` loop.

Both read the same float32 feature memmap in the same batches and write [N, *label_shape]
float32 predictions to disk: the baseline into one `.npy` memmap; predict into checksummed
parts with completion markers (enn_core.predict.workers.predict_parts), then assembled into one
`.npy` by row id. Steady state: the model is loaded once and both are warmed up; pairs run
interleaved through bench.harness.compare, which prints the median of per-pair ratios
baseline time / subject time (= subject / baseline throughput), once for the loop writing
parts and once including the assembly.

    python bench/bench_predict.py [--rows 8192] [--pairs 5] [--batch 256] [--chunk 4096]
        [--model path/to/model.pt | --set model.d_model=64 ...]

The default model is small (d_model 16, 1 layer) on the real data's 39 x 24 grid, so that
predict's own costs (parts, markers, checksums, assembly) are as visible as they can be; the
default-size ENN on CPU (about 20 rows/s per thread here) hides them entirely.

Target: ratio >= 0.9.
"""

from __future__ import annotations

import argparse
import functools
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import compare  # noqa: E402
from enn_core.checkpoint import load_model  # noqa: E402
from enn_core.config import load_config  # noqa: E402
from enn_core.data import staging  # noqa: E402
from enn_core.inference import PredictionPath  # noqa: E402
from enn_core.model import build_model  # noqa: E402
from enn_core.paths import Layout  # noqa: E402
from enn_core.predict.assemble import assemble  # noqa: E402
from enn_core.predict.chunks import PartsPlan, PartStore, parts_key  # noqa: E402
from enn_core.predict.workers import WorkerJob, predict_parts, read_batch  # noqa: E402
from enn_core.runtime import secret  # noqa: E402

SMALL = ["model.d_model=16", "model.heads=2", "model.layers=1"]


def make_inputs(work: Path, rows: int, model_path: str | None, overrides: list[str]):
    """A staged synthetic dataset's features tiled to `rows`, and a model in eval mode."""
    (work / "params.yaml").write_text("{}\n")
    # the real data's 39 x 24 grid; model overrides size the model (--set model.d_model=...)
    cfg = load_config(None, ["data.synthetic.n_sections=39", *overrides])
    staged = work / "staged"
    staging.stage(cfg.data, Layout.for_root(work), staged)
    from enn_core.data.dataset import StagedDataset

    ds = StagedDataset(staged)
    reps = -(-rows // ds.n_rows)
    feats = np.tile(np.asarray(ds.features, dtype=np.float32), (reps, 1))[:rows]
    np.save(work / "features.npy", feats)
    if model_path:
        model, _ = load_model(model_path)
    else:
        model = build_model(cfg.model, ds.manifest.data_spec(), data_dir=staged).eval()
    return work / "features.npy", model, tuple(ds.label_shape)


def baseline(model, features_path: Path, out_path: Path, batch: int) -> None:
    """The plain loop: read a batch, `model.predict(x)`, write it into one .npy memmap."""
    feats = np.load(features_path, mmap_mode="r")
    n = feats.shape[0]
    out = None
    with torch.inference_mode():
        for b0 in range(0, n, batch):
            y = model.predict(read_batch(feats, None, b0, min(b0 + batch, n))).numpy()
            if out is None:
                out = np.lib.format.open_memmap(
                    out_path, mode="w+", dtype=np.float32, shape=(n, *y.shape[1:])
                )
            out[b0 : b0 + len(y)] = y
    out.flush()


def subject(
    path, features_path: Path, work: Path, shape, batch: int, chunk: int, *, assembly: bool
) -> None:
    """predict's loop: checksummed parts + completion markers (+ assembly by row id)."""
    n = np.load(features_path, mmap_mode="r").shape[0]
    parts = work / "parts"
    shutil.rmtree(parts, ignore_errors=True)
    key_file = work / secret.FILE_NAME  # every part's marker carries the job secret's MAC
    if not key_file.exists():
        secret.make(key_file)
    plan = PartsPlan(
        n_rows=n,
        rows_per_part=chunk,
        out_shape=shape,
        dtype="float32",
        model_fingerprint="m",
        input_fingerprint="i",
    )
    job = WorkerJob(
        rank=0,
        world_size=1,
        parts_dir=str(parts),
        plan=plan,
        features_path=str(features_path),
        index_path=None,
        batch_size=batch,
        loader=lambda: path,
        secret_file=str(key_file),
    )
    store = PartStore(parts, plan, parts_key(str(key_file)))
    store.prepare()
    predict_parts(job, path)
    if assembly:
        assemble(store, work / "subject.npy")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--model", default="")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument(
        "--set",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="model config overrides (default: a small model, so I/O overheads show)",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="bench-predict-"))
    try:
        features, model, shape = make_inputs(
            work, args.rows, args.model or None, args.set if args.set is not None else SMALL
        )
        path = PredictionPath(model, None).eval()
        print(
            f"rows {args.rows}, batch {args.batch}, chunk {args.chunk}, output {list(shape)}, "
            f"parameters {sum(p.numel() for p in model.parameters())}, "
            f"torch threads {torch.get_num_threads()}"
        )
        base = functools.partial(baseline, model, features, work / "base.npy", args.batch)
        for assembly in (False, True):
            subj = functools.partial(
                subject, path, features, work, shape, args.batch, args.chunk, assembly=assembly
            )
            what = "parts + markers + assembly" if assembly else "parts + markers"
            compare(
                f"predict ({what}) vs plain model.predict loop",
                base,
                subj,
                pairs=args.pairs,
                target=0.9,
            )
        same = np.array_equal(np.load(work / "base.npy"), np.load(work / "subject.npy"))
        print(f"outputs bit-identical: {same}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
