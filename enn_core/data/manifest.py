"""manifest.json of a staged dataset: building it, the content hash, and reading it back.

Version policy: readers accept exactly FORMAT_VERSION. An older manifest is refused with
"re-run stage-data" (staging is cheap and deterministic, so no in-place migration is kept);
a newer one is refused with "upgrade enn". Shapes, dtypes and split sizes are checked
against the files themselves by `enn_core.data.dataset.StagedDataset`.

Hashes name their algorithm ("blake3:<hex>", enn_core.data.hashing) under the key "hash".
Manifests by earlier versions carry "blake2b-256-tree1m:<hex>" or "blake2b-256:<hex>", or a
bare sha256 hex under "sha256"; they are still read and still verify (the content hash of
such a manifest is unchanged).

In memory the manifest is a `StagedManifest` record (its arrays, files, labels and source as
nested records); `read_manifest` parses the file once, with the version checked, and
`StagedManifest.to_json` writes the same keys the file has always had. The feature specs stay
the JSON mappings the model builder and the consolidated checkpoint's `data` also read. What a
model knows of its data is a `DataSpec` (`StagedManifest.data_spec()`, or a checkpoint's).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from enn_core.config.loader import to_plain
from enn_core.errors import StaleOutputError

FORMAT_VERSION = 1
FORMAT_POLICY = (
    "readers accept only this format_version; an older staged dataset is refused with "
    "'re-run stage-data' (no migration), a newer one with 'upgrade enn'; hashes name their "
    "algorithm ('blake3:<hex>'; older 'blake2b-256-tree1m:' and 'blake2b-256:' still verify), "
    "a bare hex hash (written before the name) is sha256"
)
MANIFEST = "manifest.json"
# The manifest's part a model is built from and its checkpoint records (checkpoint.DATA_KEYS).
MODEL_DATA_KEYS = (
    "feature_specs",
    "label_shape",
    "label_axes",
    "label_axis_values",
    "label_stats",
    "row_keys",
    "naive_keys",
)


@dataclass(frozen=True)
class DataSpec:
    """What a model knows of its data: the inputs it reads and the labels it predicts (the
    manifest's MODEL_DATA_KEYS; a consolidated checkpoint's `data`)."""

    feature_specs: tuple[Mapping[str, Any], ...]
    label_shape: tuple[int, ...]
    label_axes: tuple[str, ...] = ()
    label_axis_values: Mapping[str, list[str]] = field(default_factory=dict)
    label_stats: Mapping[str, Any] = field(default_factory=dict)
    row_keys: tuple[str, ...] = ()
    naive_keys: tuple[str, ...] = ()

    @classmethod
    def of(cls, data: Mapping[str, Any]) -> DataSpec:
        """From a manifest or a checkpoint's `data` mapping (absent optional keys: empty)."""
        return cls(
            feature_specs=tuple(data.get("feature_specs") or ()),
            label_shape=tuple(int(s) for s in data.get("label_shape") or ()),
            label_axes=tuple(data.get("label_axes") or ()),
            label_axis_values=dict(data.get("label_axis_values") or {}),
            label_stats=dict(data.get("label_stats") or {}),
            row_keys=tuple(data.get("row_keys") or ()),
            naive_keys=tuple(data.get("naive_keys") or ()),
        )

    def as_dict(self) -> dict[str, Any]:
        """The file form (lists, plain dicts), as a checkpoint's `data` holds it."""
        return plain({k: getattr(self, k) for k in MODEL_DATA_KEYS})


def plain(obj: Any) -> Any:
    """JSON round trip: what weights_only loading accepts (and no numpy scalars)."""
    return json.loads(json.dumps(to_plain(obj), default=_json_default))


def _json_default(o: Any) -> Any:
    if hasattr(o, "tolist"):
        return o.tolist()
    return str(o)


@dataclass(frozen=True)
class ArrayEntry:
    """A staged array as `features` and `labels` name it: its file, dtype and shape."""

    file: str
    dtype: str
    shape: tuple[int, ...]

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ArrayEntry:
        return cls(str(d["file"]), str(d["dtype"]), tuple(int(s) for s in d["shape"]))

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "dtype": self.dtype, "shape": list(self.shape)}


@dataclass(frozen=True)
class FileEntry:
    """One staged file under `files`: dtype, shape and its data hash."""

    dtype: str
    shape: tuple[int, ...]
    hash: str
    """Algorithm-named ("blake3:<hex>"), or a bare sha256 hex (key "sha256", legacy)."""

    legacy_key: bool = False
    """Read from the key "sha256" (written before hashes named their algorithm)."""

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> FileEntry:
        legacy = "hash" not in d
        return cls(
            str(d["dtype"]),
            tuple(int(s) for s in d["shape"]),
            str(d["sha256"] if legacy else d["hash"]),
            legacy,
        )

    def to_json(self) -> dict[str, Any]:
        key = "sha256" if self.legacy_key else "hash"
        return {"dtype": self.dtype, "shape": list(self.shape), key: self.hash}


@dataclass(frozen=True)
class LabelStats:
    """The labels' train-split statistics (a scalar, or per-cell arrays in files)."""

    mean: Any = None
    std: Any = None
    cell_mean_file: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Keys this code does not name (`cell_std_file`, ...), kept as they were."""

    @classmethod
    def from_json(cls, d: Mapping[str, Any] | None) -> LabelStats:
        d = d or {}
        named = ("mean", "std", "cell_mean_file")
        return cls(
            d.get("mean"),
            d.get("std"),
            d.get("cell_mean_file"),
            {k: v for k, v in d.items() if k not in named},
        )

    def to_json(self) -> dict[str, Any]:
        measured = {k: v for k, v in (("mean", self.mean), ("std", self.std)) if v is not None}
        return {**measured, "cell_mean_file": self.cell_mean_file, **self.extra}


@dataclass(frozen=True)
class LabelInfo:
    """What the labels are: their shape, axis names and values, and statistics. Features-only
    data carries its training manifest's."""

    shape: tuple[int, ...]
    axes: tuple[str, ...] = ()
    axis_values: Mapping[str, list[str]] = field(default_factory=dict)
    stats: LabelStats = field(default_factory=LabelStats)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> LabelInfo | None:
        """From the manifest's flat `label_*` keys; None when it names no label shape."""
        if d.get("label_shape") is None:
            return None
        return cls(
            shape=tuple(int(s) for s in d["label_shape"]),
            axes=tuple(d.get("label_axes") or ()),
            axis_values=dict(d.get("label_axis_values") or {}),
            stats=LabelStats.from_json(d.get("label_stats")),
        )

    @staticmethod
    def to_json(label: LabelInfo | None) -> dict[str, Any]:
        if label is None:
            return dict.fromkeys(("label_shape", "label_axes", "label_axis_values", "label_stats"))
        return {
            "label_shape": list(label.shape),
            "label_axes": list(label.axes),
            "label_axis_values": {k: list(v) for k, v in label.axis_values.items()},
            "label_stats": label.stats.to_json(),
        }


@dataclass(frozen=True)
class SourceRecord:
    """Where the staged data came from, and the hash of what was read."""

    kind: str
    path: str | None = None
    hash: str | None = None
    hash_of: str = ""
    config: Mapping[str, Any] | None = None
    """The generator config (synthetic data)."""

    @classmethod
    def from_json(cls, d: Mapping[str, Any] | None) -> SourceRecord:
        d = d or {}
        return cls(
            kind=str(d.get("kind") or ""),
            path=d.get("path"),
            hash=d.get("hash"),
            hash_of=str(d.get("hash_of") or ""),
            config=d.get("config"),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "path": self.path,
            "hash": self.hash,
            "hash_of": self.hash_of,
            "config": self.config,
        }


@dataclass(frozen=True, kw_only=True)
class StagedManifest:
    """A staged dataset's manifest.json (module docstring): the record every reader uses."""

    mode: str
    """"training" (labels staged) or "features_only"."""

    n_rows: int
    features: ArrayEntry
    labels: ArrayEntry | None
    dtype_reason: str
    feature_names: tuple[str, ...]
    feature_specs: tuple[Mapping[str, Any], ...]
    """One JSON mapping per feature (name, kind, vocab, mean, std, cyclic_period, ...): the form
    the model builder and the consolidated checkpoint read."""

    label: LabelInfo | None
    row_keys: tuple[str, ...]
    naive_keys: tuple[str, ...]
    splits: Mapping[str, int]
    """Rows per split ("train", "val", "test")."""

    split_definition: Mapping[str, Any]
    """How the splits were drawn (seed, fractions or folds), as the config gave it."""

    dropped_rows: int
    source: SourceRecord
    training_manifest: str | None
    training_content_hash: str | None
    files: Mapping[str, FileEntry]
    content_hash: str

    @property
    def label_shape(self) -> tuple[int, ...] | None:
        return self.label.shape if self.label else None

    @property
    def label_axes(self) -> tuple[str, ...]:
        return self.label.axes if self.label else ()

    @property
    def label_axis_values(self) -> Mapping[str, list[str]]:
        return self.label.axis_values if self.label else {}

    @property
    def label_stats(self) -> LabelStats:
        return self.label.stats if self.label else LabelStats()

    def data_spec(self) -> DataSpec:
        """What a model built for this data knows of it (`build_model`, checkpoints)."""
        return DataSpec.of(self.model_data())

    def model_data(self) -> dict[str, Any]:
        """The JSON form of `data_spec()` with the content hash (MODEL_DATA_KEYS and
        "content_hash"), for the readers of mappings (the prediction schema checks)."""
        d = self.to_json()
        return {k: d[k] for k in (*MODEL_DATA_KEYS, "content_hash")}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> StagedManifest:
        """From a manifest file's dict of this format version (KeyError/TypeError/ValueError
        when a part is missing or malformed: `read_manifest` names the file)."""
        return cls(
            mode=str(d["mode"]),
            n_rows=int(d["n_rows"]),
            features=ArrayEntry.from_json(d["features"]),
            labels=ArrayEntry.from_json(d["labels"]) if d.get("labels") else None,
            dtype_reason=str(d.get("dtype_reason") or ""),
            feature_names=tuple(d.get("feature_names") or ()),
            feature_specs=tuple(d["feature_specs"]),
            label=LabelInfo.from_json(d),
            row_keys=tuple(d.get("row_keys") or ()),
            naive_keys=tuple(d.get("naive_keys") or ()),
            splits={k: int(v) for k, v in d["splits"].items()},
            split_definition=dict(d.get("split_definition") or {}),
            dropped_rows=int(d.get("dropped_rows") or 0),
            source=SourceRecord.from_json(d.get("source")),
            training_manifest=d.get("training_manifest"),
            training_content_hash=d.get("training_content_hash"),
            files={k: FileEntry.from_json(v) for k, v in d["files"].items()},
            content_hash=str(d["content_hash"]),
        )

    def to_json(self) -> dict[str, Any]:
        """The file form: the keys manifest.json has always had."""
        return {
            "format_version": FORMAT_VERSION,
            "format_policy": FORMAT_POLICY,
            "mode": self.mode,
            "n_rows": self.n_rows,
            "features": self.features.to_json(),
            "labels": self.labels.to_json() if self.labels else None,
            "dtype_reason": self.dtype_reason,
            "feature_names": list(self.feature_names),
            "feature_specs": [dict(s) for s in self.feature_specs],
            **LabelInfo.to_json(self.label),
            "row_keys": list(self.row_keys),
            "naive_keys": list(self.naive_keys),
            "splits": dict(self.splits),
            "split_definition": dict(self.split_definition),
            "dropped_rows": self.dropped_rows,
            "source": self.source.to_json(),
            "training_manifest": self.training_manifest,
            "training_content_hash": self.training_content_hash,
            "files": {k: v.to_json() for k, v in self.files.items()},
            "content_hash": self.content_hash,
        }


def content_hash(files: Mapping[str, FileEntry]) -> str:
    """sha256 over each staged array's name, dtype, shape and data hash (hashed while written).

    The data hashes are the algorithm-named strings, so the algorithm is part of what is
    hashed; this outer hash of a few hundred bytes stays sha256, a plain hex fingerprint.
    """
    items = [[name, f.dtype, list(f.shape), f.hash] for name, f in sorted(files.items())]
    return hashlib.sha256(json.dumps(items, separators=(",", ":")).encode()).hexdigest()


def read_manifest(directory: str | Path) -> StagedManifest:
    """The manifest of a staged dataset directory, with its version checked."""
    d = Path(directory)
    path = d / MANIFEST
    if not path.exists():
        raise StaleOutputError(
            f"{d}: no staged data ({MANIFEST} missing); run `enn stage-data` first"
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise StaleOutputError(f"{path}: unreadable manifest ({e}); re-run stage-data") from e
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if version != FORMAT_VERSION:
        if isinstance(version, int) and version > FORMAT_VERSION:
            raise StaleOutputError(
                f"{path}: format_version {version} is newer than this code reads "
                f"({FORMAT_VERSION}); upgrade enn"
            )
        raise StaleOutputError(
            f"{path}: format_version {version} but this code reads {FORMAT_VERSION}; "
            "re-run stage-data"
        )
    try:
        return StagedManifest.from_json(manifest)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise StaleOutputError(
            f"{path}: not a staged manifest ({type(e).__name__}: {e}); re-run stage-data"
        ) from e
