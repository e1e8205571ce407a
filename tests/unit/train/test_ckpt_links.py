"""The shared checkpoint folder chooses nothing (issue 38.2): a fingerprint folder that is a
link is one line and nothing is written through it; a step folder planted as a link is
removed as a link (its target kept), never resumed from, never written into."""

from __future__ import annotations

import json

import pytest
import torch

from enn_core.config import CheckpointConfig
from enn_core.errors import ConfigError
from enn_core.train.ckpt import COMMITTED, Checkpointer, committed, step_name


def _precious(path):
    path.mkdir(parents=True)
    (path / COMMITTED).write_text(json.dumps({"files": {}}))
    (path / "keep.txt").write_text("precious")
    return path


def test_a_linked_fingerprint_folder_is_one_line_and_nothing_written(tmp_path):
    elsewhere = _precious(tmp_path / "elsewhere" / step_name(2)).parent
    (tmp_path / "ck").symlink_to(elsewhere)
    ck = Checkpointer(tmp_path / "ck", CheckpointConfig(), rank=0, distributed=False)
    with pytest.raises(ConfigError, match=r"ck is a link .*choose another checkpoint.dir"):
        ck.prepare(resume=False)
    assert sorted(p.name for p in elsewhere.iterdir()) == [step_name(2)]
    assert (elsewhere / step_name(2) / "keep.txt").exists()


def test_planted_step_links_are_removed_as_links_never_followed(tmp_path):
    root = tmp_path / "ck"
    root.mkdir()
    target = _precious(tmp_path / "outside" / "step")
    (root / step_name(4)).symlink_to(target)  # looks committed through the link
    tmp_target = (tmp_path / "outside" / "tmp").resolve()
    tmp_target.mkdir()
    (root / ".tmp-step-00000001-a0").symlink_to(tmp_target)
    ck = Checkpointer(root, CheckpointConfig(keep_last=1), rank=0, distributed=False)
    assert ck.prepare(resume=True) is None  # not resumed from the link
    assert not (root / step_name(4)).is_symlink() and (target / "keep.txt").exists()
    (root / ".tmp-step-00000001-a0").symlink_to(tmp_target)  # planted again before a save
    ck.save({"model": torch.nn.Linear(2, 2).state_dict()}, {"position": 1}, 1)
    assert list(tmp_target.iterdir()) == []  # nothing written through it
    assert [p.name for p in committed(root)] == [step_name(1)]
    (root / step_name(2)).symlink_to(target)
    ck.clear()
    assert (target / "keep.txt").exists() and not (root / step_name(2)).is_symlink()
