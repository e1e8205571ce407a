"""prepare-checkpoint's warm start: the weights of an earlier run (model.pt, init.pt or a
downloaded registry folder), refused with the differences named when the model config, the
vocabularies or the data schema do not match, and recorded in init.json when accepted.

Real tiny staged datasets (synthetic), the real stage `run`, real checkpoint files.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from enn_core.checkpoint import data_schema_differences, load_model, save_consolidated
from enn_core.errors import ConfigError
from enn_core.paths import Layout
from enn_core.stage import make_context
from enn_core.stages import PREPARE_CHECKPOINT
from enn_core.summaries import InitSummary
from tests.fixtures.train import staged_dir, tiny_cfg

pytestmark = pytest.mark.timeout(60)


def _project(root: Path, *data: str) -> Path:
    """A project root with staged synthetic data (`data` overrides its shape or seed)."""
    root.mkdir(parents=True, exist_ok=True)
    staged_dir(root, tiny_cfg(*data))
    return root


def _prepare(root: Path, *overrides: str) -> InitSummary:
    cfg = tiny_cfg(*overrides)
    ctx = make_context(cfg, Layout.for_root(root), PREPARE_CHECKPOINT, "r")
    return PREPARE_CHECKPOINT.work(cfg, ctx)


def _trained_model_pt(root: Path, dest: Path, *model: str) -> Path:
    """A model.pt as distributed-train writes it: weights moved away from the seeded init."""
    _prepare(root, *model)
    trained, _ = load_model(root / "outputs/prepare-checkpoint/init.pt")
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.01 * torch.randn_like(p))
    manifest = json.loads((root / "outputs/stage-data/manifest.json").read_text())
    meta = {
        "stage": "distributed-train",
        "epochs_run": 3,
        "global_step": 42,
        "loss_state": {"w": [1.0]},
    }
    return save_consolidated(dest / "model.pt", trained, tiny_cfg(*model).model, manifest, meta)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """An earlier run's model.pt, trained on the same tiny data (read-only: tests copy it)."""
    tmp = tmp_path_factory.mktemp("earlier")
    return _trained_model_pt(_project(tmp / "project"), tmp / "run")


def _outputs(root: Path) -> dict[str, bytes]:
    out = root / "outputs"
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_warm_start_copies_weights_and_records_source(tmp_path, source):
    root = _project(tmp_path / "now")
    got = _prepare(root, f"checkpoint.init_from={source}")
    init, ckpt = load_model(root / "outputs/prepare-checkpoint/init.pt")
    theirs = torch.load(source, weights_only=True)["state_dict"]
    mine = init.state_dict()
    assert set(mine) == set(theirs)
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    warm = json.loads((root / "outputs/prepare-checkpoint/init.json").read_text())["warm_start"]
    assert warm == got.warm_start
    assert warm["init_from"] == str(source) and warm["path"] == str(source)
    assert warm["sha256"] == hashlib.sha256(source.read_bytes()).hexdigest()
    assert warm["same_data"] is True and warm["data_fingerprint"] == got.data_fingerprint
    assert warm["meta"] == {"stage": "distributed-train", "epochs_run": 3, "global_step": 42}
    assert ckpt.meta["init_from"] == str(source)
    assert ckpt.meta["init_source_sha256"] == warm["sha256"]


def test_folder_source_other_compatible_data_recorded(tmp_path, source):
    download = tmp_path / "registry-download"  # where the task layer puts a model version
    download.mkdir()
    shutil.copy2(source, download / "model.pt")
    (download / "SOURCE").write_text("models:/enn-synthetic@champion\n")  # as materialize writes it
    root = _project(tmp_path / "now", "data.synthetic.seed=7")  # same schema, other values
    got = _prepare(root, "checkpoint.init_from=../registry-download")  # relative to the root
    warm = got.warm_start
    assert warm["path"] == str((download / "model.pt").resolve())
    assert (
        warm["init_from"] == "../registry-download" and warm["meta"]["stage"] == "distributed-train"
    )
    assert warm["registry_uri"] == "models:/enn-synthetic@champion"
    assert warm["same_data"] is False and warm["data_fingerprint"] != got.data_fingerprint
    fresh = _prepare(root)
    assert fresh.warm_start is None and fresh.init_from == "fresh"


def test_warm_start_with_a_neighbour_prior_keeps_this_datas_training_rows(tmp_path):
    """model.prior_weight: the network's weights come from the source, the prior's training
    rows from the data this run staged (another seed and one month more here)."""
    prior = ("model.prior_weight=0.5", "model.prior_group=month")
    source = _trained_model_pt(_project(tmp_path / "then"), tmp_path / "run", *prior)
    root = _project(tmp_path / "now", "data.synthetic.seed=7", "data.synthetic.n_months=5")
    _prepare(root, f"checkpoint.init_from={source}", *prior)
    init, _ = load_model(root / "outputs/prepare-checkpoint/init.pt")
    theirs = torch.load(source, weights_only=True)["state_dict"]
    mine = init.state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs if not k.startswith("prior."))
    fresh = _prepare(root, *prior)
    assert fresh.warm_start is None
    rows, _ = load_model(root / "outputs/prepare-checkpoint/init.pt")
    assert rows.prior is not None and init.prior is not None
    assert torch.equal(init.prior.keys, rows.prior.keys)  # this run's rows
    assert init.prior.n_rows != theirs["prior.keys"].shape[0]


def test_model_config_mismatch_names_every_field(tmp_path, source):
    root = _project(tmp_path / "now")
    with pytest.raises(ConfigError) as e:
        _prepare(root, f"checkpoint.init_from={source}", "model.d_model=32", "model.layers=1")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"checkpoint.init_from={source}")
    assert "model.d_model is 16 there, 32 here" in msg and "model.layers is 2 there, 1 here" in msg
    assert "checkpoint.init_from: ''" in msg  # the way out is named


def test_vocabulary_mismatch_names_feature_and_values(tmp_path, source):
    root = _project(tmp_path / "now", "data.synthetic.n_daytypes=3")
    with pytest.raises(ConfigError, match=r"feature daytype vocabulary: tue new here") as e:
        _prepare(root, f"checkpoint.init_from={source}")
    assert "another data schema" in str(e.value) and "model.d_model" not in str(e.value)
    assert "stage data of its schema" in str(e.value)


def test_label_shape_mismatch_names_shape_and_axis(tmp_path, source):
    root = _project(tmp_path / "now", "data.synthetic.n_sections=5")
    with pytest.raises(ConfigError) as e:
        _prepare(root, f"checkpoint.init_from={source}")
    assert "label_shape is [4, 6] there, [5, 6] here" in str(e.value)
    assert "label axis section values: s04 new here" in str(e.value)


def test_schema_differences_features_added_removed_kind_order():
    base = {
        "feature_specs": [
            {"name": "month", "kind": "categorical", "vocab": ["01", "02"], "cyclic_period": 12},
            {"name": "temp", "kind": "continuous", "mean": 1.0, "std": 2.0},
            {"name": "dir", "kind": "categorical", "vocab": ["up", "down"]},
        ],
        "label_shape": [2, 3],
        "label_axes": ["section", "hour"],
    }
    other = json.loads(json.dumps(base))
    other["feature_specs"][1] = {"name": "temp", "kind": "cyclic", "cyclic_period": 24}
    other["feature_specs"][2] = {"name": "wind", "kind": "continuous", "mean": 0.0, "std": 1.0}
    other["feature_specs"][0]["vocab"] = ["02", "01"]
    diffs = data_schema_differences(base, other)
    assert (
        "features dir there but not here" in diffs and "features wind here but not there" in diffs
    )
    assert "feature temp is continuous there, cyclic here" in diffs
    assert "feature month vocabulary: same values in another order (codes differ)" in diffs
    stats = json.loads(json.dumps(base))
    stats["feature_specs"][1].update(mean=5.0, std=9.0)  # new data's statistics: allowed
    assert data_schema_differences(base, stats) == []
    swapped = {**base, "feature_specs": base["feature_specs"][::-1]}
    assert data_schema_differences(base, swapped) == [
        "feature order is month, temp, dir there, dir, temp, month here"
    ]


def test_weights_that_do_not_load_strictly_are_refused(tmp_path, source):
    ckpt = torch.load(source, weights_only=True)
    name = next(iter(ckpt["state_dict"]))
    del ckpt["state_dict"][name]
    broken = tmp_path / "broken.pt"
    torch.save(ckpt, broken)
    with pytest.raises(
        ConfigError, match=rf"weights do not load into this model: weights {name} missing there"
    ):
        _prepare(_project(tmp_path / "now"), f"checkpoint.init_from={broken}")


def test_missing_or_unusable_source_says_where_and_what_to_do(tmp_path):
    root = _project(tmp_path / "now")
    with pytest.raises(
        ConfigError, match=rf"no consolidated checkpoint at {root}/nope.pt; give the path"
    ):
        _prepare(root, "checkpoint.init_from=nope.pt")
    (root / "empty").mkdir()
    with pytest.raises(ConfigError, match=rf"folder {root}/empty holds no model.pt"):
        _prepare(root, "checkpoint.init_from=empty")
    (root / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(
        ConfigError, match=r"checkpoint.init_from=junk.pt: .*junk.pt: not a readable"
    ):
        _prepare(root, "checkpoint.init_from=junk.pt")
    with pytest.raises(ConfigError, match="resolved by the task layer"):
        _prepare(root, "checkpoint.init_from=models:/enn-synthetic@champion")


def test_refused_warm_start_writes_nothing(tmp_path, source):
    root = _project(tmp_path / "now", "data.synthetic.n_daytypes=3")
    _prepare(root)
    before = _outputs(root)
    bad = [f"checkpoint.init_from={source}", "checkpoint.init_from=nope.pt"]
    for override in bad:
        with pytest.raises(ConfigError):
            _prepare(root, override)
    assert _outputs(root) == before
    leftovers = [p.name for p in (root / "outputs").iterdir() if p.name.startswith(".")]
    assert leftovers == []
    shutil.rmtree(root / "outputs/prepare-checkpoint")
    with pytest.raises(ConfigError):
        _prepare(root, bad[0])
    assert not (root / "outputs/prepare-checkpoint").exists()
