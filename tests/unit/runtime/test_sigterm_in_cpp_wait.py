"""SIGTERM stops a rank waiting for a peer within seconds, even inside a C++ store wait
(issue 38.7): the signal is taken by a helper thread, not only by the Python handler of the
blocked main thread."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from enn_core.runtime.launch import free_port

# a worker whose main thread installed a Python SIGTERM handler (as `enn` does) and waits in
# C++ for a key no peer will ever set
WORKER = """
import datetime, signal, sys
import torch.distributed as dist
from enn_core.runtime.sigterm import watch_sigterm

def stop(*_):
    raise SystemExit(143)

signal.signal(signal.SIGTERM, stop)
print("watching" if watch_sigterm(rank=1) else "not installed", flush=True)
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True,
                      timeout=datetime.timedelta(seconds=300), wait_for_workers=False)
print("waiting", flush=True)
store.get("the peer that never came")
"""


@pytest.mark.timeout(60)
def test_sigterm_stops_a_rank_blocked_in_a_store_wait():
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(free_port())],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "watching"
    assert proc.stdout.readline().strip() == "waiting"
    time.sleep(0.5)  # inside the C++ wait
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=30)
    assert time.time() - t0 < 10
    assert code == 143
    assert (
        "rank 1: SIGTERM while waiting in a collective or the store: stopped" in proc.stderr.read()
    )


# a worker training with a checkpointer (PreemptWatch, as the worker's loop) when the scheduler's
# SIGTERM arrives: its handler takes it, and the save that follows outlasts the helper's grace
SAVING = """
import signal, sys, time
from enn_core.runtime.sigterm import watch_sigterm
from enn_core.train.preempt import PreemptWatch

with PreemptWatch() as watch:
    print("watching" if watch_sigterm(rank=0, grace_s=0.5) else "not installed", flush=True)
    while not watch.requested:
        time.sleep(0.01)
    time.sleep(2.0)  # the step, then the checkpoint: longer than the grace
    print("saved", flush=True)
sys.exit(12)  # Preempted
"""


@pytest.mark.timeout(60)
def test_a_preemption_save_outlasting_the_grace_is_not_cut_short():
    """Before: the helper ended the rank 5 s after any SIGTERM, in the middle of the save its
    own handler had started (a large model's checkpoint takes longer)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SAVING], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "watching"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 12, proc.stderr.read()
    assert proc.stdout.read().strip() == "saved"
