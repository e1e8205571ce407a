"""The device mesh: FSDP on one dimension, HSDP on replicate x shard, and its errors."""

from __future__ import annotations

import pytest

from enn_core.errors import ConfigError
from enn_core.runtime.dist import mesh_layout


def test_hsdp_mesh_layout_and_its_errors():
    assert mesh_layout(4, 1) == ((4,), ("shard",))
    assert mesh_layout(4, 2) == ((2, 2), ("replicate", "shard"))
    with pytest.raises(
        ConfigError,
        match=r"hsdp_replicas=3 does not divide runtime.world_size=4; pick one of \[1, 2, 4\]",
    ):
        mesh_layout(4, 3)
    with pytest.raises(ConfigError, match="must be >= 1"):
        mesh_layout(4, 0)
