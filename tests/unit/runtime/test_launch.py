"""The multi-node rendezvous of the launcher: what its config needs (endpoint and id)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from enn_core.config import load_config
from enn_core.errors import ConfigError
from enn_core.runtime.launch import Rendezvous, worker_error
from enn_core.runtime.parent import PARENT_ENV


def test_multi_node_config_needs_endpoint_and_id():
    ok = ["runtime.nnodes=2", "runtime.rdzv_endpoint=node0:29400", "runtime.rdzv_id=job42"]
    rt = load_config(None, ok).runtime
    assert Rendezvous.of(rt) == Rendezvous(
        nnodes=2, endpoint="node0:29400", run_id="job42", timeout_s=rt.rdzv_timeout_s
    )
    with pytest.raises(ConfigError, match="runtime.nnodes=2 needs runtime.rdzv_endpoint"):
        load_config(None, ok[:2])
    with pytest.raises(ConfigError, match="is not host:port"):
        load_config(None, ["runtime.rdzv_endpoint=node0"])
    with pytest.raises(ConfigError, match="needs runtime.rdzv_endpoint"):
        Rendezvous(nnodes=3)


def test_a_workers_refused_checkpoint_reaches_the_caller_as_itself(tmp_path):
    """A rank that refused a crafted checkpoint file: the launcher raises the same class (exit 4,
    the documented code for it), not a generic WorkerError (exit 9)."""
    from enn_core.errors import UntrustedCheckpointError
    from enn_core.runtime.launch import write_error

    refused = UntrustedCheckpointError(f"{tmp_path}/step-3/.metadata: refers to posix.system")
    write_error(tmp_path, 0, refused, "resume", None, "Traceback ...")
    err = worker_error(tmp_path, None, watchdog=None)  # type: ignore[arg-type]
    assert type(err) is UntrustedCheckpointError and err.exit_code == 4
    assert f"{tmp_path}/step-3/.metadata: refers to posix.system" in str(err)
    assert "\n" not in str(err)


def test_the_torchrun_child_gets_a_clean_environment_and_forwards_the_schedulers_signals(
    tmp_path, monkeypatch
):
    """What enn gives torchrun: no previous job's variables, torch's C++ logs at ERROR (the
    c10d hostname lines), the job secret's variable passed through; torchrun forwards SIGTERM
    and SIGUSR2 to the workers, never SIGUSR1 (the stack dump), and waits its shutdown time."""
    from enn_core.runtime.launch import SHUTDOWN_TIMEOUT_S, child_env, entry_of
    from enn_core.runtime.torchrun import argv_of

    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "old-job")
    secret = tmp_path / "secret"
    secret.write_text("0123456789abcdef0123456789abcdef\n")
    secret.chmod(0o600)
    monkeypatch.setenv("ENN_JOB_SECRET_FILE", str(secret))
    env = child_env(tmp_path, 1)
    assert "RANK" not in env and "TORCHELASTIC_RUN_ID" not in env
    assert env["TORCH_CPP_LOG_LEVEL"] == "ERROR"
    assert env["ENN_JOB_SECRET_FILE"] == str(secret)
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in env
    assert env[PARENT_ENV] == str(os.getpid())  # torchrun's die_with_parent knows its parent
    assert child_env(tmp_path, 2)["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"

    # none configured: one node gets its work directory's own (0600), several are refused
    monkeypatch.delenv("ENN_JOB_SECRET_FILE")
    run_dir = tmp_path / "work" / "runs" / "job1" / "distributed-train"
    made = Path(child_env(run_dir, 1)["ENN_JOB_SECRET_FILE"])
    assert made == tmp_path / "work" / "job-secret" and made.stat().st_mode & 0o777 == 0o600
    assert child_env(run_dir, 1)["ENN_JOB_SECRET_FILE"] == str(made)  # reused: parts stay valid
    with pytest.raises(ConfigError, match="needs a job secret in ENN_JOB_SECRET_FILE"):
        child_env(run_dir, 2)
    secret.chmod(0o644)
    monkeypatch.setenv("ENN_JOB_SECRET_FILE", str(secret))
    with pytest.raises(ConfigError):  # readable by others: refused before anything starts
        child_env(run_dir, 1)

    job = {
        "run_dir": str(tmp_path),
        "nprocs": 2,
        "max_restarts": 1,
        "shutdown_timeout_s": SHUTDOWN_TIMEOUT_S,
        "liveness_timeout_s": 60.0,
        "rendezvous": Rendezvous().resolved().__dict__,
    }
    argv = argv_of(job, tmp_path / "job.json")
    signals = next(a for a in argv if a.startswith("--signals-to-handle=")).split("=")[1]
    assert {"SIGTERM", "SIGUSR2"} <= set(signals.split(",")) and "SIGUSR1" not in signals
    assert f"--shutdown-timeout={int(SHUTDOWN_TIMEOUT_S)}" in argv
    assert argv[-3:] == ["--module", "enn_core.runtime.entry", str(tmp_path / "job.json")]
    assert "--local-addr=127.0.0.1" in argv  # one node: the workers' store on loopback
    # a node silent past runtime.hang_timeout_s is named by the others (enn_core.runtime.stores)
    conf = next(a for a in argv if a.startswith("--rdzv-conf=")).split("=", 1)[1]
    assert "liveness_timeout=60" in conf.split(",")

    assert entry_of(worker_error) == "enn_core.runtime.watchdog:worker_error"
    with pytest.raises(TypeError, match="module-level function"):
        entry_of(lambda: None)


def test_a_node_cut_off_from_its_store_is_told_what_to_do(tmp_path):
    """torchrun's record `cut_off` (enn_core.runtime.liveness ended the agent of a node that
    lost the rendezvous store mid-job) reaches the user as a transient error naming the line,
    the endpoint and the way back; so does `peer_silent` (this node's workers were killed
    because a peer went silent: not a crash, not the kernel's OOM killer); the other records
    keep their own words."""
    from enn_core.errors import TransientError
    from enn_core.runtime.launch import Job

    rdzv = Rendezvous(nnodes=2, endpoint="node1:29400", run_id="job-7")
    job = Job("enn_core.runtime.watchdog:worker_error", [], 1, tmp_path, 0, rdzv)
    line = "the rendezvous store at node1:29400 is still unreachable and torch's agent ..."
    err = job.rendezvous_error({"state": "cut_off", "exits": {}, "message": line})
    assert isinstance(err, TransientError)
    assert line in str(err) and "network to node1:29400" in str(err)
    assert "run the same command on every node again" in str(err)
    silent = "node node2 (node rank 1, global ranks 1) went silent: no liveness beat for 17 s"
    err = job.rendezvous_error({"state": "peer_silent", "exits": {"0": -9}, "message": silent})
    assert isinstance(err, TransientError)
    assert silent in str(err) and "run the same command on every node again" in str(err)
    missed = job.rendezvous_error({"state": "rendezvous_error", "exits": {}, "message": "x"})
    assert "start all 2 nodes within runtime.rdzv_timeout_s" in str(missed)
    assert job.rendezvous_error({"state": "failed", "exits": {"0": 1}, "message": ""}) is None
