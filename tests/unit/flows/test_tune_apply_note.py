"""`enn tune --apply` did not say that the study ran under other --set values (2 epochs) than
the params file (3): the winner, written into params.yaml, then trained with 3. The values a
trial trained under are in the study itself (each trial's `enn.sets`), so `--apply` on any
host that shares the study says the same."""

from __future__ import annotations

from pathlib import Path


def test_apply_says_which_set_values_the_study_ran_with(tmp_path: Path):
    from flows.tuning import pipeline_sets, sets_note

    params = tmp_path / "params.yaml"
    params.write_text("train:\n  epochs: 3\n  lr: 0.01\n")
    sets = ["train.epochs=2", "train.lr=0.01", "runtime.seed=4", "tune.trials=8", "no-equals"]
    assert pipeline_sets(sets) == ["train.epochs=2", "train.lr=0.01"]
    (line,) = sets_note(params, pipeline_sets(sets))
    assert line.startswith("note: the study ran with --set train.epochs=2; params.yaml has ")
    assert "train.epochs 3" in line and "lr" not in line, line
    assert sets_note(params, ["train.epochs=3"]) == []  # the file holds what the study used
    # the study is another host's data: no terminal escape, no key the config lacks, bounded
    hostile = ["train.epochs=2\x1b]0;owned\x07", "train.nonsense=1", "train.lr=" + "9" * 5000]
    assert pipeline_sets(hostile) == []
    assert pipeline_sets(["train.epochs=2"] * 10_000) == ["train.epochs=2"] * 64


def test_the_best_trials_set_values_come_from_the_study_and_are_data(tmp_path: Path):
    import optuna

    from tasks.tuning import store

    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 's.db'}")
    for attr in (["train.epochs=2"], "train.epochs=2", ["train.epochs=2", 7], None):
        trial = study.ask()
        if attr is not None:
            trial.set_user_attr(store.SETS_ATTR, attr)
        study.tell(trial, 1.0)
    assert store.sets_of(study, 0) == ["train.epochs=2"]
    assert store.sets_of(study, 1) == [] and store.sets_of(study, 2) == []  # not a list of strings
    assert store.sets_of(study, 3) == [] and store.sets_of(study, 99) == []  # none, no such trial
