"""predict stage: chunked, resumable, multi-worker inference in real units.

    run(cfg, ctx) -> summary

1. Input: a split (`predict.split`: train, val, test or all) of the training staged data, or
   every row of a features-only staged dataset (`predict.input_dir`), schema-checked against
   the model's data spec (enn_core.predict.schema).
2. Model: the consolidated checkpoint (`predict.model`, default outputs/distributed-train/
   model.pt) through collapse-check's chosen prediction path when its calibration names this
   model, else raw (enn_core.predict.model_io); the choice and reason are recorded.
3. Parts: `predict.chunk_rows` rows per part in `<work>/predict-parts/<output name>/`, computed
   by `predict.world_size` workers (each its own contiguous block of parts): one in this
   process, several as the ranks of a launched job (enn_core.predict.ranks), on one node or
   several; their heartbeats, stacks and error records in the stage's run directory.
   A re-run after a crash reuses complete parts of the same model and input and discards
   others with a message (enn_core.predict.chunks). Every part's marker carries an HMAC under
   the job secret (`secret_file`: ENN_JOB_SECRET_FILE, else the work directory's own), on
   every path: a part someone else rewrote is recomputed, never published.
4. Outputs, replaced atomically as one directory (`outputs/predict/`): `predictions.npy`
   ([N, *label_shape] float32, real units, in the input's row order), `predictions.parquet`
   (keyed by the row keys), `predictions.xlsx` for workbook sources, `manifest.json`; for
   fewer rows than the collapse statistics need, `reference_predictions.npz`: the model's
   reference rows (from its collapse-check) predicted in one batch with the input's rows,
   which the prediction flow's collapse-check judges beside them
   (enn_core/collapse/reference.py).
   The parts directory is removed once the outputs are in place.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from enn_core.atomic import atomic_dir, atomic_file, write_json
from enn_core.checkpoint import Checkpoint, load_model
from enn_core.collapse.reference import BESIDE_FILE, MIN_ROWS, find_reference, predict_beside
from enn_core.data.dataset import StagedDataset
from enn_core.data.hashing import sha256_file
from enn_core.errors import ConfigError, DataError
from enn_core.inference import resolve_device
from enn_core.model.enn import ENN
from enn_core.model_code import ModelCode
from enn_core.predict import model_io, outputs, ranks, schema, workers
from enn_core.predict.assemble import assemble
from enn_core.predict.chunks import FORMAT_VERSION, PartsPlan, PartStore, own_folder, parts_key
from enn_core.predict.model_io import CalibrationChoice
from enn_core.runtime import secret
from enn_core.runtime.device import threads_per_worker
from enn_core.runtime.external import LauncherEnv
from enn_core.runtime.launch import Rendezvous
from enn_core.runtime.network import choose_interface
from enn_core.summaries import PredictSummary

if TYPE_CHECKING:
    from enn_core.config import RunConfig
    from enn_core.stage import StageContext

MODEL_FILE = "model.pt"
SPLITS = ("train", "val", "test", "all")


def select_rows(
    ds: StagedDataset, split: str, features_only: bool
) -> tuple[np.ndarray | None, str]:
    """Dataset row indices to predict (None = every row in order) and what they are."""
    if features_only:
        return None, "all rows of the features-only dataset"
    if split not in SPLITS:
        raise ConfigError(f"predict.split={split!r} is not one of {list(SPLITS)}")
    if split == "all":
        return None, "all rows"
    idx = np.asarray(ds.split(split), dtype=np.int64)
    return idx, f"split {split}"


def input_fingerprint(ds: StagedDataset, index: np.ndarray | None) -> str:
    h = hashlib.sha256(str(ds.fingerprint).encode())
    h.update(b"all" if index is None else np.ascontiguousarray(index).tobytes())
    return h.hexdigest()


def _rank_device(device: torch.device, rank: int) -> str:
    """Workers share the visible GPUs round-robin; on CPU they all use the CPU."""
    if device.type == "cuda":
        return f"cuda:{rank % max(1, torch.cuda.device_count())}"
    return str(device)


def _threads(cfg: RunConfig, world: int) -> int:
    return threads_per_worker(cfg.runtime.threads_per_worker, world)


def run(
    cfg: RunConfig,
    ctx: StageContext,
    *,
    staged: Path,
    model: Path | None,
    calibration: Path | None,
    calibration_name: str,
) -> PredictSummary:
    """The predict stage (see the module docstring) over the staged data `staged` (unless
    `predict.input_dir` names features-only data), with `predict.model` or else `model`;
    `calibration`: this pipeline's collapse-check output; `calibration_name`: the folder name
    of a collapse-check output beside the model's stage output."""
    t0 = time.perf_counter()
    p = cfg.predict
    root = ctx.layout.root
    features_only = bool(p.input_dir)
    data_dir = ctx.layout.resolve(p.input_dir) if features_only else staged
    ds = StagedDataset(data_dir)
    model_path = model_io.resolve_model_path(p.model, model, root)
    code = ModelCode.of(cfg.model, root)
    net, ckpt = load_model(model_path, code)
    data = {**ds.manifest.model_data(), "training_manifest": ds.manifest.training_manifest}
    schema.check_labels(data, ckpt.data.as_dict(), where=str(data_dir))
    features_file = _features_for(ctx, ds, data_dir, ckpt)
    remapped = features_file != Path(data_dir) / ds.manifest.features.file
    features = np.load(features_file, mmap_mode="r") if remapped else ds.features
    schema.check_schema(data, features, ckpt.data.as_dict(), where=str(data_dir), remapped=remapped)
    index, selection = select_rows(ds, p.split, features_only)
    n_rows = ds.features.shape[0] if index is None else len(index)
    if n_rows == 0:
        raise DataError(
            f"{data_dir}: {selection} has no rows; choose another predict.split or input"
        )

    model_sha = sha256_file(model_path)
    cal_dirs = model_io.calibration_dirs(
        model_path, p.calibration_dir, calibration, calibration_name, root
    )
    choice = model_io.find_calibration(cal_dirs, model_sha, use=p.calibration == "auto")
    device, device_reason = resolve_device(cfg.runtime.device)
    label_shape = ckpt.data.label_shape
    plan = PartsPlan(
        n_rows=n_rows,
        rows_per_part=p.chunk_rows,
        out_shape=label_shape,
        dtype="float32",
        model_fingerprint=model_io.model_fingerprint(model_sha, choice),
        input_fingerprint=input_fingerprint(ds, index),
    )
    launched = ranked(cfg)
    key_file = secret_file(cfg, ctx)
    store = PartStore(parts_root(cfg, ctx, launched) / ctx.output().name, plan, parts_key(key_file))
    own_folder(store.root)  # a link there: one line on every node, before any rank starts
    # launched: global rank 0 alone prepares the shared folder, after the ranks agreed on the
    # plan (enn_core.predict.ranks); each node keeps its row index in its own run directory
    discarded = None if launched else store.prepare(ctx.run_dir.parent.name)
    index_path = None
    if index is not None:
        index_path = (ctx.run_dir if launched else store.root) / "index.npy"
        with atomic_file(index_path, "wb") as f:
            np.save(f, index)

    world = p.world_size
    jobs = [
        workers.WorkerJob(
            rank=r,
            world_size=world,
            parts_dir=str(store.root),
            plan=plan,
            features_path=str(features_file),
            index_path=str(index_path) if index_path else None,
            batch_size=p.forward_rows,
            loader=model_io.predictor_loader(str(model_path), choice, str(device), code),
            device=_rank_device(device, r),
            threads=_threads(cfg, world),
            fault=cfg.fault,
            fault_marker_dir=str(ctx.faults.marker_dir or ctx.run_dir),
            progress_every_s=cfg.runtime.progress_every_s,
            secret_file=key_file,
        )
        for r in range(world)
    ]
    # two lines, each within 120 columns with the time: what runs, then which path and why
    ctx.logger.info(
        "predict: %d rows (%s) in %d part(s), %d worker(s) on %s",
        n_rows,
        selection,
        plan.n_parts,
        world,
        device,
    )
    ctx.logger.info(
        "predict: calibration %s: %s",
        choice.candidate if choice.applied else "raw",
        choice.headline,
    )
    ctx.events.param("predict.batch_size", f"{p.forward_rows} ({p.forward_rows_reason})")
    t_pred = time.perf_counter()
    if launched or world > 1:  # the ranks of a launched job, whatever the node count
        by_rank = run_ranks(cfg, ctx, jobs[0], world)
        stats = list(by_rank.values())
        discarded = next((d for s in stats if (d := cast(dict, s).get("discarded"))), None)
        if 0 not in by_rank:  # global rank 0's node assembles and publishes
            return _elsewhere(cfg, ctx, plan, by_rank, time.perf_counter() - t0)
    else:  # one worker: in this process, with the model already loaded
        stats = workers.run(jobs, model_io.prediction_path(net, choice).to(device))
    seconds_predict = time.perf_counter() - t_pred
    if discarded:
        ctx.logger.warning("predict: discarded earlier parts: %s", discarded)
        ctx.events.event("predict_parts_discarded", reason=discarded)

    beside = (
        _beside(cal_dirs, model_sha, net, choice, features, n_rows, device)
        if features_only  # the prediction flow, whose collapse-check judges new rows
        else _Beside({"rows": 0, "why": "rows of the training data"})
    )
    applied = {
        "applied": choice.applied,
        "candidate": choice.candidate if choice.applied else "raw",
        "reason": choice.reason,
    }
    written = _write_outputs(cfg, ctx, ds, data_dir, store, index, ckpt, (applied, beside))
    computed = sorted(k for s in stats for k in s.get("computed_parts", []))
    reused = sorted(k for s in stats for k in s.get("reused_parts", []))
    rows_computed = sum(s.get("rows_computed", 0) for s in stats)
    summary = PredictSummary(
        output=str(ctx.output()),
        nodes=cfg.runtime.nnodes,
        n_rows=written.n_rows,
        shape=written.shape,
        files=written.files,
        model=str(model_path),
        model_sha256=model_sha,
        input=str(data_dir),
        selection=selection,
        calibration=applied,
        device=str(device),
        device_reason=device_reason,
        world_size=world,
        n_parts=plan.n_parts,
        computed_parts=tuple(computed),
        reused_parts=tuple(reused),
        rows_computed=rows_computed,
        discarded_parts=discarded,
        rows_per_second=rows_computed / seconds_predict
        if seconds_predict > 0 and rows_computed
        else None,
        seconds=time.perf_counter() - t0,
    )
    write_json(ctx.run_dir / "predict_summary.json", summary.as_dict())
    _record(ctx, summary)
    store.clear()  # what enn wrote there; a file of someone else's is left and named
    if remapped:
        features_file.unlink(missing_ok=True)
    return summary


def ranked(cfg: RunConfig) -> bool:
    """Whether this prediction is one part of a launched job: several nodes, or torchrun."""
    return cfg.runtime.nnodes > 1 or cfg.runtime.launcher == "external"


def secret_file(cfg: RunConfig, ctx: StageContext) -> str:
    """The job secret that keys every part's marker, on every path (one worker in this
    process, launched ranks, torchrun's): ENN_JOB_SECRET_FILE, checked; on one node without
    it, the work directory's own `job-secret` (made once, 0600), the one a one-node launch
    gives its workers; several nodes without one are one line (enn_core.runtime.secret)."""
    given = secret.launch_env(ctx.layout.work, cfg.runtime.nnodes)
    return given.get(secret.ENV) or os.environ[secret.ENV]


def parts_root(cfg: RunConfig, ctx: StageContext, launched: bool) -> Path:
    """Where the parts go: `predict.parts_dir`, else the node's own work directory (one node)."""
    if cfg.predict.parts_dir:
        return ctx.layout.resolve(cfg.predict.parts_dir)
    if launched:
        raise ConfigError(
            "predict.parts_dir is empty, and a prediction across nodes needs a folder every node "
            "shares (each node's work/ is its own); set predict.parts_dir=/shared/<folder>"
        )
    return ctx.layout.work / "predict-parts"


def run_ranks(
    cfg: RunConfig, ctx: StageContext, job: workers.WorkerJob, world: int
) -> dict[int, workers.WorkerStats]:
    """This node's ranks of a launched prediction (enn_core.predict.ranks): `world` workers
    started by the project's launcher, or this process under an external launcher. {global
    rank: its stats}."""
    rt = cfg.runtime
    spec = ranks.RankJob(
        job=job,
        run_dir=str(ctx.run_dir),
        interface=choose_interface(rt.socket_ifname, rt.local_addr, rt.nnodes),
        barrier_timeout_s=rt.task_timeout_s,
        device=rt.device,
        job_id=ctx.run_dir.parent.name,
    )
    if rt.launcher == "external":
        launched = LauncherEnv.required()
        path = spec.write(ctx.run_dir / "predict-job.json")
        return {launched.rank: ranks.rank_main(str(path))}
    limits = ranks.Limits(rt.hang_timeout_s, rt.spawn_budget_s, rt.task_timeout_s, rt.max_restarts)
    return ranks.launch_ranks(spec, world, limits, cancel=ctx.cancel, rdzv=Rendezvous.of(rt))


def _elsewhere(
    cfg: RunConfig,
    ctx: StageContext,
    plan: PartsPlan,
    by_rank: dict[int, workers.WorkerStats],
    seconds: float,
) -> PredictSummary:
    """A node without global rank 0: its parts are in the shared folder; nothing published."""
    computed = sorted(k for s in by_rank.values() for k in s.get("computed_parts", []))
    ctx.logger.info(
        "predict: this node ran ranks %s (parts %s); the node of global rank 0 assembles and "
        "publishes the predictions",
        sorted(by_rank),
        computed,
    )
    return PredictSummary(
        output="",
        nodes=cfg.runtime.nnodes,
        node_only=True,
        n_rows=plan.n_rows,
        shape=(plan.n_rows, *plan.out_shape),
        files={},
        model="",
        model_sha256="",
        input="",
        selection="",
        calibration={},
        device="",
        device_reason="",
        world_size=len(by_rank),
        n_parts=plan.n_parts,
        computed_parts=tuple(computed),
        reused_parts=tuple(sorted(k for s in by_rank.values() for k in s.get("reused_parts", []))),
        rows_computed=sum(s.get("rows_computed", 0) for s in by_rank.values()),
        discarded_parts=None,
        rows_per_second=None,
        seconds=seconds,
    )


@dataclass(frozen=True)
class _Beside:
    """The model's reference rows predicted beside a small input (or why they are not):
    `meta` for the manifest's `reference`, `arrays` for reference_predictions.npz."""

    meta: dict[str, Any]
    arrays: dict[str, np.ndarray] | None = None


def _beside(
    cal_dirs: list[Path],
    model_sha: str,
    net: ENN,
    choice: CalibrationChoice,
    features: np.ndarray,
    n_rows: int,
    device: torch.device,
) -> _Beside:
    """Below MIN_ROWS rows, the reference rows of this model's collapse-check output, predicted
    in one forward pass with the input's rows (coded by the model's vocabularies) through the
    same prediction path; and training's verdict on the model."""
    if n_rows >= MIN_ROWS:
        return _Beside({"rows": 0, "why": f"{n_rows} rows: enough on their own"})
    ref = find_reference(cal_dirs, model_sha)
    if ref is None:
        return _Beside({"rows": 0, "why": "no collapse-check report for this model beside it"})
    meta: dict[str, Any] = {"from": ref.directory, "verdict": ref.verdict, "why": ref.why}
    if ref.features is None:
        return _Beside({**meta, "rows": 0})
    user = np.asarray(features[:n_rows], np.float32)  # features-only input: every row
    path = model_io.prediction_path(net, choice).to(device)
    arrays = predict_beside(path, user, ref.features, device)
    return _Beside({**meta, "rows": len(ref.features)}, arrays)


def _features_for(ctx: StageContext, ds: StagedDataset, data_dir: Path, ckpt: Checkpoint) -> Path:
    """The staged features file, or, when its categories are coded otherwise than the model's
    (staged against another training manifest: a retrain that met them in another order), a
    copy under the work directory coded by the model's vocabularies, read by spelling."""
    own = Path(data_dir) / ds.manifest.features.file
    data_specs = list(ds.manifest.feature_specs)
    model_specs = ckpt.data.feature_specs
    if not schema.needs_remap(data_specs, model_specs):
        return own
    where = str(data_dir)
    schema.check_specs(data_specs, model_specs, where, vocabularies=False)
    dest = ctx.layout.work / "predict-inputs" / f"{ctx.output().name}.npy"
    dest.parent.mkdir(parents=True, exist_ok=True)
    schema.remap_file(own, dest, data_specs, model_specs, where)
    ctx.logger.info(
        "predict: %s codes its categories otherwise than the model (another training "
        "manifest); its rows are read by the spelling of each category",
        data_dir,
    )
    ctx.events.event("predict_inputs_remapped", input=where)
    return dest


@dataclass(frozen=True)
class _Written:
    """What `_write_outputs` put in the output folder: the predictions' rows and shape, and the
    sha256 of each file."""

    n_rows: int
    shape: tuple[int, ...]
    files: dict[str, str]


def _write_outputs(
    cfg: RunConfig,
    ctx: StageContext,
    ds: StagedDataset,
    data_dir: Path,
    store: PartStore,
    index: np.ndarray | None,
    ckpt: Checkpoint,
    notes: tuple[dict[str, Any], _Beside],
) -> _Written:
    """predictions.npy, .parquet, (.xlsx), manifest.json and the reference rows predicted
    beside a small input, as one atomic directory; `notes`: the calibration applied and the
    reference rows."""
    applied, beside = notes
    data = ckpt.data
    label_shape = list(data.label_shape)
    axes = list(data.label_axes)
    axis_values = dict(data.label_axis_values)
    rows = np.arange(ds.features.shape[0], dtype=np.int64) if index is None else index
    keys = _row_keys(data_dir, ds, rows)
    source = ds.manifest.source
    files: dict[str, str] = {}
    with atomic_dir(ctx.output()) as tmp:
        preds = assemble(store, tmp / "predictions.npy")
        files["predictions.npy"] = sha256_file(tmp / "predictions.npy")
        outputs.write_parquet(
            tmp / "predictions.parquet",
            preds,
            keys,
            rows,
            outputs.cell_names(label_shape, axes, axis_values),
        )
        files["predictions.parquet"] = sha256_file(tmp / "predictions.parquet")
        workbook = None
        if source.kind == "workbook" and source.path and cfg.predict.xlsx and keys is not None:
            src = ctx.layout.resolve(source.path)
            workbook = outputs.write_workbook(
                tmp / "predictions.xlsx", src, cfg.data.workbook, preds, keys, axis_values, axes
            )
            files["predictions.xlsx"] = sha256_file(tmp / "predictions.xlsx")
        manifest = {
            "format_version": FORMAT_VERSION,
            "n_rows": int(preds.shape[0]),
            "shape": list(preds.shape),
            "dtype": "float32",
            "units": "real (label units)",
            "label_axes": axes,
            "row_keys": keys.column_names if keys is not None else [],
            "model_fingerprint": store.plan.model_fingerprint,
            "input_fingerprint": store.plan.input_fingerprint,
            "input_content_hash": str(ds.fingerprint),
            "calibration": applied,
            "files": files,
            "workbook": workbook,
            "reference": beside.meta,
        }
        if beside.arrays is not None:
            a = beside.arrays
            np.savez(tmp / BESIDE_FILE, predictions=a["predictions"], input_ids=a["input_ids"])
        write_json(tmp / "manifest.json", manifest)
        del preds
    return _Written(n_rows=manifest["n_rows"], shape=tuple(manifest["shape"]), files=files)


def _row_keys(data_dir: Path, ds: StagedDataset, rows: np.ndarray) -> pa.Table | None:
    """The predicted rows' key columns from row_keys.parquet (None when the dataset has none)."""
    path = Path(data_dir) / "row_keys.parquet"
    if not path.exists():
        return None
    table = pq.ParquetFile(path).read()  # read_table would import pyarrow.dataset: 0.2 s more
    if table.num_rows != ds.features.shape[0]:
        raise DataError(
            f"{path}: {table.num_rows} rows but features have {ds.features.shape[0]}; "
            "re-run stage-data"
        )
    return table.take(rows)


def _record(ctx: StageContext, s: PredictSummary) -> None:
    ev = ctx.events
    ev.param("predict.calibration", s.calibration["candidate"])
    ev.param("predict.calibration_reason", s.calibration["reason"])
    ev.param("predict.device", s.device)
    ev.param("predict.world_size", s.world_size)
    ev.metric("predict/rows", s.n_rows)
    ev.metric("predict/parts_computed", len(s.computed_parts))
    ev.metric("predict/parts_reused", len(s.reused_parts))
    if s.rows_per_second:
        ev.metric("predict/rows_per_second", s.rows_per_second)
    for name in s.files:
        ev.artifact(Path(s.output) / name, ctx.stage)
