"""`enn tune --apply` did not say that the study ran under other --set values (2 epochs) than
the params file (3): the winner, written into params.yaml, then trained with 3."""

from __future__ import annotations

from pathlib import Path

from enn_core.paths import Layout


def test_apply_says_which_set_values_the_study_ran_with(tmp_path: Path):
    from flows.tuning import read_sets, record_sets, sets_note

    params = tmp_path / "params.yaml"
    params.write_text("train:\n  epochs: 3\n  lr: 0.01\n")
    layout = Layout.for_root(tmp_path)
    sets = ["train.epochs=2", "train.lr=0.01", "runtime.seed=4", "tune.trials=8"]
    record_sets(layout, "params", params, sets)
    assert read_sets(layout, "params") == ["train.epochs=2", "train.lr=0.01"]
    (line,) = sets_note(params, read_sets(layout, "params"))
    assert line.startswith("note: the study ran with --set train.epochs=2; params.yaml has ")
    assert "train.epochs 3" in line and "lr" not in line, line
    assert sets_note(params, ["train.epochs=3"]) == []  # the file holds what the study used
    assert read_sets(layout, "other") == []
    record_sets(layout, "../escape", params, sets)  # a study name is never a path
    assert not (tmp_path / "work" / "escape.sets.json").exists()
