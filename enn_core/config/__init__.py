"""The run config: one frozen dataclass per component, composed into `RunConfig`.

Merge order: dataclass defaults -> params.yaml -> `--set key=value` overrides.
`load_config()` is the only entry point; `docs/config.md` is generated from these classes
(`python -m enn_core.docs`), and a test fails when it is stale.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import typing
from collections.abc import Iterable
from dataclasses import field
from pathlib import Path
from typing import Any

from enn_core.config.data import DataConfig, SyntheticConfig, WorkbookLayout
from enn_core.config.deploy import DeployConfig
from enn_core.config.fault import FaultConfig
from enn_core.config.fields import frozen
from enn_core.config.loader import (
    _coerce,
    all_keys,
    build,
    canonical_json,
    deep_merge,
    parse_override,
    read_yaml,
    to_plain,
)
from enn_core.config.model import ModelConfig
from enn_core.config.runtime import RuntimeConfig
from enn_core.config.stages import (
    CheckpointConfig,
    CollapseConfig,
    ExportConfig,
    PredictConfig,
    ValidateConfig,
)
from enn_core.config.tracking import TrackingConfig
from enn_core.config.train import TrainConfig
from enn_core.config.tune import GcConfig, TuneConfig, dimensions
from enn_core.config.urls import URL_KEYS, redact_override, redact_url
from enn_core.errors import ConfigError


@frozen
class RunConfig:
    data: DataConfig = field(default_factory=DataConfig)
    """stage-data: input and staging."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The ENN model."""

    train: TrainConfig = field(default_factory=TrainConfig)
    """distributed-train: optimisation, precision, kernels, memory."""

    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    """Workers, devices, timeouts (not part of result fingerprints)."""

    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """prepare-checkpoint and training checkpoints."""

    validate: ValidateConfig = field(default_factory=ValidateConfig)
    """validate: the baselines scored beside the model."""

    predict: PredictConfig = field(default_factory=PredictConfig)
    """predict."""

    collapse: CollapseConfig = field(default_factory=CollapseConfig)
    """collapse-check."""

    export: ExportConfig = field(default_factory=ExportConfig)
    """export."""

    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """MLflow tracking."""

    deploy: DeployConfig = field(default_factory=DeployConfig)
    """Deployments, schedules and local servers."""

    fault: FaultConfig = field(default_factory=FaultConfig)
    """Fault injection (tests only)."""

    tune: TuneConfig = field(default_factory=TuneConfig)
    """`enn tune`: the hyperparameter search (Optuna) over model and train keys."""

    gc: GcConfig = field(default_factory=GcConfig)
    """`enn gc`: what old checkpoints, trials and failed runs' artifacts may be removed."""


FAULTS_ALLOWED_ENV = "ENN_ALLOW_FAULTS"

PATH_KEYS = frozenset(
    {
        "data.path",
        "data.labels_path",
        "data.training_manifest",
        "checkpoint.init_from",
        "checkpoint.dir",
        "checkpoint.resume_from",
        "predict.model",
        "predict.input_dir",
        "predict.parts_dir",
        "predict.calibration_dir",
    }
)
"""The keys of the pipeline's sections whose value is a file or folder (relative to the
pipeline's folder): a `--set` path inside the project is recorded relative to it, one outside
is never written into a tracked params file (flows/params_file.py)."""


def load_config(
    path: str | Path | None = "params.yaml",
    overrides: Iterable[str] = (),
    *,
    allow_faults: bool | None = None,
) -> RunConfig:
    """defaults -> file -> overrides, validated. `path=None` means defaults only."""
    data: dict[str, Any] = read_yaml(Path(path)) if path is not None else {}
    where = str(path) if path is not None else "defaults"
    for text in overrides:
        key, value = parse_override(text)
        deep_merge(data, key, value, RunConfig)
        where = f"{where} + --set"
    cfg = build(RunConfig, data, root=RunConfig, where=where)
    check_space_keys(cfg, where)
    if allow_faults is None:
        allow_faults = os.environ.get(FAULTS_ALLOWED_ENV) == "1"
    if cfg.fault.kind != "none" and not allow_faults:
        raise ConfigError(
            f"fault.kind={cfg.fault.kind} is for tests only; remove the fault section "
            f"(or set {FAULTS_ALLOWED_ENV}=1 inside a test)"
        )
    return cfg


def check_space_keys(cfg: RunConfig, where: str) -> None:
    """Each `tune.space` key is a config key (its range was checked by TuneConfig) and its
    bounds or choices are values of that key's type (an integer key searched over floats would
    fail every trial)."""
    valid = set(all_keys(RunConfig))
    for key in cfg.tune.space:
        if key not in valid:
            close = difflib.get_close_matches(key, sorted(valid), n=1, cutoff=0.5)
            hint = f"did you mean '{close[0]}'?" if close else "see docs/config.md"
            raise ConfigError(f"{where}: tune.space.{key}: unknown config key; {hint}")
    for dim in dimensions(cfg.tune):
        section, name = dim.key.split(".")
        kind = typing.get_type_hints(type(getattr(cfg, section)))[name]
        ends = dim.choices if dim.kind == "choice" else (dim.low, dim.high)
        for value in ends:
            value = int(value) if dim.kind == "int" else value
            _coerce(value, kind, f"tune.space.{dim.key}", where)


@functools.cache
def all_config_keys() -> frozenset[str]:
    """Every dotted key of the run config (sections and leaves)."""
    return frozenset(all_keys(RunConfig))


def sections_of(cfg: RunConfig, sections: Iterable[str]) -> dict[str, Any]:
    """The plain params of `sections` (a stage's spec says which it reads: its MLflow params)."""
    return {s: to_plain(getattr(cfg, s)) for s in sections}


def to_logged(cfg: RunConfig) -> dict[str, Any]:
    """The plain config as it is shown (a run directory's config.yaml, MLflow params): the
    user info of its URLs (`tune.storage`, `tracking.uri`) redacted."""
    plain: dict[str, Any] = to_plain(cfg)
    for key in URL_KEYS:
        section, name = key.split(".")
        plain[section][name] = redact_url(plain[section][name])
    return plain


def replace_key(cfg: RunConfig, key: str, value: object) -> RunConfig:
    """`cfg` with the value at `section.name` replaced (the config stays frozen)."""
    section, name = key.split(".")
    changed = dataclasses.replace(getattr(cfg, section), **{name: value})
    return dataclasses.replace(cfg, **{section: changed})


__all__ = [
    "PATH_KEYS",
    "all_config_keys",
    "CheckpointConfig",
    "CollapseConfig",
    "ConfigError",
    "DataConfig",
    "DeployConfig",
    "ExportConfig",
    "FaultConfig",
    "GcConfig",
    "ModelConfig",
    "PredictConfig",
    "RunConfig",
    "RuntimeConfig",
    "SyntheticConfig",
    "TrackingConfig",
    "TrainConfig",
    "TuneConfig",
    "ValidateConfig",
    "WorkbookLayout",
    "canonical_json",
    "load_config",
    "replace_key",
    "sections_of",
    "to_logged",
    "to_plain",
    "redact_override",
    "redact_url",
]
