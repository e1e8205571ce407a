"""stage-data: turn the declared input into a staged dataset directory (design.md).

    run(cfg, ctx)                                   the stage: writes ctx.output()
    stage(data_cfg, layout, target)                 the same, for any target directory
    stage_features(data_cfg, layout, target, training_manifest)
                                                    features-only data for predict

Everything streams: each input chunk is encoded, checked for non-finite values, written
(hashed on the way) and forgotten. The directory is built beside its target and renamed into
place (enn_core.atomic.atomic_dir), so a bad input or a kill leaves the old output untouched.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from enn_core.atomic import atomic_dir, write_json
from enn_core.config import DataConfig, RunConfig, SyntheticConfig
from enn_core.data import hashing, splits
from enn_core.data.encode import Encoder
from enn_core.data.manifest import (
    MANIFEST,
    ArrayEntry,
    FileEntry,
    LabelInfo,
    LabelStats,
    SourceRecord,
    StagedManifest,
    content_hash,
    read_manifest,
)
from enn_core.data.sources import ArraySource, Source, SourceInfo
from enn_core.data.synthetic import SyntheticSource
from enn_core.data.tables import CsvSource, ParquetSource
from enn_core.data.workbook import WorkbookSource
from enn_core.data.writer import ChunkHooks, ChunkWriter
from enn_core.errors import ConfigError, DataError
from enn_core.paths import Layout
from enn_core.summaries import StagedSummary

if TYPE_CHECKING:
    from enn_core.stage import StageContext

log = logging.getLogger("enn.data")
SUFFIXES = {
    "npy": (".npy",),
    "npz": (".npz",),
    "csv": (".csv", ".txt"),
    "parquet": (".parquet", ".pq"),
    "workbook": (".xlsx", ".xlsm"),
}


def run(cfg: RunConfig, ctx: StageContext) -> StagedSummary:
    """The stage-data stage: stage `cfg.data` into `ctx.output()`."""
    result = stage(cfg.data, ctx.layout, ctx.output(), ctx=ctx)
    ctx.events.param("data.content_hash", result["content_hash"])
    ctx.events.metrics({"data/rows": result["n_rows"], "data/seconds": result["seconds"]})
    ctx.events.artifact(Path(result["path"]) / MANIFEST, ctx.stage)
    return StagedSummary(
        output=result["path"],
        n_rows=result["n_rows"],
        splits=result["splits"],
        content_hash=result["content_hash"],
        mode=result["mode"],
        seconds=result["seconds"],
    )


def stage_features(
    data: DataConfig, layout: Layout, target: str | Path, training_manifest: str | Path
) -> dict[str, Any]:
    """Stage new inputs (no labels) against a training manifest, reusing its encodings."""
    data = dataclasses.replace(data, features_only=True, training_manifest=str(training_manifest))
    return stage(data, layout, Path(target))


def _input(layout: Layout, raw: str, what: str) -> Path:
    p = Path(os.path.normpath(layout.resolve(raw)))
    if not p.exists():
        gone = next((a for a in reversed(p.parents) if not a.exists()), None)
        hint = f" (directory {gone} is absent)" if gone else ""
        raise DataError(
            f"{what}={raw!r}: expected the input at {p}, which does not exist{hint}; "
            f"put it there or fix {what}"
        )
    if not p.is_file():
        raise DataError(f"{what}={raw!r}: {p} is not a file; point {what} at the input file")
    return p


def open_source(data: DataConfig, layout: Layout) -> Source:
    """The reader for data.source, with paths and formats checked."""
    if data.source == "synthetic":
        return SyntheticSource(data)
    path = _input(layout, data.path, "data.path")
    if path.suffix.lower() not in SUFFIXES[data.source]:
        raise DataError(
            f"{path}: unknown format {path.suffix or '(no suffix)'!r} "
            f"for data.source={data.source}; expected "
            f"{' or '.join(SUFFIXES[data.source])}, or set data.source to the file's kind"
        )
    if data.source in ("npy", "npz"):
        labels = None
        if not data.features_only:
            if data.source == "npy" and not data.labels_path:
                raise DataError(
                    f"{path}: data.labels_path is empty; "
                    "name the labels .npy (or set data.features_only)"
                )
            labels = (
                path
                if data.source == "npz"
                else _input(layout, data.labels_path, "data.labels_path")
            )
        return ArraySource(data, path, labels, npz=data.source == "npz")
    if data.source == "csv":
        return CsvSource(data, path)
    if data.source == "parquet":
        return ParquetSource(data, path)
    return WorkbookSource(data, path)


def stage(
    data: DataConfig,
    layout: Layout,
    target: str | Path,
    *,
    ctx: StageContext | None = None,
) -> dict[str, Any]:
    """Stage `data` into `target` atomically; returns a summary with the manifest's headline.
    `ctx`: the stage run's context (events, fault phases, progress), None outside a stage."""
    t0 = time.perf_counter()
    target = Path(target)
    training = None
    if data.features_only:
        training = read_manifest(
            _input(layout, data.training_manifest, "data.training_manifest").parent
        )
        data = read_as_trained(data, training, data.training_manifest)
    source = open_source(data, layout)
    try:
        with atomic_dir(_writable(target)) as tmp:
            manifest = _write(data, source, tmp, training, ctx)
    except OSError as e:
        raise _output_error(e, target) from e
    finally:
        source.close()
    out = {
        "path": str(target),
        "n_rows": manifest.n_rows,
        "splits": dict(manifest.splits),
        "content_hash": manifest.content_hash,
        "mode": manifest.mode,
        "seconds": round(time.perf_counter() - t0, 3),
    }
    if ctx is not None:
        ctx.events.event("staged", **out)
    return out


def read_as_trained(data: DataConfig, training: StagedManifest, where: str) -> DataConfig:
    """New inputs are read as the model's training data was: its categorical and cyclic
    columns come from the training manifest's feature specs, whatever the prediction's params
    say (a new file needs only data.source and data.path; one list to keep in step, not two).
    A manifest whose specs are not such (damaged, foreign) is one DataError naming it."""
    specs = training.feature_specs
    try:
        cyclic = [s for s in specs if s.get("cyclic_period")]
        return dataclasses.replace(
            data,
            categorical=tuple(str(s["name"]) for s in specs if s.get("kind") == "categorical"),
            cyclic=tuple(str(s["name"]) for s in cyclic),
            cyclic_periods=tuple(int(s["cyclic_period"]) for s in cyclic),
            cyclic_starts=tuple(int(s.get("cyclic_start", 0)) for s in cyclic),
        )
    except (AttributeError, KeyError, TypeError, ValueError, ConfigError) as e:
        raise DataError(
            f"{where}: its feature specs do not say how the training data was read ({e}); "
            "re-run the training pipeline's stage-data"
        ) from e


def _writable(target: Path) -> Path:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _output_error(e, target) from e
    return target


def _output_error(e: OSError, target: Path) -> DataError:
    where = e.filename or target.parent
    if e.errno == errno.ENOSPC:
        return DataError(
            f"{where}: no space left on the output device; "
            f"free space under {target.parent} and re-run"
        )
    if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return DataError(
            f"{where}: output directory is not writable ({e.strerror}); "
            f"make {target.parent} writable"
        )
    return DataError(f"{where}: cannot write the staged data ({e.strerror}); check {target.parent}")


def _write(
    data: DataConfig,
    source: Source,
    tmp: Path,
    training: StagedManifest | None,
    ctx: StageContext | None,
) -> StagedManifest:
    info = source.info
    frozen = [dict(s) for s in training.feature_specs] if training else None
    enc = Encoder(info.feature_names, data, frozen)
    file = str(info.path or "synthetic")
    hooks = None
    if ctx is not None:  # a stage run: its progress bar, its fault phase once per chunk
        hooks = ChunkHooks(
            ctx.stage,
            ctx.progress,
            functools.partial(ctx.faults.at, ctx.stage),
            ctx.ticker(info.n_rows).at,
        )
    writer = ChunkWriter(tmp, data, info, enc, file, hooks)
    stop = threading.Event()  # a failed run does not wait for the whole input to be hashed
    with ThreadPoolExecutor(max_workers=1) as pool:  # hash the input while staging it
        src_hash = pool.submit(hashing.hash_files, info.inputs, stop) if info.inputs else None
        try:
            writer.run(source)
        except BaseException:
            stop.set()
            raise
        writer.source_hash = src_hash.result() if src_hash else None
    features = np.load(tmp / "features.npy", mmap_mode="r")
    labels = np.load(tmp / "labels.npy", mmap_mode="r") if writer.has_labels else None
    codes = np.load(tmp / writer.codes_file, mmap_mode="r+")
    stats = None
    if training is not None:  # new data: every row is to be predicted ("test"), nothing fitted
        codes[:] = splits.TEST
    elif writer.stream is None:  # splits and train statistics need the full row count first
        splits.assign_file(data, codes)
        stats = (writer.fx, writer.fy, writer.cont)
    sizes, split_hashes = splits.finish(
        tmp, codes, features, labels, stats, need_train=training is None
    )
    if training is None:
        check_split_sizes(sizes, data, str(info.path or "synthetic"))
    fx, fy, cont = writer.fx, writer.fy, writer.cont
    del codes
    (tmp / writer.codes_file).unlink()
    specs = enc.final_specs()
    std = fx.std()
    for k, j in enumerate(cont if training is None else []):  # features-only: training's stats
        constant = bool(std[k] < 1e-12)
        specs[j].update(
            mean=float(fx.mean[k]), std=1.0 if constant else float(std[k]), constant=constant
        )
    files = {
        **{n: FileEntry.from_json(f) for n, f in writer.files().items()},
        **{
            n: FileEntry("int64", (sizes[n.split("/")[1][:-4]],), h)
            for n, h in split_hashes.items()
        },
    }
    manifest = _manifest(data, info, writer, specs, sizes, files, fy, training)
    write_json(tmp / MANIFEST, manifest.to_json())
    return manifest


# Rows each split needs in a training dataset: validate scores val and test, collapse-check
# judges candidates on at least two validation rows, training needs a row.
MIN_SPLIT_ROWS = {"train": 1, "val": 2, "test": 1}


def check_split_sizes(sizes: dict[str, int], data: DataConfig, file: str) -> None:
    """Refuse a split too small for the stages after staging, naming it and the fix."""
    total = sum(sizes.values())
    for name, need in MIN_SPLIT_ROWS.items():
        if sizes.get(name, 0) >= need:
            continue
        fix = (
            "choose data.folds, data.test_fold and data.val_fold that leave it rows"
            if data.fold_key
            else "add rows, or raise data.val_fraction / data.test_fraction"
        )
        raise DataError(
            f"{file}: the {name} split has {sizes.get(name, 0)} row(s) of {total}; the stages "
            f"after stage-data need at least {need}: {fix}"
        )


def label_axes(data: DataConfig, shape: list[int], info: SourceInfo) -> list[str]:
    """data.label_axes for labels of `shape`; set to another length, it is refused (left at
    its default or empty, the axes are named axis0, axis1, ...)."""
    if len(data.label_axes) == len(shape):
        return list(data.label_axes)
    if data.label_axes and data.label_axes != DataConfig().label_axes:
        raise DataError(
            f"{info.path or 'the input'}: data.label_axes names {len(data.label_axes)} axes "
            f"{list(data.label_axes)} but the labels have shape {shape}; give one name per "
            "axis of data.label_shape"
        )
    return [f"axis{i}" for i in range(len(shape))]


def naive_keys(data: DataConfig, info: SourceInfo) -> list[str]:
    """The conditional naive predictor's keys: row-key columns of this data. A key the user
    set that is not one is refused (its predictor, and the champion's gate, would vanish)."""
    missing = [k for k in data.naive_keys if k not in info.row_keys]
    if missing and data.naive_keys != DataConfig().naive_keys:
        raise DataError(
            f"{info.path or 'the input'}: data.naive_keys names {missing}, which are not row-key "
            f"columns of this data ({info.row_keys or 'none'}: categorical features and the "
            "fold key); fix data.naive_keys or declare the columns in data.categorical"
        )
    if missing:
        log.warning(
            "data.naive_keys (default %s) are not columns of %s: no conditional naive "
            "predictor; set data.naive_keys to the columns that define a group",
            list(data.naive_keys),
            info.path or "this data",
        )
    return [k for k in data.naive_keys if k in info.row_keys]


def _manifest(
    data: DataConfig,
    info: SourceInfo,
    writer: ChunkWriter,
    specs: list[dict[str, Any]],
    sizes: dict[str, int],
    files: dict[str, FileEntry],
    fy: splits.Moments | None,
    training: StagedManifest | None,
) -> StagedManifest:
    labelled = writer.has_labels
    label: LabelInfo | None
    if training:
        label = training.label
    else:  # training data: labels were staged, and their statistics gathered (fy)
        shape = list(cast(tuple[int, ...], info.label_shape))
        fy = cast(splits.Moments, fy)
        axes = label_axes(data, shape, info)
        values = info.label_axis_values or {
            a: [str(i) for i in range(n)] for a, n in zip(axes, shape, strict=True)
        }
        values = dict(zip(axes, values.values(), strict=True))
        stats = LabelStats(mean=float(fy.mean[0]), std=float(fy.std()[0]))
        label = LabelInfo(tuple(shape), tuple(axes), values, stats)
    if info.inputs:
        src_hash, hash_of = writer.source_hash, "file bytes"
    elif info.path is not None:  # arrays: each array's data hash, hashed while staged
        src_hash = hashing.of_bytes(json.dumps(writer.array_hashes, sort_keys=True).encode())
        hash_of = f"the json of each input array's data hash: {writer.array_hashes}"
    else:
        src_hash = hashing.of_bytes(json.dumps(_plain(data.synthetic), sort_keys=True).encode())
        hash_of = "the generator config"
    split_def: dict[str, Any] = {"seed": data.split_seed, "val_fraction": data.val_fraction}
    if data.folds:
        split_def.update(
            fold_key=data.fold_key,
            folds=[list(f) for f in data.folds],
            test_fold=data.test_fold,
            val_fold=data.val_fold,
        )
        if data.val_by_key:
            split_def["val_by_key"] = True
    else:
        split_def.update(test_fraction=data.test_fraction)
    return StagedManifest(
        mode="training" if labelled else "features_only",
        n_rows=writer.rows,
        features=_array("features.npy", files),
        labels=_array("labels.npy", files) if labelled else None,
        dtype_reason=writer.dtype_reason,
        feature_names=tuple(s["name"] for s in specs),
        feature_specs=tuple(specs),
        label=label,
        row_keys=tuple(info.row_keys),
        naive_keys=tuple(naive_keys(data, info)),
        splits=sizes,
        split_definition=split_def,
        dropped_rows=writer.dropped,
        source=SourceRecord(
            kind=info.kind,
            path=str(info.path) if info.path else None,
            hash=src_hash,
            hash_of=hash_of,
            config=_plain(data.synthetic) if info.kind == "synthetic" else None,
        ),
        training_manifest=str(data.training_manifest) if training else None,
        training_content_hash=training.content_hash if training else None,
        files=files,
        content_hash=content_hash(files),
    )


def _array(name: str, files: dict[str, FileEntry]) -> ArrayEntry:
    return ArrayEntry(name, files[name].dtype, files[name].shape)


def _plain(obj: SyntheticConfig) -> dict[str, Any]:
    return dataclasses.asdict(obj)
