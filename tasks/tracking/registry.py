"""The exported model in MLflow's registry: logged model, version, aliases, the champion rule.

After export succeeds, `register` logs the model (pyfunc through tasks/tracking/pyfunc.py,
with the `onnx` flavor beside it) as a logged model of the export stage's run, and registers
it as a new version of the task's registered model (`TrackingConfig.model_name`):

- alias `candidate`: every registered version (export only runs after collapse-check passed);
- alias `champion`: one rule (RULE; docs/serving.md, "Which version is the champion"): a
  version becomes champion when it beats the champion on its own validation rows (the first
  version: there is none to beat) and either passes the rule against the baselines or the
  champion did not pass it either. The rule against the baselines: it beats every naive
  predictor (the per-key and per-cell means and medians; the best named in the tags as
  `enn.naive_predictor`) and every fitted baseline validate scored (ridge, gbt) on its
  validation rows by tasks/tracking/champion_rule.py (a paired bootstrap of per-row absolute
  errors on at least 30 rows). The champion is scored on the candidate's validation rows
  through its own prediction path (enn_core/challenge.py), so a retrain on refreshed data
  (another fingerprint, the same columns) can promote. So a first version that does not pass
  is champion (the prediction flow resolves @champion) until a better one does or, while none
  passes, until a better one comes, with a warning naming what beat it. The version's tags
  say why, with the numbers (`enn.champion_decision`), whether it passes
  (`enn.passes_rule`), and the rule (`enn.champion_rule`).

A model of another task (other features, label shape; no category in common) is not
registered under this name: the result says so, naming `tracking.registered_model`.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from enn_core.challenge import SchemaClash, Score, schema, score_split, split_errors
from enn_core.checkpoint import DataSpec
from enn_core.collapse.report import read_report
from enn_core.data.dataset import StagedDataset
from enn_core.data.manifest import read_manifest
from enn_core.metric_names import (
    LEGACY_PROMOTION_BASELINE,
    PROMOTION_BASELINE,
    PROMOTION_METRIC,
    four,
)
from enn_core.metrics import NAIVE_HOW, best_naive
from enn_core.onnx_program import onnx_files
from enn_core.paths import Layout
from enn_core.serving import TableModel
from enn_core.stages import COLLAPSE_CHECK, DISTRIBUTED_TRAIN, EXPORT, STAGE_DATA, TRAINING
from tasks.tracking import pyfunc
from tasks.tracking.champion_rule import RULE, Comparison, judge, row_errors
from tasks.tracking.champion_rule import verdict as rule_verdict

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

    from enn_core.config import ValidateConfig

CHAMPION, CANDIDATE = "champion", "candidate"
DECISION, PASSES_RULE = "enn.champion_decision", "enn.passes_rule"  # version tags
ERROR_CHUNK_CELLS = 2_000_000  # label numbers baseline_errors reads at once (float64: 16 MB)
DESCRIPTION = (
    "The prediction path in real units. pyfunc: a DataFrame of the training features' raw "
    "columns in, one named column per label cell out (a built-in ENN preset runs eagerly; "
    "your own module, model.preset custom, runs its ONNX program); ONNX and torch.export "
    "beside it (data/enn/)."
)


@dataclass(frozen=True)
class Registration:
    """What registering one export gave (the stage's result, the run's tags, the CLI's line)."""

    model: str
    registered: bool
    reason: str  # why (not) champion, or why not registered
    version: int | None = None
    champion: bool = False
    model_uri: str = ""  # models:/<model_id>: the logged model
    model_id: str = ""
    val_mae: float | None = None  # the candidate's, on its validation rows
    champion_val_mae: float | None = None  # the previous champion's, on the same rows
    naive_val_mae: float | None = None
    naive_predictor: str | None = None  # which naive predictor naive_val_mae is
    warning: str = ""  # a first version made champion without passing the rule: why

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    def headline(self) -> str:
        """`enn-synthetic version 3: candidate (champion unchanged)`: what `line()` starts
        with (the reason can be 150 characters; the closing summary's `model:` line wraps it)."""
        if not self.registered:
            return f"{self.model}: not registered"
        role = "champion" if self.champion else "candidate (champion unchanged)"
        return f"{self.model} version {self.version}: {role}"

    def line(self) -> str:
        """The headline and why: export's console line in every command that registers, the
        closing summary's `model:` line."""
        return f"{self.headline()}: {self.reason}"

    def as_tags(self) -> dict[str, Any]:
        return {k: v for k, v in self.as_dict().items() if v != ""}


def bundle(layout: Layout, dest: Path) -> Path:
    """`dest/enn/`: what predict, warm start and the pyfunc flavor load (TRAINING specs'
    `bundle` files and the ONNX program)."""
    out = dest / pyfunc.DATA_DIR
    out.mkdir(parents=True)
    for spec in TRAINING:
        for name in spec.bundle:
            src = spec.output_dir(layout) / name
            if src.exists():
                shutil.copy2(src, out / name)
    onnx = EXPORT.output_dir(layout) / pyfunc.ONNX_FILE
    if onnx.exists():
        for src in onnx_files(onnx):  # model.onnx, and its weights when they are beside it
            shutil.copy2(src, out / src.name)
    return out


def log_model(
    client: MlflowClient,
    run_id: str,
    name: str,
    enn_dir: Path,
    layout: Layout,
    tags: dict[str, str],
) -> Any:
    """The pyfunc (+ onnx) model as a logged model named `name` in the experiment of `run_id`,
    an output of that run, its source the pipeline's parent run; returns MLflow's ModelInfo."""
    import numpy as np
    from mlflow.entities import LoggedModelStatus
    from mlflow.models import Model

    model = TableModel.load(enn_dir)
    staged = StagedDataset(STAGE_DATA.output_dir(layout))
    rows = staged.split("test") if "test" in staged.split_names else staged.split("val")
    features = np.asarray(staged.features[np.sort(np.asarray(rows))[: pyfunc.EXAMPLE_ROWS]])
    signature, example = pyfunc.signature_and_example(model, features)
    run = client.get_run(run_id)
    # the model's source run is the pipeline's parent run when there is one: MLflow's run list
    # fills its Models column by source run, and the parent is the row a person looks at (the
    # stage runs are folded under it); export's own run lists it among its outputs (Model.log)
    source = run.data.tags.get("mlflow.parentRunId") or run_id
    logged = client.create_logged_model(
        run.info.experiment_id, name=name, source_run_id=source, tags=tags
    )
    info = Model.log(
        artifact_path=None,
        name=name,
        flavor=pyfunc.Flavor,
        run_id=run_id,
        model_id=logged.model_id,
        bundle=enn_dir,
        signature=signature,
        input_example=example,
    )
    client.finalize_logged_model(logged.model_id, LoggedModelStatus.READY)
    return info


def register(
    client: MlflowClient,
    run_id: str,
    layout: Layout,
    name: str,
    tags: dict[str, str],
    validate: ValidateConfig | None = None,
) -> Registration:
    """Log the export of `layout` under `run_id`, register it as a version of `name`, decide
    the champion."""
    needed = (
        DISTRIBUTED_TRAIN.output_dir(layout) / "model.pt",
        COLLAPSE_CHECK.output_dir(layout) / "calibration.json",
    )
    missing = [str(p) for p in needed if not p.is_file()]
    if missing:
        return Registration(name, False, f"{missing[0]} is missing; run the training flow")
    report = read_report(COLLAPSE_CHECK.output_dir(layout))
    chosen = (report.chosen_metrics if report else None) or {}
    naive, naive_name = promotion_baseline(chosen)
    staged = STAGE_DATA.output_dir(layout)
    with tempfile.TemporaryDirectory() as tmp:
        enn_dir = bundle(layout, Path(tmp))
        own_errors = split_errors(enn_dir, staged, "val")
        rows, kept, errors = own_errors.rows, own_errors.kept, own_errors.errors
        own = Score(mae=float(np.mean(errors)), rows=len(kept), skipped=len(rows) - len(kept))
        against = judge(errors, baseline_errors(layout, staged, rows[kept], validate))
        info = log_model(client, run_id, name, enn_dir, layout, tags)
        ours = TableModel.load(enn_dir).checkpoint.data
        _ensure_registered_model(client, name)
        champion = _champion(client, name)
        verdict = _challenge(client, name, champion, ours, staged, Path(tmp))
    if isinstance(verdict, str):  # another task: not registered under this name
        return Registration(
            name, False, verdict, model_uri=info.model_uri, model_id=info.model_id, val_mae=own.mae
        )
    passes = _gate(own, naive, naive_name, against)[0]
    promote, why = decide(
        own,
        naive,
        verdict,
        champion.version if champion else None,
        naive_name,
        against,
        champion_passed=champion is None or passed_rule(champion.tags),
    )
    warning = why if promote and not passes else ""  # champion without passing the rule
    version_tags = {
        **tags,
        **_identity(layout, ours),
        "enn.val_mae": f"{own.mae:.6g}",
        "enn.val_rows": str(own.rows),
        "enn.candidate": str(report.chosen) if report else "",
        DECISION: why,
        PASSES_RULE: "yes" if passes else "no",
        "enn.champion_rule": RULE,
    }
    if naive is not None:
        version_tags["enn.naive_predictor"] = naive_name
        version_tags["enn.naive_val_mae"] = f"{naive:.6g}"
    if verdict is not None:
        version_tags["enn.champion_val_mae_on_these_rows"] = f"{verdict.mae:.6g}"
    version = client.create_model_version(
        name, info.model_uri, run_id=run_id, tags=version_tags, model_id=info.model_id
    )
    link_version(client, info.model_id, name, version.version)
    client.set_registered_model_alias(name, CANDIDATE, version.version)
    if promote:
        client.set_registered_model_alias(name, CHAMPION, version.version)
    return Registration(
        model=name,
        registered=True,
        reason=why,
        version=int(version.version),
        champion=promote,
        model_uri=info.model_uri,
        model_id=info.model_id,
        val_mae=own.mae,
        champion_val_mae=None if verdict is None else verdict.mae,
        naive_val_mae=naive,
        naive_predictor=None if naive is None else naive_name,
        warning=warning,
    )


def baseline_errors(
    layout: Layout, staged: Path, rows: np.ndarray, validate: ValidateConfig | None
) -> dict[str, np.ndarray]:
    """Each naive predictor's and (with `validate`, from validate's cache) each fitted
    baseline's per-row absolute errors at `rows` (validation rows, sorted): a float64 a row
    each, made ERROR_CHUNK_CELLS label numbers at a time (10^7 rows' targets and predictions
    in float64 at once are gigabytes)."""
    from enn_core.metrics import NaiveModel

    ds = StagedDataset(staged)
    naive = NaiveModel(ds)
    fitted: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    if validate is not None and validate.baselines:
        from enn_core.fitted_baselines import fitted_baselines

        split = np.asarray(ds.split("val"))  # `rows`' positions in it (no dict of a 10^6 rows)
        order = np.argsort(split, kind="stable")
        at = order[np.searchsorted(split[order], rows)]
        cache = layout.work / "cache" / "baselines"
        for n, res in fitted_baselines(ds, validate, ("val",), cache).items():
            fitted[n] = (res.predictions["val"], at)
    out = {n: np.empty(len(rows)) for n in [*naive.tables, *fitted]}
    step = max(1, ERROR_CHUNK_CELLS // max(int(np.prod(ds.targets.shape[1:])), 1))
    for start in range(0, len(rows), step):
        part = slice(start, start + step)
        target = np.asarray(ds.targets[rows[part]], dtype=np.float64)
        for n, p in naive.predict(rows[part]).items():
            out[n][part] = row_errors(p, target)
        for n, (pred, at) in fitted.items():
            out[n][part] = row_errors(np.asarray(pred[at[part]]), target)
    return out


def promotion_baseline(chosen: Mapping[str, float]) -> tuple[float | None, str]:
    """(MAE, name) of the naive predictor the candidate must beat, from the collapse report's
    chosen metrics: the best for MAE on the validation rows; a report written before the
    medians has only the conditional mean."""
    name = best_naive(chosen, "val")
    if PROMOTION_BASELINE in chosen and name is not None:
        return float(chosen[PROMOTION_BASELINE]), name
    legacy = chosen.get(LEGACY_PROMOTION_BASELINE)
    return (None if legacy is None else float(legacy)), "naive_conditional"


def link_version(client: MlflowClient, model_id: str, name: str, version: str) -> None:
    """Name the version on its logged model (tag `mlflow.modelVersions`, as MLflow's own
    `mlflow.register_model` does): the run page of the model's source run (the pipeline's
    parent) lists its registered models from that tag, and said "Registered models: None"
    while the run list's Models column showed the model."""
    from mlflow.utils.mlflow_tags import MLFLOW_MODEL_VERSIONS

    tags = client.get_logged_model(model_id).tags
    known = json.loads(tags.get(MLFLOW_MODEL_VERSIONS) or "[]")
    entry = {"name": name, "version": str(version)}
    if entry not in known:
        client.set_logged_model_tags(model_id, {MLFLOW_MODEL_VERSIONS: json.dumps(known + [entry])})


def decide(
    own: Score,
    naive: float | None,
    champion: Score | None,
    champion_version: str | None,
    naive_name: str = "naive_conditional",
    against: list[Comparison] | None = None,
    champion_passed: bool = True,
) -> tuple[bool, str]:
    """(promote, why in words with the numbers), by the one rule of champion_rule.RULE: beat
    the champion on these rows (the first version has none to beat) and pass the rule against
    the baselines, or beat a champion that did not pass it either. `against`: the model
    against each baseline by the rule (champion_rule.py); without it (no per-row errors), the
    best naive predictor's MAE is the bar. `champion_passed`: whether the champion passed."""
    passed, rule = _gate(own, naive, naive_name, against)
    if champion is None:
        if passed:
            return True, f"the first version, and it passes the rule: {rule}"
        return True, f"the first version, champion until one passes the rule: {rule}"
    rows = f"on this version's {champion.rows} validation rows"
    if champion.skipped:
        rows += f" ({champion.skipped} with categories the champion never saw left out)"
    better = own.mae < champion.mae
    than = (
        f"{PROMOTION_METRIC} {four(own.mae)} {'beats' if better else 'does not beat'} the "
        f"champion's (version {champion_version}) {four(champion.mae)} {rows}"
    )
    if not better:
        return False, f"{than}; it {'passes' if passed else 'does not pass'} the rule: {rule}"
    if passed:
        return True, f"{than}, and it passes the rule: {rule}"
    if champion_passed:
        return False, f"{than}, but the champion passed the rule and this version does not: {rule}"
    return True, f"{than}; neither passes the rule, champion until one does: {rule}"


def _gate(
    own: Score, naive: float | None, naive_name: str, against: list[Comparison] | None
) -> tuple[bool, str]:
    """(the version passes the rule against the baselines, why with the numbers)."""
    metric = PROMOTION_METRIC
    which = f"the best naive predictor ({naive_name}: {NAIVE_HOW.get(naive_name, naive_name)})"
    if against:
        return rule_verdict(against)
    if naive is not None and not own.mae < naive:
        return False, f"{metric} {four(own.mae)} does not beat {which}'s {four(naive)}"
    below = "" if naive is None else f" against {which}'s {four(naive)}"
    return True, f"{metric} {four(own.mae)}{below} on {own.rows} validation rows"


def passed_rule(tags: Mapping[str, str]) -> bool:
    """Whether a registered version passed the rule against the baselines: its tag
    `enn.passes_rule`; a version registered before that tag passed unless it was a first
    version made champion without passing."""
    if PASSES_RULE in tags:
        return tags[PASSES_RULE] == "yes"
    return not tags.get(DECISION, "").startswith("the first version, champion until")


def _champion(client: MlflowClient, name: str) -> Any:
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException:
        return None


def _challenge(
    client: MlflowClient, name: str, champion: Any, ours: DataSpec, staged: Path, tmp: Path
) -> Score | str | None:
    """The champion's score on our validation rows; None without a champion; a sentence
    when the champion is another task."""
    if champion is None:
        return None
    import mlflow.artifacts

    local = Path(
        mlflow.artifacts.download_artifacts(
            artifact_uri=f"models:/{name}/{champion.version}",
            dst_path=str(tmp / "champion"),
        )
    )
    folder = enn_folder(local)
    try:
        return score_split(folder, staged, "val")
    except SchemaClash as e:
        theirs = TableModel.load(folder).checkpoint.data
        return (
            f"{name}'s champion (version {champion.version}) is another task "
            f"({str(e).split('another task: ', 1)[-1]}); this model takes "
            f"{[s['name'] for s in ours.feature_specs]} -> labels {list(ours.label_shape)}, "
            f"the champion {[s['name'] for s in theirs.feature_specs]} -> "
            f"{list(theirs.label_shape)}: give this data its own registered model with "
            f"tracking.registered_model=<name>"
        )


def enn_folder(model_dir: Path) -> Path:
    """The folder holding model.pt inside a downloaded model (`data/enn/`; `enn/` in models
    registered before the pyfunc flavor)."""
    for sub in (Path("data") / pyfunc.DATA_DIR, Path(pyfunc.DATA_DIR)):
        if (model_dir / sub / "model.pt").is_file():
            return model_dir / sub
    raise FileNotFoundError(f"{model_dir}: no data/enn/model.pt; re-run export to register it")


def _ensure_registered_model(client: MlflowClient, name: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, description=DESCRIPTION)


def _identity(layout: Layout, data: DataSpec) -> dict[str, str]:
    """Data fingerprint, schema digest, world size and checkpoint step of the version."""
    import hashlib

    record = _json(DISTRIBUTED_TRAIN.output_dir(layout) / "record.json")
    digest = hashlib.sha256(json.dumps(schema(data), sort_keys=True).encode()).hexdigest()
    return {
        "enn.data_fingerprint": read_manifest(STAGE_DATA.output_dir(layout)).content_hash,
        "enn.schema": digest[:16],
        "enn.world_size": str(record.get("world_size", "")),
        "enn.checkpoint_step": str(record.get("applied_steps", "")),
    }


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}
