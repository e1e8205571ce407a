"""Schema check of a features-only dataset against the model's data spec."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from enn_core.data.manifest import DataSpec
from enn_core.errors import DataError
from enn_core.predict.schema import check_labels, check_schema

MONTHS = [f"{m:02d}" for m in range(1, 13)]
SPECS = [
    {"name": "month", "kind": "categorical", "vocab": MONTHS, "cyclic_period": 12},
    {"name": "daytype", "kind": "categorical", "vocab": ["Sun", "Mon"]},
    {"name": "temp", "kind": "continuous", "mean": 12.0, "std": 4.0},
]
MODEL = {"feature_specs": SPECS}


def _x(rows):
    return np.array(rows, dtype=np.float32)


def test_matching_schema_passes():
    check_schema({"feature_specs": SPECS}, _x([[0, 1, 3.5], [11, 0, -2.0]]), MODEL, "in")


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda s: s.reverse(),
            r"in: features are \['temp', 'daytype', 'month'\] but the model expects the order",
        ),
        (lambda s: s.pop(), r"missing \['temp'\]"),
        (
            lambda s: s[2].update(kind="categorical"),
            r"feature 'temp' is categorical but the model expects continuous",
        ),
        (
            lambda s: s[1].update(vocab=["Mon", "Sun"]),
            r"feature 'daytype' vocabulary differs .* code 0 \('Mon' vs 'Sun'\)",
        ),
        (lambda s: s[0].update(cyclic_period=None), r"feature 'month' has cyclic period None"),
    ],
)
def test_spec_mismatch_is_one_clear_line(edit, message):
    specs = copy.deepcopy(SPECS)
    edit(specs)
    with pytest.raises(DataError, match=message) as e:
        check_schema({"feature_specs": specs}, _x([[0, 0, 0.0]])[:, : len(specs)], MODEL, "in")
    assert "\n" not in str(e.value)


def test_unseen_category_names_row_feature_and_value():
    specs = copy.deepcopy(SPECS)
    specs[1]["vocab"] = ["Sun", "Mon", "Holiday"]  # staged data extended the vocabulary
    x = _x([[0, 1, 1.0], [3, 0, 1.0], [4, 2, 1.0]])
    with pytest.raises(
        DataError,
        match=r"in: row 2, feature 'daytype': category 'Holiday' was not seen in training",
    ):
        check_schema({"feature_specs": specs}, x, MODEL, "in")


@pytest.mark.parametrize("bad", [12.0, -1.0, 0.5, float("nan")])
def test_codes_outside_the_vocabulary_are_refused(bad):
    with pytest.raises(
        DataError, match=r"row 1, feature 'month': code .* outside the model's vocabulary of 12"
    ):
        check_schema({"feature_specs": SPECS}, _x([[0, 0, 1.0], [bad, 0, 1.0]]), MODEL, "in")


def test_feature_count_must_match():
    with pytest.raises(DataError, match=r"shape \[1, 4\] but the model expects \[N, 3\]"):
        check_schema({"feature_specs": SPECS}, _x([[0, 0, 1.0, 2.0]]), MODEL, "in")


def test_a_model_of_other_labels_is_another_task():
    """A features-only dataset carries its training data's label shape; a model of the same
    features but other labels is refused before anything is predicted."""
    data = {"feature_specs": SPECS, "label_shape": [4, 6], "training_manifest": "t/manifest.json"}
    check_labels(data, {**MODEL, "label_shape": [4, 6]}, "in")
    with pytest.raises(DataError) as e:
        check_labels(data, {**MODEL, "label_shape": [3, 6]}, "in")
    assert str(e.value).startswith(
        "in: the model predicts labels of shape [3, 6] but this task's are [4, 6] (staged "
        "against t/manifest.json): it is a model of another task"
    )
    assert "\n" not in str(e.value)


def test_the_checks_read_a_checkpoints_data_spec_as_its_mapping():
    """The model's side as the checkpoint holds it in memory (a DataSpec), the same verdicts."""
    data = {"feature_specs": SPECS, "label_shape": [4, 6], "training_manifest": "t/manifest.json"}
    check_labels(data, DataSpec.of({**MODEL, "label_shape": [4, 6]}), "in")
    with pytest.raises(DataError, match=r"shape \[3, 6\] but this task's are \[4, 6\]"):
        check_labels(data, DataSpec.of({**MODEL, "label_shape": [3, 6]}), "in")
    check_schema(data, _x([[0, 1, 3.5]]), DataSpec.of(MODEL), "in")
    with pytest.raises(DataError, match="expects"):
        check_schema(data, _x([[0, 1, 3.5, 1.0]]), DataSpec.of(MODEL), "in")
