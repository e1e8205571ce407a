"""Progress bars on long work (staging chunks, training steps, prediction parts).

Shown on a terminal when `runtime.progress` is on; silent otherwise (CI logs, Prefect workers,
redirected output), so logs stay readable. Training runs in worker processes whose output goes
to per-rank log files, so its bar lives in the launching process and follows rank 0's
heartbeat (`follow_heartbeat`).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm  # type: ignore[import-untyped]  # tqdm ships no type stubs

from enn_core.runtime.heartbeat import read_heartbeats


def bar(total: int | None, desc: str, enabled: bool = True, unit: str = "it") -> tqdm:
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        disable=not (enabled and sys.stderr.isatty()),
        leave=False,
        dynamic_ncols=True,
    )


@contextlib.contextmanager
def follow_heartbeat(
    run_dir: Path, total: int | None, desc: str, enabled: bool = True, interval: float = 1.0
) -> Iterator[None]:
    """A bar over rank 0's heartbeat step while the body (the worker launch) runs."""
    pbar = bar(total, desc, enabled, unit="step")
    if pbar.disable:
        yield
        return
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(interval):
            rec = read_heartbeats(run_dir).get(0)
            if rec and isinstance(rec.get("step"), int):
                pbar.n = rec["step"]
                pbar.set_postfix_str(str(rec.get("phase", "")), refresh=True)

    t = threading.Thread(target=poll, name="enn-progress", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(timeout=2 * interval)
        pbar.close()
