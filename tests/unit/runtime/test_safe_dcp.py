"""A distributed checkpoint is read without running code from it: a crafted `.metadata` and
a crafted byte item inside a `.distcp` shard are refused with one line naming the file, and
the same files loaded by torch's own reader do run their code (the hole this closes)."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path, PosixPath

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict

from enn_core.errors import UntrustedCheckpointError
from enn_core.runtime import safe_dcp

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Payload:
    """What an attacker pickles: its reduce runs a shell command when unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _checkpoint(path: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))
    return model, opt


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def test_a_genuine_checkpoint_loads(tmp_path):
    model, opt = _checkpoint(tmp_path / "ck")
    state = _state(model, opt)
    for t in state["model"].values():
        t.zero_()
    safe_dcp.load(state, tmp_path / "ck")
    assert any(float(t.abs().sum()) > 0 for t in state["model"].values())
    assert state["optim"]["param_groups"][0]["lr"] == pytest.approx(1e-3)


def test_crafted_metadata_is_refused_and_runs_nothing(tmp_path):
    model, opt = _checkpoint(tmp_path / "ck")
    marker = tmp_path / "MARKER"
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(UntrustedCheckpointError) as e:
        safe_dcp.load(_state(model, opt), tmp_path / "ck")
    assert "\n" not in str(e.value) and "ck/.metadata: refers to posix.system" in str(e.value)
    assert not marker.exists()
    with pytest.raises(CheckpointException):  # torch's own reader runs it, then fails on it
        dcp.load(_state(model, opt), checkpoint_id=str(tmp_path / "ck"))
    assert marker.exists(), "the crafted metadata did not run: the test proves nothing"


def test_crafted_byte_item_in_a_shard_is_refused_and_runs_nothing(tmp_path):
    model, opt = _checkpoint(tmp_path / "ck")
    marker = tmp_path / "MARKER"
    meta_path = tmp_path / "ck" / ".metadata"
    metadata = pickle.loads(meta_path.read_bytes())  # the test's own, genuine file
    fqn = "optim.param_groups.0.lr"
    assert isinstance(metadata.state_dict_metadata[fqn], BytesStorageMetadata)
    index = next(k for k in metadata.storage_data if k.fqn == fqn)
    info = metadata.storage_data[index]
    shard = tmp_path / "ck" / info.relative_path
    payload = io.BytesIO()
    torch.save(Payload(marker), payload)
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(payload.getvalue())
    metadata.storage_data[index] = type(info)(info.relative_path, offset, len(payload.getvalue()))
    meta_path.write_bytes(pickle.dumps(metadata))
    with pytest.raises(UntrustedCheckpointError) as e:
        safe_dcp.load(_state(model, opt), tmp_path / "ck")
    assert "\n" not in str(e.value) and f"item {fqn!r}: " in str(e.value)
    assert "refers to posix.system" in str(e.value)
    assert not marker.exists()
    dcp.load(_state(model, opt), checkpoint_id=str(tmp_path / "ck"))  # torch's own planner
    assert marker.exists(), "the crafted byte item did not run: the test proves nothing"


class GetattrPayload:
    """Python 3.11.0-3.11.4 pickle an enum member as `getattr(cls, name)`: the reader allows
    that lookup for the metadata's enum, never `getattr` to reach a method that writes."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (getattr, (PosixPath, "write_text"))  # PosixPath is allowed: paths are data


def test_getattr_reaches_only_the_metadatas_enum_members(tmp_path):
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    member = safe_dcp._enum_member(_MEM_FORMAT_ENCODING, "TORCH_CONTIGUOUS_FORMAT")
    assert member is _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT
    model, opt = _checkpoint(tmp_path / "ck")
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(GetattrPayload(tmp_path / "x")))
    with pytest.raises(UntrustedCheckpointError) as e:
        safe_dcp.load(_state(model, opt), tmp_path / "ck")
    assert "\n" not in str(e.value) and "ck/.metadata: not readable" in str(e.value)
