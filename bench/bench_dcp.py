"""DCP (torch.distributed.checkpoint) against torch.save/torch.load, and async against sync save.

The state is what training checkpoints: a model and its AdamW state (an MLP of `--width`
square layers; the default 4 x 2048 is about 200 MB with the two moment buffers), keyed as
`get_state_dict` gives it (FQNs, what DCP saves in distributed-train).

(a) Throughput, single process, no process group (`no_dist=True`):
    save: `torch.save` + fsync of the file (what an atomic write does) against `dcp.save`
          (its FileSystemWriter fsyncs by default);
    load: `torch.load(weights_only=True)` against `dcp.load` into the preallocated state.
(b) Time training is blocked by a save: `dcp.save` against `dcp.async_save`, both on a
    dedicated gloo group (FIELD_NOTES: async on the default group crashes training), in a
    1-process gloo job on a FileStore. Blocked = until the call returns (for async: staging the
    copy); the async save's completion time (until its future is done) is reported too. One
    save in flight at most: the future is awaited before the next save, outside the timing.
    Async runs twice: with a new stager per save (the default) and with one stager reused.

    python -m bench.bench_dcp [--pairs 5] [--width 2048] [--layers 4] [--dir /tmp]

Ratios are baseline time / subject time (> 1: the DCP or async side is faster).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict

from bench.harness import compare, machine_facts

warnings.filterwarnings("ignore", category=FutureWarning)  # async_save is marked experimental


def training_state(width: int, layers: int) -> tuple[dict, int]:
    """{"model", "optim"} state dicts of an MLP after one AdamW step, and their size in bytes."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, width)).square().mean().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    return state, _nbytes(state)


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


def torch_save_fsync(state: dict, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def _fresh(*paths: Path) -> None:
    for p in paths:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def throughput(state: dict, size: int, root: Path, pairs: int) -> dict:
    """(a): GB/s of torch.save/torch.load and dcp.save/dcp.load, medians of interleaved pairs."""
    pt, dcp_dir = root / "state.pt", root / "dcp"
    save = compare(
        f"save {size / 1e6:.0f} MB: torch.save+fsync (baseline) vs dcp.save (subject)",
        baseline=lambda: torch_save_fsync(state, pt),
        subject=lambda: dcp.save(state, checkpoint_id=dcp_dir, no_dist=True),
        pairs=pairs,
        setup=lambda: _fresh(pt, dcp_dir),
    )
    torch_save_fsync(state, pt)
    dcp.save(state, checkpoint_id=dcp_dir, no_dist=True)
    load = compare(
        f"load {size / 1e6:.0f} MB: torch.load (baseline) vs dcp.load in place (subject)",
        baseline=lambda: torch.load(pt, map_location="cpu", weights_only=True),
        subject=lambda: dcp.load(state, checkpoint_id=dcp_dir, no_dist=True),
        pairs=pairs,
    )
    return {"save": save, "load": load}


def blocked_time(state: dict, size: int, root: Path, pairs: int) -> dict:
    """(b): seconds training waits for dcp.save vs dcp.async_save, on a dedicated gloo group.

    Two async variants: the default (a new stager, so new staging buffers, per save) and one
    stager kept for the whole run (its staging buffers are reused: what a training run would
    hold), both staging synchronously on CPU (the CUDA-only options off).
    """
    store = dist.FileStore(str(root / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    stager = DefaultStager(StagingOptions(False, False, False, False))
    try:
        group = dist.new_group(backend="gloo")  # checkpoint-only group, as in training
        sync_dir, async_dir = root / "sync", root / "async"
        pending: dict = {}
        completed: list[float] = []

        def settle() -> None:  # the one in-flight save is awaited before the next, untimed
            if "future" in pending:
                pending.pop("future").result()
                completed.append(time.perf_counter() - pending.pop("t0"))
            _fresh(sync_dir, async_dir)

        def async_subject(**kw) -> None:
            pending["t0"] = time.perf_counter()
            pending["future"] = dcp.async_save(
                state, checkpoint_id=async_dir, process_group=group, **kw
            )

        out = {}
        for name, kw in (
            ("new stager per save", {}),
            ("one stager reused", {"async_stager": stager}),
        ):
            completed.clear()
            out[name] = compare(
                f"training blocked by a {size / 1e6:.0f} MB save: dcp.save (baseline) vs "
                f"dcp.async_save, {name} (subject)",
                baseline=lambda: dcp.save(state, checkpoint_id=sync_dir, process_group=group),
                subject=lambda kw=kw: async_subject(**kw),
                pairs=pairs,
                setup=settle,
            )
            settle()
            out[name]["completed_s"] = completed[1:]  # the first one belongs to the warm-up
        out["reused stager saves the current values"] = _reuse_is_fresh(state, stager, group, root)
        return out
    finally:
        stager.close()
        dist.destroy_process_group()


def _reuse_is_fresh(state: dict, stager: DefaultStager, group, root: Path) -> bool:
    """A reused stager's buffers hold this save's values, not the last one's: change the
    weights in place between two saves and load the second back."""
    weights = [v for v in state["model"].values() if isinstance(v, torch.Tensor)]
    with torch.no_grad():
        for w in weights:
            w.add_(1.0)
    expected = {k: v.clone() for k, v in state["model"].items()}
    dcp.async_save(
        state, checkpoint_id=root / "fresh", process_group=group, async_stager=stager
    ).result()
    back = {"model": {k: torch.zeros_like(v) for k, v in expected.items()}}
    dcp.load(back, checkpoint_id=root / "fresh", process_group=group)
    return all(torch.equal(back["model"][k], expected[k]) for k in expected)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dir", default=None, help="where the checkpoints are written (default: tmp)")
    args = ap.parse_args()
    state, size = training_state(args.width, args.layers)
    gb = size / 1e9
    facts = machine_facts()
    print(
        f"state {size / 1e6:.1f} MB; torch {facts['torch']}, {facts['affinity']} CPUs, "
        f"{facts['torch_threads']} torch threads"
    )
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-dcp-", dir=args.dir) as tmp:
        tp = throughput(state, size, Path(tmp), args.pairs)
        blocked = blocked_time(state, size, Path(tmp), args.pairs)
    print("\n== DCP vs torch.save/torch.load (medians of interleaved pairs) ==")
    for op, r in tp.items():
        b, s = r["baseline_median_s"], r["subject_median_s"]
        print(
            f"{op}: torch {gb / b:.2f} GB/s ({b:.3f} s), dcp {gb / s:.2f} GB/s ({s:.3f} s); "
            f"ratio torch/dcp time {r['ratio_median']:.2f} "
            f"(min {r['ratio_min']:.2f}, max {r['ratio_max']:.2f})"
        )
    print("== Training blocked by a checkpoint save (dedicated gloo group) ==")
    fresh = blocked.pop("reused stager saves the current values")
    for name, r in blocked.items():
        b, s, done = r["baseline_median_s"], r["subject_median_s"], r["completed_s"]
        print(
            f"{name}: sync dcp.save blocks {b:.3f} s; async_save blocks {s:.3f} s (staging): "
            f"{r['ratio_median']:.1f}x less (min {r['ratio_min']:.1f}, max {r['ratio_max']:.1f}); "
            f"async save done {statistics.median(done):.3f} s after the call "
            f"(min {min(done):.3f}, max {max(done):.3f})"
        )
    print(f"a reused stager saved the values changed since its last save: {fresh}")
    print(f"wall {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
