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
