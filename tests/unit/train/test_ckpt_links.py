"""The shared checkpoint folder chooses nothing (issue 38.2): a fingerprint folder that is a
link is one line and nothing is written through it; a step folder planted as a link is
removed as a link (its target kept), never resumed from, never written into."""

from __future__ import annotations

import json
import os

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


def _planted_temp(root, position, how):
    """A checkpoint's temporary folder planted before the save, holding a link to a file
    outside: group-writable, or another user's (0755, so enn could not have emptied it)."""
    tmp = root / f".tmp-{step_name(position)}-a0"
    tmp.mkdir()
    victim = root.parent / "victim.txt"
    victim.write_text("precious")
    (tmp / "rng-rank0.pt").symlink_to(victim)
    if how == "group-writable":
        tmp.chmod(0o777)
    else:
        os.chown(tmp, 1235, 1235)
    return victim


@pytest.mark.parametrize("how", ["group-writable", "another user's"])
def test_a_temp_folder_planted_before_a_save_is_never_written_into(tmp_path, how, monkeypatch):
    """The attacker's review: a `.tmp-step-<pos>-a<attempt>` folder planted in the shared
    folder (another user's, which enn cannot even remove) with a link inside was reused and
    written through. The folder a save writes is named at random by rank 0 now."""
    if how == "another user's" and os.geteuid() != 0:
        pytest.skip("planting another user's folder needs root (CI and the dev machine are)")
    from enn_core.train import ckpt

    root = tmp_path / "ck"
    ck = Checkpointer(root, CheckpointConfig(), rank=0, distributed=False)
    ck.prepare(resume=False)
    victim = _planted_temp(root, 3, how)
    monkeypatch.setattr(ckpt, "remove", lambda p: None)  # as enn could not remove it
    ck.prepare(resume=True)
    ck.save({"model": torch.nn.Linear(2, 2).state_dict()}, {"position": 3}, 3)
    assert victim.read_text() == "precious" and not victim.is_symlink()
    assert [p.name for p in committed(root)] == [step_name(3)]


@pytest.mark.parametrize("planted", ["link", "file", "group-writable"])
def test_a_temp_folder_that_is_not_one_only_its_owner_writes_is_one_line(tmp_path, planted):
    from enn_core.atomic import own_folder

    path = tmp_path / ".tmp-step-00000003-a0-0123"
    if planted == "link":
        (tmp_path / "elsewhere").mkdir()
        path.symlink_to(tmp_path / "elsewhere")
    elif planted == "file":
        path.write_text("x")
    else:
        path.mkdir()
        path.chmod(0o777)
    with pytest.raises(ConfigError, match=r"is not a folder only its owner writes"):
        own_folder(path, "choose another checkpoint.dir")
    assert own_folder(tmp_path / "fresh", "x").stat().st_mode & 0o777 == 0o755 & ~_umask()


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old


@pytest.mark.parametrize("name", ["../victim.txt", "ABS", None])
def test_committed_names_only_files_of_its_own_folder(tmp_path, name):
    """Its hashes match, but the names lead out of the step folder (or are no mapping)."""
    from enn_core.data.hashing import hash_files
    from enn_core.train.ckpt import corrupt_files

    step = tmp_path / step_name(1)
    step.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("x")
    name = str(victim) if name == "ABS" else name
    files = {name: hash_files([victim])} if name else [hash_files([victim])]
    (step / COMMITTED).write_text(json.dumps({"files": files}))
    assert corrupt_files(step) == ([name] if name else [COMMITTED])


@pytest.mark.parametrize("planted", ["folder", "file"])
def test_a_node_without_rank_0_publishes_no_file_a_link_chose(tmp_path, planted):
    """rank 0's outputs reach the other nodes through `<checkpoint.dir>/published/`: a link
    there (the folder, or one of its files) would choose which file becomes this node's
    model.pt. It is one line, and nothing is published."""
    from types import SimpleNamespace

    from enn_core.config import load_config
    from enn_core.errors import DataError
    from enn_core.paths import Layout
    from enn_core.stage import make_context
    from enn_core.stages import DISTRIBUTED_TRAIN
    from enn_core.train.job import SHARED_OUTPUTS
    from enn_core.train.stage import WORKER_OUTPUTS, publish_shared

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for name in WORKER_OUTPUTS:
        (elsewhere / name).write_text("{}")
    published = tmp_path / "ck" / SHARED_OUTPUTS
    if planted == "folder":
        published.parent.mkdir()
        published.symlink_to(elsewhere)
    else:
        published.mkdir(parents=True)
        for name in WORKER_OUTPUTS:
            (published / name).symlink_to(elsewhere / name)
    layout = Layout(root=tmp_path, work=tmp_path / "work")
    ctx = make_context(load_config(None, []), layout, DISTRIBUTED_TRAIN, "r1")
    job = SimpleNamespace(checkpoint=SimpleNamespace(dir=tmp_path / "ck"))
    with pytest.raises((ConfigError, DataError), match=r"is a link"):
        publish_shared(ctx, job)
    assert not ctx.output().exists()
