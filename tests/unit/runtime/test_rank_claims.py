"""Two processes claiming one rank are named (issue 38.7), not left to hang in the group."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from enn_core.errors import ConfigError
from enn_core.runtime import dist
from enn_core.runtime.launch import free_port

FIRST = """
import sys, time
from enn_core.runtime import dist
store = dist._store(0, 0)
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_a_second_process_claiming_rank_0_is_one_line_naming_both(monkeypatch):
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "TORCHELASTIC_RUN_ID": "job-twice",
        "RANK": "0",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    first = subprocess.Popen(
        [sys.executable, "-c", FIRST], env=dict(os.environ), stdout=subprocess.PIPE, text=True
    )
    try:
        assert first.stdout.readline().strip() == "ready"
        with pytest.raises(ConfigError, match=r"two processes claim rank 0: .* pid \d+ and") as e:
            dist._store(0, 0)
        assert f"pid {first.pid} and" in str(e.value)
        assert f"pid {os.getpid()} (this one)" in str(e.value)
    finally:
        first.kill()
        first.wait()
