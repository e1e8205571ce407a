"""Rank 0 alone publishes (issue 38.3): under an external launcher a process with RANK != 0
runs only the stages whose work every rank shares; any other stage is one line, nothing
written under outputs/."""

from __future__ import annotations

import pytest

from tests.fixtures.cli import enn

LAUNCHER = {
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29999",
}


@pytest.mark.parametrize("stage", ["validate", "export", "collapse-check", "stage-data"])
def test_rank_1_of_an_external_launcher_refuses_a_publishing_stage(tmp_path, monkeypatch, stage):
    (tmp_path / "params.yaml").write_text("{}\n")
    out = tmp_path / "outputs" / stage
    out.mkdir(parents=True)
    (out / "kept.json").write_text("{}")
    for k, v in {**LAUNCHER, "RANK": "1", "TORCHELASTIC_RUN_ID": "job-1"}.items():
        monkeypatch.setenv(k, v)
    code, lines = enn(tmp_path, stage, "--set", "runtime.launcher=external")
    assert code == 2, lines
    assert any(
        f"{stage} runs on global rank 0 alone" in line and "RANK=1" in line for line in lines
    ), lines
    assert sorted(p.name for p in out.iterdir()) == ["kept.json"]
    assert sorted(p.name for p in (tmp_path / "outputs").iterdir()) == [stage]
