"""enn_core/tensor_file.py: every tensor file from outside is read without running code, and a
refusal is one line naming the file. Driven through the readers that use it (the saved
non-finite batch's replay, a rank's RNG state) and the loader itself on damaged files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from enn_core.errors import StaleOutputError, UntrustedCheckpointError
from enn_core.tensor_file import load_tensors


class Shell:
    """What an attacker pickles: unpickling it runs a shell command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _refused_in_one_line(err: pytest.ExceptionInfo, path: Path, marker: Path) -> str:
    msg = str(err.value)
    assert not marker.exists(), "the crafted file ran code"
    assert "\n" not in msg and "weights_only" not in msg, msg
    assert msg.startswith(f"{path}: holds something other than tensors"), msg
    assert "posix.system" in msg and "nothing in it ran" in msg, msg
    return msg


def test_a_crafted_saved_batch_is_refused_by_the_replay(tmp_path):
    from enn_core.model.enn import ENN  # noqa: F401 - the replay's model type, imported as it is
    from enn_core.train.guard import replay_loss

    marker, path = tmp_path / "MARKER", tmp_path / "nonfinite-batch.pt"
    torch.save({"state_dict": None, "features": [Shell(marker)], "labels": [], "weights": []}, path)
    with pytest.raises(UntrustedCheckpointError) as e:
        replay_loss(path, torch.nn.Linear(1, 1), torch.nn.MSELoss())  # type: ignore[arg-type]
    assert "delete it" in _refused_in_one_line(e, path, marker)


def test_a_crafted_rng_state_is_refused(tmp_path):
    marker, path = tmp_path / "MARKER", tmp_path / "rng-rank0.pt"
    torch.save({"torch": Shell(marker)}, path)
    with pytest.raises(UntrustedCheckpointError) as e:
        load_tensors(path, name=str(path), what="RNG state", fix="delete it")
    _refused_in_one_line(e, path, marker)


@pytest.mark.parametrize("damage", ["truncated", "not a zip", "empty"])
def test_a_damaged_file_names_itself_what_it_should_be_and_the_fix(tmp_path, damage):
    path = tmp_path / "model.pt"
    torch.save({"w": torch.ones(64)}, path)
    data = path.read_bytes()
    path.write_bytes(
        {"truncated": data[: len(data) // 2], "not a zip": b"hello world", "empty": b""}[damage]
    )
    with pytest.raises(StaleOutputError) as e:
        load_tensors(path, name=str(path), what="consolidated checkpoint", fix="re-train")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{path}: not a readable consolidated checkpoint")
    assert msg.endswith("re-train"), msg


def test_plain_tensors_and_values_load(tmp_path):
    path = tmp_path / "ok.pt"
    torch.save({"w": torch.arange(3), "n": 2, "s": "x", "l": [1.5, None]}, path)
    out = load_tensors(path, name=str(path), what="file", fix="-")
    assert torch.equal(out["w"], torch.arange(3)) and out["l"] == [1.5, None]


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.binary(max_size=512), prefix=st.sampled_from([b"", b"\x80\x02", b"PK\x03\x04"]))
def test_random_bytes_are_refused_with_one_line_never_a_traceback(tmp_path, data, prefix):
    path = tmp_path / "random.pt"
    path.write_bytes(prefix + data)
    try:
        load_tensors(path, name=str(path), what="file", fix="re-train")
    except StaleOutputError as e:  # UntrustedCheckpointError is one too
        assert "\n" not in str(e) and str(e).startswith(str(path)), str(e)
