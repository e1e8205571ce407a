"""The consolidated checkpoint (`model.pt`, `init.pt`): one file that rebuilds the model.

`torch.save` of a dict that `torch.load(path, weights_only=True)` accepts (tensors, dicts,
lists, str, numbers, None only):

    {"format_version": 1, "state_dict": {name: tensor}, "model_config": {...},
     "data": {feature_specs, label_shape, label_axes, label_axis_values, label_stats,
              row_keys, naive_keys}, "data_fingerprint": str, "torch_version": str, "meta": {...}}

Written atomically (temp file + rename). predict, export, validate, collapse-check and
resume load it with `load_model(path) -> (model in eval mode, checkpoint dict)`.
"""

from __future__ import annotations

import json
import pickle
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from enn_core.atomic import atomic_file
from enn_core.config.loader import build, to_plain
from enn_core.config.model import ModelConfig
from enn_core.errors import ConfigError, StaleOutputError
from enn_core.model.enn import ENN, build_model

FORMAT_VERSION = 1
DATA_KEYS = (
    "feature_specs",
    "label_shape",
    "label_axes",
    "label_axis_values",
    "label_stats",
    "row_keys",
    "naive_keys",
)
_WRAPPER_PREFIXES = ("_orig_mod.", "module.", "_fsdp_wrapped_module.")


def plain(obj: Any) -> Any:
    """JSON round trip: what weights_only loading accepts (and no numpy scalars)."""
    return json.loads(json.dumps(to_plain(obj), default=_json_default))


def _json_default(o: Any) -> Any:
    if hasattr(o, "tolist"):
        return o.tolist()
    return str(o)


def data_spec(manifest: Mapping) -> dict:
    """The part of the staged manifest a model needs to be rebuilt and to read its inputs."""
    return plain({k: manifest.get(k) for k in DATA_KEYS})


def _strip(name: str) -> str:
    for p in _WRAPPER_PREFIXES:
        name = name.replace(p, "")
    return name


def consolidated_state_dict(
    model: nn.Module | Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Plain CPU tensors under the bare model's names (compile/DDP wrappers stripped).

    For an FSDP2 model, gather first (e.g. torch.distributed.checkpoint.state_dict.
    get_model_state_dict with full_state_dict=True) and pass the resulting mapping.
    """
    sd = model.state_dict() if isinstance(model, nn.Module) else model
    out = {}
    for k, v in sd.items():
        if not isinstance(v, torch.Tensor):
            raise StaleOutputError(
                f"state_dict[{k!r}] is a {type(v).__name__}, not a tensor; gather the full state dict first"
            )
        if hasattr(v, "full_tensor"):  # a DTensor that was not gathered
            v = v.full_tensor()
        out[_strip(k)] = v.detach().to("cpu").clone().contiguous()
    return out


def make_checkpoint(
    model: nn.Module | Mapping[str, torch.Tensor],
    model_cfg: ModelConfig,
    manifest: Mapping,
    meta: Mapping | None = None,
) -> dict:
    return {
        "format_version": FORMAT_VERSION,
        "state_dict": consolidated_state_dict(model),
        "model_config": plain(model_cfg),
        "data": data_spec(manifest),
        "data_fingerprint": str(manifest.get("content_hash") or ""),
        "torch_version": str(torch.__version__),
        "meta": plain(dict(meta or {})),
    }


def save_consolidated(
    path: str | Path,
    model: nn.Module | Mapping[str, torch.Tensor],
    model_cfg: ModelConfig,
    manifest: Mapping,
    meta: Mapping | None = None,
) -> Path:
    """Write the consolidated checkpoint atomically; returns the path."""
    path = Path(path)
    ckpt = make_checkpoint(model, model_cfg, manifest, meta)
    with atomic_file(path, "wb") as f:
        torch.save(ckpt, f)
    return path


def read_checkpoint(path: str | Path) -> dict:
    """Load and check a consolidated checkpoint (weights_only: no code runs on load)."""
    path = Path(path)
    if not path.is_file():
        raise StaleOutputError(
            f"{path}: no checkpoint there; run prepare-checkpoint or distributed-train first"
        )
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, pickle.UnpicklingError, zipfile.BadZipFile, EOFError) as e:
        raise StaleOutputError(
            f"{path}: not a readable consolidated checkpoint ({str(e).splitlines()[0]}); re-create it"
        ) from e
    if not isinstance(ckpt, dict) or "format_version" not in ckpt:
        raise StaleOutputError(
            f"{path}: not a consolidated checkpoint (no format_version); re-create it with save_consolidated"
        )
    if ckpt["format_version"] != FORMAT_VERSION:
        raise StaleOutputError(
            f"{path}: checkpoint format_version={ckpt['format_version']} but this code reads {FORMAT_VERSION}; "
            "re-run the stage that wrote it with this version"
        )
    for key in ("state_dict", "model_config", "data"):
        if key not in ckpt:
            raise StaleOutputError(
                f"{path}: checkpoint lacks {key!r}; re-create it with save_consolidated"
            )
    return ckpt


def model_from_checkpoint(ckpt: Mapping, where: str = "checkpoint") -> ENN:
    """Rebuild the model from the stored config and data spec, then load the weights."""
    try:
        cfg = build(ModelConfig, ckpt["model_config"], root=ModelConfig, where=where)
    except ConfigError as e:
        raise StaleOutputError(
            f"{where}: stored model_config no longer valid ({e}); re-create the checkpoint"
        ) from e
    data = dict(ckpt["data"])
    # Label statistics come from the state dict's buffers; per-cell stat files need no data dir.
    data["label_stats"] = {"mean": 0.0, "std": 1.0}
    model = build_model(cfg, data)
    missing, unexpected = model.load_state_dict(ckpt["state_dict"], strict=False)
    if missing or unexpected:
        raise StaleOutputError(
            f"{where}: weights do not fit the stored config (missing {list(missing)[:3]}, unexpected {list(unexpected)[:3]}); re-create the checkpoint"
        )
    return model


def load_model(path: str | Path) -> tuple[ENN, dict]:
    """(model in eval mode on CPU, checkpoint dict) from a consolidated checkpoint file."""
    ckpt = read_checkpoint(path)
    return model_from_checkpoint(ckpt, where=str(path)).eval(), ckpt
