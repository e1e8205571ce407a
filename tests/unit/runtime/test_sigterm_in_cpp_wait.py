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
