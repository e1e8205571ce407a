"""The collectives' interface (enn_core.runtime.network) and the external launcher's
variables (enn_core.runtime.external): what a cluster gets wrong first, refused in one line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from enn_core.config import load_config
from enn_core.errors import ConfigError
from enn_core.runtime import network
from enn_core.runtime.external import LauncherEnv
from tests.fixtures.project import ROOT

TORCHRUN_ENV = {
    "RANK": "1",
    "LOCAL_RANK": "0",
    "WORLD_SIZE": "4",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "node1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "job42",
    "TORCHELASTIC_RESTART_COUNT": "1",
    "TORCHELASTIC_MAX_RESTARTS": "3",
}


@pytest.fixture
def no_gloo_env(monkeypatch):
    monkeypatch.delenv(network.GLOO, raising=False)
    monkeypatch.delenv(network.NCCL, raising=False)


def test_one_node_keeps_its_collectives_on_loopback(no_gloo_env):
    choice = network.choose_interface("", "", 1)
    assert "127.0.0.1" in network.interfaces()[choice.name]
    choice.apply()
    assert os.environ[network.GLOO] == choice.name == os.environ[network.NCCL]


def test_a_named_interface_must_exist_on_this_host(no_gloo_env):
    lo = network.choose_interface("", "", 1).name
    assert network.choose_interface(lo, "", 2).name == lo
    with pytest.raises(ConfigError, match=r"runtime.socket_ifname='ib7': this host has no such"):
        network.choose_interface("ib7", "", 2)


def test_several_nodes_refuse_an_address_the_others_cannot_reach(no_gloo_env):
    """Debian's hosts file maps the hostname to 127.0.1.1: every node would offer loopback."""
    with pytest.raises(ConfigError, match=r"runtime.local_addr '127.0.1.1' resolves to .*loopback"):
        network.choose_interface("", "127.0.1.1", 2)
    with pytest.raises(ConfigError, match=r"resolves to 192.0.2.7, which no interface"):
        network.choose_interface("", "192.0.2.7", 2)
    with pytest.raises(ConfigError, match=r"cannot resolve 'no-such-host.invalid'"):
        network.choose_interface("", "no-such-host.invalid", 2)


def test_an_interface_the_environment_names_is_kept(monkeypatch):
    monkeypatch.setenv(network.GLOO, "eth7")
    choice = network.choose_interface("", "", 2)
    assert (choice.name, choice.reason) == ("eth7", "GLOO_SOCKET_IFNAME from the environment")


def test_the_launchers_variables_become_recorded_overrides():
    launched = LauncherEnv.from_env(TORCHRUN_ENV)
    assert launched is not None and (launched.rank, launched.nnodes) == (1, 2)
    cfg = load_config(None, launched.overrides())
    rt = cfg.runtime
    assert (rt.launcher, rt.nnodes, rt.world_size, rt.max_restarts, rt.rdzv_id) == (
        "external",
        2,
        2,
        3,
        "job42",
    )
    assert LauncherEnv.from_env({k: v for k, v in TORCHRUN_ENV.items() if k != "RANK"}) is None


def test_the_worker_entry_outside_a_launcher_is_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    out = subprocess.run(
        [sys.executable, "-m", "flows.worker"],
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("error: runtime.launcher=external: no launcher started this")
    assert "torchrun ... -m flows.worker" in out.stderr and out.stderr.count("\n") == 1


def test_distributed_train_inside_a_launchers_worker_refuses_to_nest(tmp_path, monkeypatch):
    """`torchrun ... enn distributed-train` would start a job in every worker: refused."""
    from enn_core.train.stage import start_workers

    for k, v in TORCHRUN_ENV.items():
        monkeypatch.setenv(k, v)
    cfg = load_config(None, [])
    with pytest.raises(ConfigError, match=r"inside a worker that a launcher started.*flows.worker"):
        start_workers(cfg, None, tmp_path / "job.json", 1, tmp_path / "init.pt")  # type: ignore[arg-type]
