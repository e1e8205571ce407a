"""Models of millions to hundreds of millions of parameters through every stage (issue 55).

    .venv/bin/python bench/bench_model_scale.py [--params 10M,100M,500M] [--world-sizes 1,2]
                                                [--steps 3] [--out DIR] [--set KEY=VALUE ...]

One custom model family, examples/wide_mlp (a residual MLP: a stem, `--blocks` residual
blocks of width x width, each one FSDP2 unit, a read-out), sized by one option: `--params`
picks each size's width (a multiple of 64). Each size goes, at each world size, through every
stage of the training flow as its own `enn <stage> --config` command, in a project folder of
its own (the checkout's params.yaml with the demo data, `model.preset: custom`, one epoch cut
to `--steps` optimizer steps by `train.max_steps`, no tracking: the store is not measured;
the checkout's outputs/ are untouched). Per stage it prints the seconds and the peak
anonymous memory (RssAnon sampled every 20 ms: pages of a mapped checkpoint or memmap do not
count) of the stage's process and of its largest other process (a worker),
as bench/bench_scale.py measures them (tests/fixtures/scale.py's TreePeaks).

Beside them, in the same run, each in a process of its own: `torch.save` and `torch.load` of
the model's state (the same bytes as init.pt), in GB/s, and a hand-written loop of the same
steps (forward, L1 loss, backward, AdamW) on one process, in seconds per step and its peak
memory: what the pipeline's training at world size 1 and 2 compares with. For
distributed-train it also prints the first step's seconds (rank 0's telemetry: phase
first_forward, the first all-gather of every weight) against the watchdog's budget for it.

Writes `--out`/model_scale.json and model_scale.md. Not a test: it prints, it never asserts.
Absolute seconds follow the machine's load; compare within one run.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_scale import STAGES, run_tree  # noqa: E402
from flows.params_file import apply_overrides  # noqa: E402

PY = sys.executable
FACTORY = "examples.wide_mlp.model:build"


def parse_count(text: str) -> int:
    """10M -> 10_000_000, 1B -> 10^9, 500000 -> 500000."""
    text = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "B": 10**9}.get(text[-1:], 1)
    return int(float(text.rstrip("KMB")) * scale)


def width_for(params: int, blocks: int) -> int:
    """The width whose model has about `params` parameters (blocks x width^2 dominates)."""
    return max(64, round((params / blocks) ** 0.5 / 64) * 64)


def count(width: int, blocks: int) -> int:
    return blocks * (width * width + 3 * width)  # stem and read-out are small beside it


def project(folder: Path, width: int, blocks: int, steps: int, world: int, sets: list[str]) -> Path:
    import yaml

    folder.mkdir(parents=True, exist_ok=True)
    shutil.copytree(ROOT / "examples" / "wide_mlp", folder / "examples" / "wide_mlp")
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    (folder / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    apply_overrides(
        folder / "params.yaml",
        [
            "model.preset=custom",
            f"model.factory={FACTORY}",
            f"model.options={{width: {width}, blocks: {blocks}}}",
            "train.epochs=1",
            f"train.max_steps={steps}",
            f"runtime.world_size={world}",
            "tracking.enabled=false",
            "runtime.progress=false",
            *sets,
        ],
    )
    return folder / "params.yaml"


def baseline(init: Path, steps: int) -> dict:
    """torch.save / torch.load of init.pt's state, and a hand-written training loop."""
    import numpy as np
    import torch

    from enn_core.checkpoint import read_checkpoint
    from enn_core.data.dataset import StagedDataset
    from enn_core.model import ModelCode, build_model

    ckpt = read_checkpoint(init)
    state = {k: v.clone() for k, v in ckpt.state_dict.items()}
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    with tempfile.TemporaryDirectory(dir=init.parent) as tmp:
        t0 = time.perf_counter()
        torch.save(state, Path(tmp) / "state.pt")
        save_s = time.perf_counter() - t0
        os.sync()
        t0 = time.perf_counter()
        torch.load(Path(tmp) / "state.pt", weights_only=True)
        load_s = time.perf_counter() - t0
        # DCP of the same state, one process (what each rank's shard costs, without the ranks)
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        dcp.save(state, checkpoint_id=str(Path(tmp) / "dcp"))
        dcp_save_s = time.perf_counter() - t0
        os.sync()
        into = {k: torch.empty_like(v) for k, v in state.items()}
        t0 = time.perf_counter()
        dcp.load(into, checkpoint_id=str(Path(tmp) / "dcp"))
        dcp_load_s = time.perf_counter() - t0
        del into
    del state
    from enn_core.config.loader import build
    from enn_core.config.model import ModelConfig

    cfg = build(ModelConfig, ckpt.model_config, root=ModelConfig, where="init.pt")
    root = init.parents[2]
    staged = StagedDataset(root / "outputs" / "stage-data")
    model = build_model(cfg, staged.manifest.model_data(), code=ModelCode.of(cfg, root))
    model.load_state_dict(ckpt.state_dict)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train = np.sort(np.asarray(staged.split("train")))[:256]
    x = torch.as_tensor(np.asarray(staged.features[train]), dtype=torch.float32)
    y = model.normalize(torch.as_tensor(np.asarray(staged.labels[train]), dtype=torch.float32))
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = torch.nn.functional.l1_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    step_s = (time.perf_counter() - t0) / steps
    return {
        "state_gb": nbytes / 1e9,
        "torch_save_gbs": nbytes / 1e9 / save_s,
        "torch_load_gbs": nbytes / 1e9 / load_s,
        "dcp_save_gbs": nbytes / 1e9 / dcp_save_s,
        "dcp_load_gbs": nbytes / 1e9 / dcp_load_s,
        "loop_step_s": step_s,
        "loop_batch": len(train),
    }


def first_step(folder: Path, config: Path) -> dict:
    """The first training step's seconds (phase first_forward: FSDP2's first all-gather of
    every weight, seed 03's hang) from rank 0's step telemetry in the run's events.jsonl, the
    later steps' mean, and the watchdog's budget for it (runtime.first_forward_s_per_gb)."""
    import yaml

    from enn_core.runtime.watchdog import first_forward_budget

    events = sorted(folder.glob("work/runs/*/distributed-train/events.jsonl"))[-1]
    steps: dict[int, float] = {}
    for line in events.read_text().splitlines():
        rec = json.loads(line)
        name = str(rec.get("name", ""))
        if rec.get("type") == "metric" and name.startswith("telemetry/time/"):
            steps[rec["step"]] = steps.get(rec["step"], 0.0) + rec["value"]
    later = [v for k, v in steps.items() if k > 0]
    saves = []  # the training's own DCP saves: seconds, and the committed folder's bytes
    for line in events.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("name") == "checkpoint_saved" and Path(rec["fields"]["path"]).is_dir():
            done = Path(rec["fields"]["path"])
            size = sum(f.stat().st_size for f in done.rglob("*") if f.is_file())
            saves.append(size / 1e9 / rec["fields"]["seconds"])
    rt = yaml.safe_load(config.read_text()).get("runtime") or {}
    budget, why = first_forward_budget(
        float(rt.get("hang_timeout_s", 120.0)),
        (folder / "outputs" / "prepare-checkpoint" / "init.pt").stat().st_size,
        float(rt.get("first_forward_s_per_gb", 60.0)),
    )
    return {
        "first_step_s": steps.get(0, float("nan")),
        "later_step_s": sum(later) / len(later) if later else float("nan"),
        "first_step_budget_s": budget,
        "first_step_budget_why": why,
        "train_dcp_save_gbs": max(saves) if saves else float("nan"),
    }


def one(params: int, world: int, args: argparse.Namespace) -> list[dict]:
    width = width_for(params, args.blocks)
    folder = Path(tempfile.mkdtemp(prefix=f"enn-bench-model-{params}-{world}-"))
    config = project(folder, width, args.blocks, args.steps, world, args.set)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # malloc as a user meets it (runtime.malloc)
    size = {"params": count(width, args.blocks), "width": width, "world_size": world}
    rows = []
    for stage in STAGES:
        argv = [PY, "-c", "from flows.cli import entry; entry()", stage, "--config", str(config)]
        r = run_tree(argv, folder, env)
        row = {**size, "stage": stage, **{k: v for k, v in r.items() if k != "tail"}}
        rows.append(row)
        print(
            f"  {size['params'] / 1e6:7.1f}M ws{world} {stage:20s} {r['seconds']:7.1f} s  "
            f"stage {r['parent_mb']:7.0f} MiB  worker {r['worker_mb']:7.0f} MiB"
            + ("" if r["rc"] == 0 else f"  FAILED (exit {r['rc']}): {r['tail'][-400:]}"),
            flush=True,
        )
        if r["rc"] != 0:
            break
        if stage == "distributed-train":
            row.update(first_step(folder, config))
            print(
                f"  {size['params'] / 1e6:7.1f}M ws{world} first step {row['first_step_s']:.1f} s "
                f"(later steps {row['later_step_s']:.1f} s) of its watchdog budget "
                f"{row['first_step_budget_s']:.0f} s ({row['first_step_budget_why']}); "
                f"its DCP saves {row['train_dcp_save_gbs']:.2f} GB/s (weights and AdamW state)",
                flush=True,
            )
    init = folder / "outputs" / "prepare-checkpoint" / "init.pt"
    if world == 1 and init.is_file() and not args.no_baseline:
        me = [PY, str(Path(__file__).resolve()), "--baseline", str(init), str(args.steps)]
        r = run_tree(me, ROOT, env)
        if r["rc"] == 0:
            res = json.loads(r["tail"].strip().splitlines()[-1])
            rows.append({**size, "stage": "hand-written", **res, "parent_mb": r["parent_mb"]})
            print(
                f"  {size['params'] / 1e6:7.1f}M hand-written: torch.save "
                f"{res['torch_save_gbs']:.2f} GB/s, torch.load {res['torch_load_gbs']:.2f} GB/s, "
                f"DCP save {res['dcp_save_gbs']:.2f} GB/s, "
                f"DCP load {res['dcp_load_gbs']:.2f} GB/s, "
                f"a step {res['loop_step_s']:.2f} s at batch {res['loop_batch']}, "
                f"peak {r['parent_mb']:.0f} MiB",
                flush=True,
            )
        else:
            print(f"  hand-written failed: {r['tail'][-400:]}", flush=True)
    shutil.rmtree(folder, ignore_errors=True)
    return rows


def write_report(results: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "model_scale.json").write_text(json.dumps(results, indent=1))
    lines = [
        "| parameters | world size | stage | seconds | stage process MiB | largest worker MiB |",
        "|---:|---:|---|---:|---:|---:|",
    ]
    for r in results:
        if r["stage"] == "hand-written":
            continue
        lines.append(
            f"| {r['params'] / 1e6:.1f}M | {r['world_size']} | {r['stage']} | {r['seconds']:.1f} "
            f"| {r['parent_mb']:.0f} | {r['worker_mb']:.0f} |"
        )
    (out / "model_scale.md").write_text("\n".join(lines) + "\n")
    plot(results, out / "model_scale.png")


def plot(results: list[dict], path: Path) -> None:
    """Peak anonymous memory of a training worker against parameters, one line per world size,
    beside the ideal (weights, gradients and AdamW's two moments: 16 bytes a parameter, shared
    by the workers) and the hand-written loop (one process)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5.5))
    train = [r for r in results if r["stage"] == "distributed-train" and r.get("rc") == 0]
    for world, color in ((1, "tab:blue"), (2, "tab:orange")):
        pts = sorted((r["params"], r["worker_mb"]) for r in train if r["world_size"] == world)
        if pts:
            n, m = zip(*pts, strict=True)
            ax.plot(n, m, "-o", color=color, label=f"a training worker, world size {world}")
            ax.plot(
                n,
                [16 * p / world / 2**20 for p in n],
                ":",
                color=color,
                label=f"ideal: 16 bytes a parameter / {world}",
            )
    hand = sorted((r["params"], r["parent_mb"]) for r in results if r["stage"] == "hand-written")
    if hand:
        n, m = zip(*hand, strict=True)
        ax.plot(n, m, "--s", color="tab:gray", label="hand-written AdamW loop, one process")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel("peak anonymous memory, MiB")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("bench/bench_model_scale.py: memory per training worker")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--baseline":
        print(json.dumps(baseline(Path(sys.argv[2]), int(sys.argv[3]))))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="10M,100M,500M")
    ap.add_argument("--world-sizes", default="1,2")
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "work" / "bench-model-scale")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument(
        "--plot-from", nargs="+", type=Path, help="only draw the plot from these runs' JSON files"
    )
    args = ap.parse_args()
    if args.plot_from:  # runs of several sizes, made apart, in one plot
        merged = [r for f in args.plot_from for r in json.loads(f.read_text())]
        args.out.mkdir(parents=True, exist_ok=True)
        plot(merged, args.out / "model_scale.png")
        print(f"wrote {args.out / 'model_scale.png'}")
        return
    results: list[dict] = []
    for p in (parse_count(s) for s in args.params.split(",")):
        for world in (int(w) for w in args.world_sizes.split(",")):
            results += one(p, world, args)
            write_report(results, args.out)
    print(f"wrote {args.out / 'model_scale.md'}")


if __name__ == "__main__":
    main()
