"""prepare-checkpoint: the initial consolidated checkpoint distributed-train starts from.

Reads the staged manifest (`outputs/stage-data/manifest.json`), builds the model from
`model` config with `model.init_seed` (the same seed gives a bit-identical `init.pt`), and
writes `init.pt` (consolidated format, enn_core.checkpoint) and `init.json` (a summary)
atomically into `outputs/prepare-checkpoint/`. With `checkpoint.init_from` set to a
consolidated checkpoint (a model.pt or init.pt path, or a folder holding model.pt such as a
registered model version the task layer downloaded), its weights are the start instead (warm
start): refused with the differences named unless it was built with the same model config
and data schema and its weights load strictly; init.json records the source (path, sha256,
data fingerprint, meta) and whether it was trained on the same data.

    enn prepare-checkpoint          # via the CLI; here: run(cfg, ctx) -> summary dict
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from enn_core.atomic import atomic_dir, write_json
from enn_core.checkpoint import (
    FORMAT_VERSION,
    built_to_load,
    capped,
    data_schema_differences,
    holding,
    model_config_differences,
    plain,
    read_checkpoint,
    save_consolidated,
    state_dict_differences,
)
from enn_core.config import RunConfig
from enn_core.data.hashing import sha256_file
from enn_core.data.manifest import MANIFEST, StagedManifest
from enn_core.data.manifest import read_manifest as read_staged_manifest
from enn_core.errors import ConfigError, StaleOutputError, UntrustedCheckpointError
from enn_core.model import ENN, ModelCode, build_model
from enn_core.paths import Layout
from enn_core.stage import StageContext
from enn_core.summaries import InitSummary, Scalar


def read_manifest(staged: Path) -> StagedManifest:
    """The staged manifest, checked for presence and format version."""
    path = staged / MANIFEST
    if not path.is_file():
        raise StaleOutputError(f"{path}: no staged manifest; run stage-data first")
    return read_staged_manifest(staged)


FRESH_START = "start fresh (checkpoint.init_from: '')"


def resolve_source(source: str, layout: Layout) -> Path:
    """`checkpoint.init_from` as an existing consolidated checkpoint file (a folder -> its
    model.pt)."""
    if source.startswith(("models:/", "runs:/")) or source == "champion":
        raise ConfigError(
            f"checkpoint.init_from={source}: registry URIs are resolved by the task layer "
            "(enn run / the Prefect flow) into a local folder; here give that folder or a "
            "model.pt/init.pt path"
        )
    path = layout.resolve(source)
    if path.is_dir():
        if not (path / "model.pt").is_file():
            raise ConfigError(
                f"checkpoint.init_from={source}: folder {path} holds no model.pt; give the "
                f"checkpoint file itself (model.pt or init.pt) or {FRESH_START}"
            )
        path = path / "model.pt"
    if not path.is_file():
        raise ConfigError(
            f"checkpoint.init_from={source}: no consolidated checkpoint at {path}; give the path "
            f"of a model.pt or init.pt (or a folder holding model.pt), or {FRESH_START}"
        )
    return path.resolve()


def _refuse_mismatch(source: str, model_diffs: list[str], data_diffs: list[str]) -> None:
    if not model_diffs and not data_diffs:
        return
    what = " and ".join(
        w
        for w, d in (("another model config", model_diffs), ("another data schema", data_diffs))
        if d
    )
    fix = " and ".join(
        f
        for f, d in (
            ("set model.* as it was", model_diffs),
            ("stage data of its schema", data_diffs),
        )
        if d
    )
    raise ConfigError(
        f"checkpoint.init_from={source} was built with {what}: {capped(model_diffs + data_diffs)}; "
        f"{fix}, or {FRESH_START}"
    )


def _scalars(meta: Mapping[str, Any]) -> dict[str, Scalar]:
    """The scalar entries of a checkpoint's meta (stage, run, step, version...), not its tensors'
    lists."""
    return {k: v for k, v in meta.items() if isinstance(v, (str, int, float, bool)) or v is None}


def warm_start(
    cfg: RunConfig,
    manifest: StagedManifest,
    source: str,
    layout: Layout,
    build: Callable[[], ENN],
) -> tuple[ENN, dict[str, Any]]:
    """(the model `build()` makes, holding a compatible consolidated checkpoint's weights
    (loaded strictly), what was used).

    Refuses (ConfigError, differences named) another model config, another data schema
    (features, vocabularies, label shape/axes) or weights that do not load strictly. The
    source's normalization buffers come with its weights (they are what the weights were
    trained with); data that differs but fits (another fingerprint) is allowed and recorded.
    The model is built with its parameters on the meta device and the source's tensors (its
    file's mapped pages) assigned to them: no initialised copy of weights about to be replaced.
    """
    path = resolve_source(source, layout)
    try:
        ckpt = read_checkpoint(path)
    except UntrustedCheckpointError:
        raise  # a crafted file is not a config problem: exit 4, as every refused file
    except StaleOutputError as e:
        raise ConfigError(f"checkpoint.init_from={source}: {e}") from e
    ours_data = manifest.data_spec().as_dict()
    _refuse_mismatch(
        source,
        model_config_differences(ckpt.model_config, plain(cfg.model)),
        data_schema_differences(ckpt.data.as_dict(), ours_data),
    )
    # The neighbour prior (model.prior_weight) keeps THIS run's training rows, not the source's.
    model = built_to_load(build)
    ours = model.state_dict()
    state = {k: v for k, v in ckpt.state_dict.items() if not k.startswith("prior.")}
    state.update({k: v for k, v in ours.items() if k.startswith("prior.")})
    if diffs := state_dict_differences(state, ours):
        raise ConfigError(
            f"checkpoint.init_from={source}: its weights do not load into this model: "
            f"{capped(diffs)}; re-create it with this code or {FRESH_START}"
        )
    model = holding(model, state, build)
    theirs_fp = ckpt.data_fingerprint
    ours_fp = manifest.content_hash
    registry = path.parent / "SOURCE"  # written by the task layer's registry download
    return model, {
        "init_from": source,
        "path": str(path),
        "sha256": sha256_file(path),
        "registry_uri": registry.read_text().strip() if registry.is_file() else None,
        "data_fingerprint": theirs_fp,
        "same_data": bool(theirs_fp) and theirs_fp == ours_fp,
        "torch_version": ckpt.torch_version,
        "meta": _scalars(ckpt.meta),
    }


def run(cfg: RunConfig, ctx: StageContext, *, staged: Path) -> InitSummary:
    """Build (or warm-start) the model and write init.pt + init.json atomically.

    Every check runs before anything is written: a refused warm start leaves the previous
    outputs untouched.
    """
    manifest = read_manifest(staged)
    code = ModelCode.of(cfg.model, ctx.layout.root)

    def build() -> ENN:
        return build_model(cfg.model, manifest.data_spec(), data_dir=staged, code=code)

    source = cfg.checkpoint.init_from
    warm = None
    if source:
        model, warm = warm_start(cfg, manifest, source, ctx.layout, build)
    else:  # built once: its own initialisation, seeded; written without a copy
        model = build()
    meta = {
        "stage": ctx.stage,
        "init_seed": cfg.model.init_seed,
        "init_from": source or "fresh",
        **({"init_source_sha256": warm["sha256"]} if warm else {}),
    }
    described = model.describe()
    with atomic_dir(ctx.output()) as tmp:
        save_consolidated(tmp / "init.pt", model, cfg.model, manifest, meta)
        summary = InitSummary(
            output=str(ctx.output()),
            path=str(ctx.output() / "init.pt"),
            sha256=sha256_file(tmp / "init.pt"),
            init_seed=cfg.model.init_seed,
            init_from=source or "fresh",
            warm_start=warm,
            data_fingerprint=manifest.content_hash,
            parameters=int(described["parameters"]),
        )
        record = {
            "format_version": FORMAT_VERSION,
            "checkpoint": "init.pt",
            **{k: v for k, v in summary.as_dict().items() if k not in ("output", "path")},
            "model": described,
        }
        del record["parameters"]
        write_json(tmp / "init.json", record)
    _record(ctx, cfg, summary)
    return summary


def _record(ctx: StageContext, cfg: RunConfig, summary: InitSummary) -> None:
    """Params for the tracker (through the events file) and one log line."""
    ctx.events.param("model.preset", cfg.model.preset)
    ctx.events.param("model.parameters", summary.parameters)
    ctx.events.param("checkpoint.init_from", summary.init_from)
    warm = summary.warm_start
    if warm:
        for key in ("path", "sha256", "data_fingerprint", "same_data", "registry_uri"):
            ctx.events.param(f"checkpoint.init_source.{key}", warm[key])
        ctx.events.param("checkpoint.init_source.stage", warm["meta"].get("stage"))
    how = (
        f"warm start from {warm['path']} ({'same' if warm['same_data'] else 'other'} data)"
        if warm
        else f"fresh (init_seed {summary.init_seed})"
    )
    ctx.logger.info(
        "%s: %s, %d parameters, sha256 %s, %s",
        ctx.stage,
        cfg.model.preset,
        summary.parameters,
        summary.sha256[:12],
        how,
    )
