"""The consolidated checkpoint (`model.pt`, `init.pt`): one file that rebuilds the model.

`torch.save` of a dict that `torch.load(path, weights_only=True)` accepts (tensors, dicts,
lists, str, numbers, None only):

    {"format_version": 1, "state_dict": {name: tensor}, "model_config": {...},
     "data": {feature_specs, label_shape, label_axes, label_axis_values, label_stats,
              row_keys, naive_keys}, "data_fingerprint": str, "torch_version": str, "meta": {...}}

Written atomically (temp file + rename). In memory it is a `Checkpoint` record (its `data` a
`DataSpec`); the dict above exists only in the file. predict, export, validate,
collapse-check and warm start load it with `load_model(path) -> (model in eval mode,
Checkpoint)`; `read_checkpoint(path)` checks the format version and every field.
`model_config_differences`, `data_schema_differences` and `state_dict_differences` name what
keeps a checkpoint from fitting this run (`model.d_model is 32 there, 64 here`), for refusals
such as prepare-checkpoint's warm start; `capped` joins them for a one-line message.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from enn_core.atomic import atomic_file
from enn_core.config.loader import build
from enn_core.config.model import ModelConfig
from enn_core.data.manifest import MODEL_DATA_KEYS, DataSpec, StagedManifest, plain
from enn_core.errors import ConfigError, StaleOutputError
from enn_core.model.enn import ENN, PriorSize, build_model
from enn_core.model_code import BUILTIN, ModelCode
from enn_core.tensor_file import load_tensors

FORMAT_VERSION = 1
DATA_KEYS = MODEL_DATA_KEYS  # the staged manifest's part a model is rebuilt from
_WRAPPER_PREFIXES = ("_orig_mod.", "module.", "_fsdp_wrapped_module.")


@dataclass(frozen=True)
class Checkpoint:
    """A consolidated checkpoint in memory (see the module docstring for the file form)."""

    state_dict: dict[str, torch.Tensor]
    model_config: Mapping[str, Any]
    data: DataSpec
    data_fingerprint: str = ""
    torch_version: str = ""
    meta: Mapping[str, Any] = field(default_factory=dict)

    def to_file(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "state_dict": self.state_dict,
            "model_config": dict(self.model_config),
            "data": self.data.as_dict(),
            "data_fingerprint": self.data_fingerprint,
            "torch_version": self.torch_version,
            "meta": dict(self.meta),
        }

    @classmethod
    def from_file(cls, raw: object, where: str) -> Checkpoint:
        """The record of a loaded file's dict; a wrong version or a missing part is refused."""
        if not isinstance(raw, dict) or "format_version" not in raw:
            raise StaleOutputError(
                f"{where}: not a consolidated checkpoint (no format_version); re-create it with "
                "save_consolidated"
            )
        if raw["format_version"] != FORMAT_VERSION:
            raise StaleOutputError(
                f"{where}: checkpoint format_version={raw['format_version']} but this code reads "
                f"{FORMAT_VERSION}; re-run the stage that wrote it with this version"
            )
        for key in ("state_dict", "model_config", "data"):
            if not isinstance(raw.get(key), dict):
                raise StaleOutputError(
                    f"{where}: checkpoint lacks {key!r}; re-create it with save_consolidated"
                )
        bad = [k for k, v in raw["state_dict"].items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise StaleOutputError(
                f"{where}: state_dict[{bad[0]!r}] is not a tensor; re-create the checkpoint"
            )
        return cls(
            state_dict=raw["state_dict"],
            model_config=raw["model_config"],
            data=DataSpec.of(raw["data"]),
            data_fingerprint=str(raw.get("data_fingerprint") or ""),
            torch_version=str(raw.get("torch_version") or ""),
            meta=dict(raw.get("meta") or {}),
        )


def _strip(name: str) -> str:
    for p in _WRAPPER_PREFIXES:
        name = name.replace(p, "")
    return name


def consolidated_state_dict(
    model: nn.Module | Mapping[str, torch.Tensor], *, copy: bool = True
) -> dict[str, torch.Tensor]:
    """Plain CPU tensors under the bare model's names (compile/DDP wrappers stripped).

    For an FSDP2 model, gather first (e.g. torch.distributed.checkpoint.state_dict.
    get_model_state_dict with full_state_dict=True) and pass the resulting mapping.
    `copy=False` (a dict written at once and dropped, as `save_consolidated` does): a CPU
    tensor that is the whole of its own storage is taken as it is, not copied, so that writing
    a model holds it once, not twice (issue 55); the rest (a view, a tied weight's second name)
    is copied as before, so the file's bytes are the same either way.
    """
    sd = model.state_dict() if isinstance(model, nn.Module) else model
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()  # the storages taken as they are
    for k, v in sd.items():
        if not isinstance(v, torch.Tensor):
            raise StaleOutputError(
                f"state_dict[{k!r}] is a {type(v).__name__}, not a tensor; "
                "gather the full state dict first"
            )
        if hasattr(v, "full_tensor"):  # a DTensor that was not gathered
            v = v.full_tensor()
        v = v.detach().to("cpu")
        if not copy and _owns_storage(v) and v.untyped_storage().data_ptr() not in seen:
            seen.add(v.untyped_storage().data_ptr())
            out[_strip(k)] = v
        else:
            out[_strip(k)] = v.clone().contiguous()
    return out


def _owns_storage(t: torch.Tensor) -> bool:
    """Whether `t` is all of its storage, contiguous from its start: saved as it is, it writes
    the bytes its copy would."""
    nbytes = t.numel() * t.element_size()
    return (
        nbytes > 0
        and t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == nbytes
    )


def _data_of(manifest: StagedManifest | Mapping[str, Any]) -> tuple[DataSpec, str]:
    """(what the model knows of its data, the data's content hash)."""
    if isinstance(manifest, StagedManifest):
        return manifest.data_spec(), manifest.content_hash
    spec = DataSpec.of(plain({k: manifest.get(k) for k in DATA_KEYS}))
    return spec, str(manifest.get("content_hash") or "")


def make_checkpoint(
    model: nn.Module | Mapping[str, torch.Tensor],
    model_cfg: ModelConfig,
    manifest: StagedManifest | Mapping[str, Any],
    meta: Mapping[str, Any] | None = None,
    *,
    copy: bool = True,
) -> Checkpoint:
    """`manifest`: the staged data's (or the JSON form of its `model_data()`); `copy`: as
    `consolidated_state_dict`'s (False only for a record written at once and dropped)."""
    data, fingerprint = _data_of(manifest)
    return Checkpoint(
        state_dict=consolidated_state_dict(model, copy=copy),
        model_config=plain(model_cfg),
        data=data,
        data_fingerprint=fingerprint,
        torch_version=str(torch.__version__),
        meta=plain(dict(meta or {})),
    )


def save_consolidated(
    path: str | Path,
    model: nn.Module | Mapping[str, torch.Tensor],
    model_cfg: ModelConfig,
    manifest: StagedManifest | Mapping[str, Any],
    meta: Mapping[str, Any] | None = None,
) -> Path:
    """Write the consolidated checkpoint atomically; returns the path. The weights are
    written from the model's own tensors (no copy of the model is made to write it)."""
    path = Path(path)
    ckpt = make_checkpoint(model, model_cfg, manifest, meta, copy=False)
    with atomic_file(path, "wb") as f:
        torch.save(ckpt.to_file(), f)
    return path


def read_checkpoint(path: str | Path) -> Checkpoint:
    """Load and check a consolidated checkpoint (weights_only: no code runs on load)."""
    path = Path(path)
    if not path.is_file():
        raise StaleOutputError(
            f"{path}: no checkpoint there; run prepare-checkpoint or distributed-train first"
        )
    ckpt = load_tensors(
        path,
        mmap=True,  # its weights stay in the file's pages until written: no private copy
        name=str(path),
        what="consolidated checkpoint",
        fix="use a checkpoint this project wrote (prepare-checkpoint, distributed-train or the "
        "registry), or re-train",
    )
    return Checkpoint.from_file(ckpt, str(path))


def model_from_checkpoint(
    ckpt: Checkpoint, where: str = "checkpoint", code: ModelCode = BUILTIN
) -> ENN:
    """Rebuild the model from the stored config and data spec, then load the weights. A custom
    model's factory is imported only when it is the one `code` (the params in use) names."""
    try:
        cfg = build(ModelConfig, ckpt.model_config, root=ModelConfig, where=where)
    except ConfigError as e:
        raise StaleOutputError(
            f"{where}: stored model_config no longer valid ({e}); re-create the checkpoint"
        ) from e
    # Label statistics come from the state dict's buffers; per-cell stat files need no data dir.
    data = dataclasses.replace(ckpt.data, label_stats={"mean": 0.0, "std": 1.0})
    prior = None
    if (kept := ckpt.state_dict.get("prior.keys")) is not None:
        # the neighbour prior's rows come as weights, and its kriging solves, one per group
        groups = ckpt.state_dict.get("prior.group_values")
        prior = PriorSize(int(kept.shape[0]), 0 if groups is None else int(groups.shape[0]))

    def rebuild() -> ENN:
        return build_model(cfg, data, code=code, where=where, prior=prior)

    model = built_to_load(rebuild)
    if diffs := state_dict_differences(ckpt.state_dict, model.state_dict()):
        raise StaleOutputError(
            f"{where}: its weights do not fit the model its config describes: {capped(diffs)}; "
            "re-create the checkpoint"
        )
    return holding(model, ckpt.state_dict, rebuild)


def built_to_load(build: Callable[[], ENN]) -> ENN:
    """`build()` with its parameters on the meta device (`parameters_on_meta`): a model about
    to receive a checkpoint's weights, without an initialised copy of them."""
    try:
        with parameters_on_meta():
            return build()
    except Exception:  # a module that reads its weights' values as it is built: built as usual
        return build()


def holding(model: ENN, state: Mapping[str, torch.Tensor], build: Callable[[], ENN]) -> ENN:
    """`model` (from `built_to_load(build)`) holding `state`, loaded strictly: its tensors
    become the weights (a checkpoint file's mapped pages: no private copy), unless a weight is
    tied (assigning would untie it) or a tensor stays on meta (one the state does not hold):
    then `build()` is built as usual and `state` copied into it."""
    shared = len(dict(model.named_parameters(remove_duplicate=False))) != len(
        list(model.parameters())
    )
    if not shared:
        model.load_state_dict(state, strict=True, assign=True)
    if shared or any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        model = build()
        model.load_state_dict(state, strict=True)
    return model


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (shape and dtype, no
    memory: their initialisation does nothing); buffers stay real. A checkpoint's weights
    are then assigned to them: a worker never holds an initialised copy of a model beside the
    one it loads (issue 55)."""

    def meta(module: nn.Module, name: str, param: nn.Parameter | None) -> Any:  # torch: None
        if param is None or param.is_meta:
            return None
        return nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    import torch.utils.deterministic as det

    # under deterministic algorithms torch.empty fills each new tensor (NaN): every weight
    # would be written once, resident, before the hook makes it meta (a whole model's worth of
    # pages after any deterministic run in the process); its values are never read
    fill = det.fill_uninitialized_memory  # type: ignore[attr-defined]
    det.fill_uninitialized_memory = False  # type: ignore[attr-defined]
    handle = register_module_parameter_registration_hook(meta)
    try:
        yield
    finally:
        handle.remove()
        det.fill_uninitialized_memory = fill  # type: ignore[attr-defined]


def load_model(path: str | Path, code: ModelCode = BUILTIN) -> tuple[ENN, Checkpoint]:
    """(model in eval mode on CPU, Checkpoint) from a consolidated checkpoint file; `code` is
    the model code the params in use allow (a custom model's factory)."""
    ckpt = read_checkpoint(path)
    return model_from_checkpoint(ckpt, where=str(path), code=code).eval(), ckpt


# --- Compatibility: what differs between a checkpoint and this run, named (warm start, resume) ---

# Feature-spec keys a warm start may see change: normalization statistics of new data (the
# source's buffers come with its weights); name, kind and vocab are compared on their own.
_SPEC_FREE = {"name", "kind", "vocab", "mean", "std"}
_SHOW = 4  # differences (and values) listed in a one-line message before "+N more"


def _fmt(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, str) else value


def _some(values: Sequence[object], n: int = _SHOW) -> str:
    shown = ", ".join(_fmt(v) for v in values[:n])
    return shown + (f" (+{len(values) - n} more)" if len(values) > n else "")


def capped(diffs: list[str], n: int = _SHOW) -> str:
    """`a; b; c (+N more differences)`: a list of differences for a one-line message."""
    more = f" (+{len(diffs) - n} more differences)" if len(diffs) > n else ""
    return "; ".join(diffs[:n]) + more


def model_config_differences(theirs: Mapping[str, Any], ours: Mapping[str, Any]) -> list[str]:
    """`model.d_model is 32 there, 64 here` for every differing field (theirs filled with
    today's defaults first, so a field added since it was written does not count)."""
    theirs = {**plain(ModelConfig()), **dict(theirs)}
    out: list[str] = []
    for key in [*ours, *(k for k in theirs if k not in ours)]:
        a, b = theirs.get(key, "absent"), ours.get(key, "absent")
        if a != b:
            out.append(f"model.{key} is {_fmt(a)} there, {_fmt(b)} here")
    return out


def _values_differ(theirs: Sequence[object] | None, ours: Sequence[object] | None) -> str:
    """'' when equal; else which values are missing or new here (or that only the order
    differs: the integer codes, or the grid positions, then mean other values)."""
    a, b = list(theirs or []), list(ours or [])
    if a == b:
        return ""
    missing, new = [v for v in a if v not in b], [v for v in b if v not in a]
    what = [f"{_some(missing)} missing here"] if missing else []
    what += [f"{_some(new)} new here"] if new else []
    return ", ".join(what) or "same values in another order (codes differ)"


def _feature_differences(
    theirs: Sequence[Mapping[str, Any]], ours: Sequence[Mapping[str, Any]]
) -> list[str]:
    t = {s["name"]: s for s in theirs}
    o = {s["name"]: s for s in ours}
    out: list[str] = []
    if removed := [n for n in t if n not in o]:
        out.append(f"features {_some(removed)} there but not here")
    if added := [n for n in o if n not in t]:
        out.append(f"features {_some(added)} here but not there")
    common_t = [n for n in t if n in o]
    if common_t != [n for n in o if n in t]:
        out.append(
            f"feature order is {_some(common_t, 8)} there, "
            f"{_some([n for n in o if n in t], 8)} here"
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
                    f"feature {name} {key} is {_fmt(a.get(key, 'absent'))} there, "
                    f"{_fmt(b.get(key, 'absent'))} here"
                )
    return out


def data_schema_differences(theirs: Mapping[str, Any], ours: Mapping[str, Any]) -> list[str]:
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
    out: list[str] = []
    if missing := [k for k in ours if k not in theirs]:
        out.append(f"weights {_some(missing)} missing there")
    if extra := [k for k in theirs if k not in ours]:
        out.append(f"weights {_some(extra)} not in this model")
    for k in (k for k in ours if k in theirs):
        if tuple(theirs[k].shape) != tuple(ours[k].shape):
            out.append(f"{k} has shape {list(theirs[k].shape)} there, {list(ours[k].shape)} here")
    return out
