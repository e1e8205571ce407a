"""The consolidated checkpoint (`model.pt`, `init.pt`): one file that rebuilds the model.

`torch.save` of a dict that `torch.load(path, weights_only=True)` accepts (tensors, dicts,
lists, str, numbers, None only):

    {"format_version": 1, "state_dict": {name: tensor}, "model_config": {...},
     "data": {feature_specs, label_shape, label_axes, label_axis_values, label_stats,
              row_keys, naive_keys}, "data_fingerprint": str, "torch_version": str, "meta": {...}}

Written atomically (temp file + rename). predict, export, validate, collapse-check and
resume load it with `load_model(path) -> (model in eval mode, checkpoint dict)`.
`model_config_differences`, `data_schema_differences` and `state_dict_differences` name what
keeps a checkpoint from fitting this run (`model.d_model is 32 there, 64 here`), for refusals
such as prepare-checkpoint's warm start; `capped` joins them for a one-line message.
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


# --- Compatibility: what differs between a checkpoint and this run, named (warm start, resume) ---

# Feature-spec keys a warm start may see change: normalization statistics of new data (the
# source's buffers come with its weights); name, kind and vocab are compared on their own.
_SPEC_FREE = {"name", "kind", "vocab", "mean", "std"}
_SHOW = 4  # differences (and values) listed in a one-line message before "+N more"


def _fmt(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, str) else value


def _some(values: list, n: int = _SHOW) -> str:
    shown = ", ".join(_fmt(v) for v in values[:n])
    return shown + (f" (+{len(values) - n} more)" if len(values) > n else "")


def capped(diffs: list[str], n: int = _SHOW) -> str:
    """`a; b; c (+N more differences)`: a list of differences for a one-line message."""
    more = f" (+{len(diffs) - n} more differences)" if len(diffs) > n else ""
    return "; ".join(diffs[:n]) + more


def model_config_differences(theirs: Mapping, ours: Mapping) -> list[str]:
    """`model.d_model is 32 there, 64 here` for every differing field (theirs filled with
    today's defaults first, so a field added since it was written does not count)."""
    theirs = {**plain(ModelConfig()), **dict(theirs)}
    out = []
    for key in [*ours, *(k for k in theirs if k not in ours)]:
        a, b = theirs.get(key, "absent"), ours.get(key, "absent")
        if a != b:
            out.append(f"model.{key} is {_fmt(a)} there, {_fmt(b)} here")
    return out


def _values_differ(theirs: list | None, ours: list | None) -> str:
    """'' when equal; else which values are missing or new here (or that only the order
    differs: the integer codes, or the grid positions, then mean other values)."""
    a, b = list(theirs or []), list(ours or [])
    if a == b:
        return ""
    missing, new = [v for v in a if v not in b], [v for v in b if v not in a]
    what = [f"{_some(missing)} missing here"] if missing else []
    what += [f"{_some(new)} new here"] if new else []
    return ", ".join(what) or "same values in another order (codes differ)"


def _feature_differences(theirs: list, ours: list) -> list[str]:
    t = {s["name"]: s for s in theirs}
    o = {s["name"]: s for s in ours}
    out = []
    if removed := [n for n in t if n not in o]:
        out.append(f"features {_some(removed)} there but not here")
    if added := [n for n in o if n not in t]:
        out.append(f"features {_some(added)} here but not there")
    common_t = [n for n in t if n in o]
    if common_t != [n for n in o if n in t]:
        out.append(
            f"feature order is {_some(common_t, 8)} there, {_some([n for n in o if n in t], 8)} here"
        )
    for name in (n for n in o if n in t):
        a, b = t[name], o[name]
        if a.get("kind") != b.get("kind"):
            out.append(f"feature {name} is {a.get('kind')} there, {b.get('kind')} here")
            continue
        if what := _values_differ(a.get("vocab"), b.get("vocab")):
            out.append(f"feature {name} vocabulary: {what}")
        for key in sorted((set(a) | set(b)) - _SPEC_FREE):  # cyclic period, start, offset...
            if a.get(key) != b.get(key):
                out.append(
                    f"feature {name} {key} is {_fmt(a.get(key, 'absent'))} there, {_fmt(b.get(key, 'absent'))} here"
                )
    return out


def data_schema_differences(theirs: Mapping, ours: Mapping) -> list[str]:
    """Differences in what the weights depend on: features (names, order, kinds, vocabularies,
    periods), label shape, axes and axis values. Normalization statistics may differ (new data)."""
    out = _feature_differences(
        list(theirs.get("feature_specs") or []), list(ours.get("feature_specs") or [])
    )
    for key in ("label_shape", "label_axes"):
        if theirs.get(key) != ours.get(key):
            out.append(f"{key} is {_fmt(theirs.get(key))} there, {_fmt(ours.get(key))} here")
    av_t, av_o = theirs.get("label_axis_values") or {}, ours.get("label_axis_values") or {}
    for axis in dict.fromkeys([*av_o, *av_t]):
        if what := _values_differ(av_t.get(axis), av_o.get(axis)):
            out.append(f"label axis {axis} values: {what}")
    return out


def state_dict_differences(
    theirs: Mapping[str, torch.Tensor], ours: Mapping[str, torch.Tensor]
) -> list[str]:
    """Keys missing or unexpected, and shapes that differ: what a strict load would refuse."""
    out = []
    if missing := [k for k in ours if k not in theirs]:
        out.append(f"weights {_some(missing)} missing there")
    if extra := [k for k in theirs if k not in ours]:
        out.append(f"weights {_some(extra)} not in this model")
    for k in (k for k in ours if k in theirs):
        if tuple(theirs[k].shape) != tuple(ours[k].shape):
            out.append(f"{k} has shape {list(theirs[k].shape)} there, {list(ours[k].shape)} here")
    return out
