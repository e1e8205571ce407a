"""A model folder's calibration.json is data (a registered model downloaded from the store, a
colleague's folder): the names it gives for the affine arrays choose nothing. The arrays are
the folder's own slope.npy and intercept.npy, read only as plain files: a link there, or a
pipe that would hold the load forever, is one DataError."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from enn_core.errors import DataError
from enn_core.inference import Calibration, load_calibration, write_calibration


@pytest.fixture
def folder(tmp_path):
    d = tmp_path / "model" / "collapse-check"
    d.mkdir(parents=True)
    ones = np.ones((2, 3), dtype=np.float32)
    write_calibration(d, Calibration("calibrated", "fp32", ones * 0.5, ones), {})
    secret = tmp_path / "elsewhere" / "secret.npy"
    secret.parent.mkdir()
    np.save(secret, np.full((2, 3), 99.0, dtype=np.float32))
    return d, secret


@pytest.mark.parametrize("named", ["ABS", "../../elsewhere/secret.npy"])
def test_the_names_in_calibration_json_choose_no_file(folder, named):
    d, secret = folder
    meta = json.loads((d / "calibration.json").read_text())
    named = str(secret) if named == "ABS" else named
    meta["affine"] = {"slope_file": named, "intercept_file": named}
    (d / "calibration.json").write_text(json.dumps(meta))
    cal, _ = load_calibration(d)
    assert cal.slope is not None and float(cal.slope.max()) == 0.5
    assert cal.intercept is not None and float(cal.intercept.max()) == 1.0


@pytest.mark.parametrize("planted", ["link", "pipe"])
def test_a_link_or_a_pipe_in_place_of_an_array_is_one_line(folder, planted):
    d, secret = folder
    (d / "slope.npy").unlink()
    if planted == "link":
        (d / "slope.npy").symlink_to(secret)
    else:
        os.mkfifo(d / "slope.npy")
    with pytest.raises(DataError, match=r"slope.npy is a link or not a plain file"):
        load_calibration(d)


def test_a_record_that_is_not_an_object_is_one_line(folder):
    from enn_core.errors import StaleOutputError

    d, _ = folder
    (d / "calibration.json").write_text("[1, 2]")
    with pytest.raises(StaleOutputError, match=r"calibration.json: not a calibration record"):
        load_calibration(d)
