"""The Quick start's two commands, phase by phase, beside each phase's floor.

    .venv/bin/python bench/bench_quickstart.py [--set KEY=VALUE ...] [--only both|two] [--keep DIR]

A fresh copy of the committed project (`git clone` of this checkout, DVC configured as
scripts/setup.sh does; this checkout's .venv reused, its Python running the copy's code)
runs the Quick start's flows two ways, each on its own fresh copy: `enn run --flow both` (what
scripts/demo.sh runs after set-up: both flows in one process, one Prefect API), and the two
commands `enn run`, then `enn run --flow prediction` (the baseline); `--set` goes to training,
e.g. `--set train.epochs=3` for a quick look; `--only both|two` runs one way. Each console
line is timed as it arrives. The phases, and the floor each is set beside (the same work with
nothing around it):

- imports: `python -c "import flows.cli"` in the copy; floor `python -c pass`;
- Prefect API: from a command's start to its "Prefect API:" line; floor 0 (the stages need
  no API when called directly);
- each stage: from the line that ended the phase before to its "<stage>: ran in" line;
  floor: its enn_core call (`enn.work_seconds`, which the runner records on the stage's
  MLflow run);
- model fetch (prediction flow): from the Prefect API line to the "model models:/... ->" line
  (it holds the flow run's start and MLflow's first use in that process, named "+ flow
  start", as the training flow's first stage does); floor: `torch.load` of the champion's
  model.pt from the store;
- shutdown: from the last line to the command's exit; floor 0.

Prints each phase's seconds, its floor and floor / seconds, each command's total, and the
one-command total against the two commands' in this run. Not a test: it prints, it never
asserts. Absolute seconds follow the machine's load: compare the
ratios, and before/after figures taken in one sitting.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV_PY = ROOT / ".venv" / "bin" / "python"
ENN = "from flows.cli import entry; entry()"
STAGE_LINE = re.compile(r"^\S+ ([a-z-]+): (?:ran|skipped) in ([0-9.]+) s")


def fresh_copy(dest: Path) -> dict[str, str]:
    """`git clone` of this checkout into `dest`, DVC's site cache set as setup.sh sets it;
    the environment that runs the copy's code with this checkout's .venv."""
    subprocess.run(["git", "clone", "-q", str(ROOT), str(dest)], check=True)
    for repo in (dest, dest / "prediction"):
        subprocess.run(
            [str(ROOT / ".venv/bin/dvc"), "config", "--local", "core.site_cache_dir",
             str(dest / "work" / "dvc-site-cache")],
            cwd=repo, check=True, capture_output=True,
        )  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ENN_", "PREFECT_", "MLFLOW_"))}
    env["PYTHONPATH"] = str(dest)
    env["PYTHONUNBUFFERED"] = "1"
    env["PATH"] = f"{VENV_PY.parent}:{env.get('PATH', '')}"
    return env


def timed_command(argv: list[str], cwd: Path, env: dict[str, str]) -> tuple[list, float, int]:
    """Run `argv`; every output line with the seconds since the start at which it arrived,
    the whole time and the exit status."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: list[tuple[float, str]] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.perf_counter() - t0, line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    code = proc.wait()
    reader.join(timeout=10)
    return lines, time.perf_counter() - t0, code


def phases(lines: list, total: float) -> list[tuple[str, float]]:
    """(phase, seconds) in order, from the lines' arrival times."""
    out: list[tuple[str, float]] = []
    prev = 0.0
    for at, text in lines:
        if "Prefect API:" in text and not any(p == "Prefect API" for p, _ in out):
            out.append(("Prefect API", at - prev))
            prev = at
        elif re.search(r"\bmodel models:/\S+ -> ", text):
            out.append(("model fetch", at - prev))
            prev = at
        elif m := STAGE_LINE.match(text):
            out.append((m.group(1), at - prev))
            prev = at
    out.append(("shutdown and summary", total - prev))
    # the phase after the API's line also holds the flow run's start (Prefect's flow run,
    # MLflow's first use and parent run): named so, its floor is still the work alone
    if len(out) > 2 and out[0][0] == "Prefect API":
        out[1] = (f"{out[1][0]} (+ flow start)", out[1][1])
    return out


def work_seconds(copy: Path) -> dict[str, list[float]]:
    """stage -> the enn_core call's seconds of each stage run in the copy's MLflow store, in
    order."""
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{copy / 'work' / 'mlflow' / 'mlflow.db'}")
    out: dict[str, list[float]] = {}
    for exp in client.search_experiments():
        runs = client.search_runs(
            [exp.experiment_id], "tags.`enn.work_seconds` != ''", max_results=500
        )
        for run in sorted(runs, key=lambda r: r.info.start_time):
            tags = run.data.tags
            out.setdefault(tags.get("enn.stage", "?"), []).append(float(tags["enn.work_seconds"]))
    return out


def imports_floor(copy: Path, env: dict[str, str]) -> tuple[float, float]:
    def once(code: str) -> float:
        t0 = time.perf_counter()
        subprocess.run([str(VENV_PY), "-c", code], cwd=copy, env=env, check=True)
        return time.perf_counter() - t0

    return once("import flows.cli"), once("pass")


def fetch_floor(copy: Path) -> float:
    import torch

    store = copy / "work" / "mlflow" / "artifacts"
    found = sorted(store.rglob("data/enn/model.pt"), key=lambda p: p.stat().st_mtime)
    if not found:
        return float("nan")
    t0 = time.perf_counter()
    torch.load(found[-1], map_location="cpu", weights_only=True)
    return time.perf_counter() - t0


def report(name: str, rows: list[tuple[str, float, float]], total: float) -> None:
    print(f"\n{name}: {total:.1f} s")
    print(f"  {'phase':24s} {'seconds':>8s} {'floor':>8s} {'floor/s':>8s}")
    for phase, seconds, floor in rows:
        ratio = floor / seconds if seconds > 0 else float("nan")
        print(f"  {phase:24s} {seconds:8.2f} {floor:8.2f} {ratio:8.3f}")


# each way's commands; the first is the one that trains: `--set` goes to it
WAYS = {
    "both": [("enn run --flow both", ["run", "--flow", "both"])],
    "two": [("enn run", ["run"]), ("enn run --flow prediction", ["run", "--flow", "prediction"])],
}


def one_way(way: str, copy: Path, sets: list[str]) -> tuple[dict, dict, float, tuple]:
    """The Quick start's flows run `way` on a fresh copy at `copy`: each command's phases and
    total, the stages' enn_core seconds, the model fetch's floor, the imports' (and floor)."""
    env = fresh_copy(copy)
    imports = imports_floor(copy, env)
    runs = {}
    for i, (name, argv) in enumerate(WAYS[way]):
        extra = [f"--set={s}" for s in sets] if i == 0 else []
        lines, total, code = timed_command([str(VENV_PY), "-c", ENN, *argv, *extra], copy, env)
        if code != 0:
            tail = "\n".join(t for _, t in lines[-40:])
            sys.exit(f"{name} failed ({code}):\n{tail}")
        runs[name] = (phases(lines, total), total)
    return runs, work_seconds(copy), fetch_floor(copy), imports


def print_way(runs: dict, work: dict, fetch: float) -> float:
    seen: dict[str, int] = {}
    grand = 0.0
    for name, (parts, total) in runs.items():
        rows = []
        for phase, seconds in parts:
            phase_name = phase
            phase = phase.removesuffix(" (+ flow start)")
            if phase in work:
                i = seen.get(phase, 0)
                seen[phase] = i + 1
                floor = work[phase][i] if i < len(work[phase]) else float("nan")
            else:
                floor = fetch if phase == "model fetch" else 0.0
            rows.append((phase_name, seconds, floor))
        report(name, rows, total)
        grand += total
    return grand


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--only", choices=sorted(WAYS), help="run one way only")
    ap.add_argument("--keep", type=Path, help="run in this (new) folder and keep it")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from bench.harness import machine_facts

    ways = [args.only] if args.only else ["two", "both"]
    totals: dict[str, float] = {}
    print("Quick start, phase by phase (floor: the same work with nothing around it)")
    with tempfile.TemporaryDirectory(prefix="bench-quickstart-") as tmp:
        for way in ways:
            base = args.keep or Path(tmp)
            runs, work, fetch, (imports, python) = one_way(way, base / way, args.set)
            print(f"\n=== {way}: {' ; '.join(runs)}")
            report(
                "imports (each command pays them)", [("import flows.cli", imports, python)], imports
            )
            totals[way] = print_way(runs, work, fetch)
            print(f"\n{way}: {totals[way]:.1f} s in all")
    if len(totals) == 2:
        print(
            f"\none command (--flow both) / two commands: {totals['both'] / totals['two']:.3f} "
            f"({totals['both']:.1f} s / {totals['two']:.1f} s; the aim after set-up: 30 s on a "
            "quiet two-core machine)"
        )
    print(json.dumps({"machine": machine_facts(), "load_avg": os.getloadavg()}))


if __name__ == "__main__":
    main()
