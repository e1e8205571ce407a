"""`enn gc`'s policy: old finished fingerprints and finished trials go; the newest, the
unfinished recent ones, running trials and a running study's folder stay."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from enn_core.config import load_config
from enn_core.paths import Layout
from tasks import gc

HOLD = (
    "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
    "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)"
)


def test_gc_policy(tmp_path):
    layout = Layout(root=tmp_path, work=tmp_path / "work")
    cfg = load_config(None, ["gc.keep_fingerprints=1", "gc.keep_days=1", "tracking.enabled=false"])
    now = time.time()
    ckpt = layout.checkpoints
    for name, age_days, complete in (("new", 0, True), ("done", 0.1, True), ("left", 0.2, False)):
        d = ckpt / name / "step-1"
        d.mkdir(parents=True)
        (d / "shard").write_bytes(b"x" * 100)
        if complete:
            (ckpt / name / "COMPLETE").touch()
        os.utime(ckpt / name, (now - age_days * 86400, now - age_days * 86400))
    stale = ckpt / "stale"
    stale.mkdir()
    os.utime(stale, (now - 3 * 86400, now - 3 * 86400))
    study = layout.work / "tune" / "s"
    for n, ended in ((0, True), (1, False)):
        (study / f"trial-{n}").mkdir(parents=True)
        if ended:
            (study / f"trial-{n}" / "end.json").write_text("{}")
    busy = layout.work / "tune" / "busy" / "trial-0"
    busy.mkdir(parents=True)
    (busy / "end.json").write_text("{}")

    holder = subprocess.Popen(  # another process's `enn tune` of study "busy"
        [sys.executable, "-c", HOLD, str(layout.work / "tune" / "busy.lock")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        planned = gc.plan(cfg, layout, now)
    finally:
        holder.kill()
        holder.wait()
    got = {r.path.relative_to(layout.work).as_posix(): r for r in planned.removals}
    assert set(got) == {"checkpoints/done", "checkpoints/stale", "tune/s/trial-0"}
    assert got["checkpoints/done"].size == 100
    assert gc.remove(cfg, layout, planned.removals) == {}
    assert sum(r.size for r in planned.removals) == 102  # the shard and the trial's end.json
    assert not (ckpt / "done").exists() and (ckpt / "left").exists() and (ckpt / "new").exists()
    assert (study / "trial-1").exists() and busy.exists()
