"""prepare-checkpoint: the initial consolidated checkpoint distributed-train starts from.

Reads the staged manifest (`outputs/stage-data/manifest.json`), builds the model from
`model` config with `model.init_seed` (the same seed gives a bit-identical `init.pt`), and
writes `init.pt` (consolidated format, enn_core.checkpoint) and `init.json` (a summary)
atomically into `outputs/prepare-checkpoint/`. With `checkpoint.init_from` set to a
consolidated checkpoint path, its weights are the start instead (warm start), after
checking that it was built for the same model config and data layout.

    enn prepare-checkpoint          # via the CLI; here: run(cfg, ctx) -> summary dict
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

from enn_core.atomic import atomic_dir, write_json
from enn_core.checkpoint import FORMAT_VERSION, data_spec, load_model, plain, save_consolidated
from enn_core.errors import ConfigError, StaleOutputError
from enn_core.model import build_model
from enn_core.stage import StageContext

MANIFEST_VERSION = 1


def read_manifest(staged: Path) -> dict:
    """The staged manifest, checked for presence and format version."""
    path = staged / "manifest.json"
    if not path.is_file():
        raise StaleOutputError(f"{path}: no staged manifest; run stage-data first")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise StaleOutputError(
            f"{path}: manifest is not valid JSON ({e}); re-run stage-data"
        ) from e
    if manifest.get("format_version") != MANIFEST_VERSION:
        raise StaleOutputError(
            f"{path}: manifest format_version={manifest.get('format_version')} but this code reads {MANIFEST_VERSION}; re-run stage-data"
        )
    return manifest


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _warm_start(cfg, manifest: Mapping, source: str, layout) -> dict:
    """State dict of a compatible consolidated checkpoint (same model config and data layout)."""
    if source.startswith("models:/"):
        raise ConfigError(
            f"checkpoint.init_from={source}: registry URIs are resolved by the task layer; pass a file path here"
        )
    model, ckpt = load_model(layout.resolve(source))
    if ckpt["model_config"] != plain(cfg.model):
        raise ConfigError(
            f"checkpoint.init_from={source} was built with another model config; match model.* or start fresh (init_from: '')"
        )
    theirs, ours = ckpt["data"], data_spec(manifest)
    for key in ("feature_specs", "label_shape"):
        if theirs.get(key) != ours.get(key):
            raise ConfigError(
                f"checkpoint.init_from={source}: its data {key} differs from the staged data; start fresh (init_from: '')"
            )
    return model.state_dict()


def run(cfg, ctx: StageContext) -> dict:
    """Build (or warm-start) the model and write init.pt + init.json atomically."""
    manifest = read_manifest(ctx.output("stage-data"))
    model = build_model(cfg.model, manifest, data_dir=ctx.output("stage-data"))
    source = cfg.checkpoint.init_from
    if source:
        model.load_state_dict(_warm_start(cfg, manifest, source, ctx.layout))
    meta = {
        "stage": "prepare-checkpoint",
        "init_seed": cfg.model.init_seed,
        "init_from": source or "fresh",
    }
    with atomic_dir(ctx.output()) as tmp:
        save_consolidated(tmp / "init.pt", model, cfg.model, manifest, meta)
        summary = {
            "format_version": FORMAT_VERSION,
            "checkpoint": "init.pt",
            "sha256": sha256_file(tmp / "init.pt"),
            "init_seed": cfg.model.init_seed,
            "init_from": source or "fresh",
            "data_fingerprint": str(manifest.get("content_hash") or ""),
            "model": model.describe(),
        }
        write_json(tmp / "init.json", summary)
    ctx.events.param("model_preset", cfg.model.preset)
    ctx.events.param("model_parameters", summary["model"]["parameters"])
    ctx.events.param("init_from", summary["init_from"])
    ctx.logger.info(
        "prepare-checkpoint: %s, %d parameters, sha256 %s",
        cfg.model.preset,
        summary["model"]["parameters"],
        summary["sha256"][:12],
    )
    return {
        "path": str(ctx.output() / "init.pt"),
        **{k: summary[k] for k in ("sha256", "init_seed", "init_from", "data_fingerprint")},
        "parameters": summary["model"]["parameters"],
    }
