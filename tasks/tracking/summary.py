"""The parent run's summary: what MLflow's Compare lines up beside the parameters.

At the end of a pipeline run the parent run gets, from the outputs the pipeline now has (the
stages that ran and those DVC skipped as up to date):

- the headline results of validate (`val/` and `test/` MAE, RMSE, R², the naive predictors'
  MAE and the skill against them) and distributed-train's summary (`train/...`), with the
  names of docs/metrics.md;
- the champion decision: metrics `registry/version` and `registry/promoted` (1 or 0), tags
  `enn.registered_model` and `enn.champion_decision`;
- the staged data as its dataset input: name, content hash as digest, source, schema, rows.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from enn_core.data.manifest import MANIFEST, read_manifest
from enn_core.metric_names import TRAIN_SUMMARY, headline
from enn_core.paths import Layout
from enn_core.serving import columns
from enn_core.stages import STAGE_DATA, StageSpec

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

    from tasks.tracking.registry import Registration

DIGEST_CHARS = 16  # of the staged data's content hash (MLflow shows a short digest)


def results(layout: Layout, specs: tuple[StageSpec, ...]) -> dict[str, float]:
    """The headline metrics found in the specs' metrics.json files."""
    wanted = set(TRAIN_SUMMARY.values()) | {"train/wall_s"}
    out: dict[str, float] = {}
    for spec in specs:
        path = spec.output_dir(layout) / "metrics.json"
        if not path.is_file():
            continue
        metrics = {
            k: float(v)
            for k, v in json.loads(path.read_text()).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        out.update(headline(metrics))
        out.update({k: v for k, v in metrics.items() if k in wanted})
    return {k: v for k, v in out.items() if math.isfinite(v)}


def dataset(layout: Layout, specs: tuple[StageSpec, ...]) -> Any:
    """The staged data as an MLflow dataset entity (None before stage-data wrote it)."""
    from mlflow.entities import Dataset

    staged = next((s for s in specs if s.name == STAGE_DATA.name), None)
    staged_dir = staged.output_dir(layout) if staged else None
    if staged_dir is None or not (staged_dir / MANIFEST).is_file():
        return None
    manifest = read_manifest(staged_dir)
    path = manifest.source.path
    name = Path(path).stem if path else manifest.source.kind or "data"
    uri = Path(path).resolve().as_uri() if path else f"enn:{manifest.source.kind or 'data'}"
    schema = [{"name": n, "type": t} for n, t in columns(list(manifest.feature_specs))]
    label_shape = manifest.label_shape
    profile = {
        "num_rows": manifest.n_rows,
        "splits": dict(manifest.splits),
        "label_shape": list(label_shape) if label_shape is not None else None,
        "mode": manifest.mode,
    }
    return Dataset(
        name=name,
        digest=manifest.content_hash[:DIGEST_CHARS],
        source_type="local",
        source=json.dumps({"uri": uri}),
        schema=json.dumps({"mlflow_colspec": schema}),
        profile=json.dumps(profile),
    )


def write_parent(
    client: MlflowClient,
    parent_id: str,
    layout: Layout,
    specs: tuple[StageSpec, ...],
    registration: Registration | None,
) -> None:
    from mlflow.entities import DatasetInput, InputTag, LoggedModelOutput, Metric, RunTag

    now = int(time.time() * 1000)
    values = results(layout, specs)
    tags: list[RunTag] = []
    if registration is not None:
        tags += [
            RunTag("enn.registered_model", registration.model),
            RunTag("enn.champion_decision", registration.reason[:5000]),
        ]
        if registration.version is not None:
            values["registry/version"] = float(registration.version)
        values["registry/promoted"] = float(registration.champion)
    metrics = [Metric(k, v, now, 0) for k, v in sorted(values.items())]
    if metrics or tags:
        client.log_batch(parent_id, metrics=metrics, tags=tags)
    if registration is not None and registration.model_id:  # the run list's Models column
        client.log_outputs(parent_id, models=[LoggedModelOutput(registration.model_id, step=0)])
    data = dataset(layout, specs)
    if data is not None:
        mode = json.loads(data.profile).get("mode")
        context = InputTag("mlflow.data.context", "training" if mode == "training" else "inference")
        client.log_inputs(parent_id, datasets=[DatasetInput(data, tags=[context])])
