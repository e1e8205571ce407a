"""The multi-node rendezvous of the launcher: what its config needs (endpoint and id)."""

from __future__ import annotations

import pytest

from enn_core.config import load_config
from enn_core.errors import ConfigError
from enn_core.runtime.launch import Rendezvous


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
    the README's code for it), not a generic WorkerError (exit 9)."""
    from enn_core.errors import UntrustedCheckpointError
    from enn_core.runtime.launch import worker_error, write_error

    refused = UntrustedCheckpointError(f"{tmp_path}/step-3/.metadata: refers to posix.system")
    write_error(tmp_path, 0, refused, "resume", None, "Traceback ...")
    err = worker_error(tmp_path, None, watchdog=None)  # type: ignore[arg-type]
    assert type(err) is UntrustedCheckpointError and err.exit_code == 4
    assert f"{tmp_path}/step-3/.metadata: refers to posix.system" in str(err)
    assert "\n" not in str(err)
