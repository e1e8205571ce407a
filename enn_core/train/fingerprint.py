"""The training checkpoint fingerprint: what must match for a checkpoint to be resumed.

    fp = fingerprint(cfg, data_hash)     # Fingerprint(digest, parts)
    diff(theirs.parts, fp.parts)         # ["train.lr: 0.01 there, 0.02 here", ...]

A checkpoint can be resumed only by a run that would compute the same thing: the same staged
data (its content hash), the same `data`, `model` and `train` sections, and the same torch
version (kernels and RNG streams change between versions). Runtime settings (world size,
threads, logging, timeouts) are excluded, since they change how a run executes, not what it
computes; so are the train keys that only change how the work is laid out:

- `fsdp`, `hsdp_replicas`: the sharding layout (DCP reshards on load).
- `micro_batch`, `memory_headroom`: the per-forward slice of the same global batch (an OOM
  back-off or the auto probe changes it).
- `compile`, `log_every`, `eval_batch`: speed and telemetry only.

The checkpoints of one fingerprint live in `<work>/checkpoints/<digest>/`, so a changed
config starts fresh instead of resuming something it did not compute.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import torch

from enn_core.config import RunConfig, to_plain

LAYOUT_ONLY_TRAIN_KEYS = (
    "fsdp",
    "hsdp_replicas",
    "micro_batch",
    "compile",
    "log_every",
    "eval_batch",
)


@dataclass(frozen=True)
class Fingerprint:
    digest: str
    parts: dict[str, Any]


def fingerprint(cfg: RunConfig, data_hash: str) -> Fingerprint:
    train = {k: v for k, v in to_plain(cfg.train).items() if k not in LAYOUT_ONLY_TRAIN_KEYS}
    parts = json.loads(
        json.dumps(
            {
                "data_hash": data_hash,
                "data": to_plain(cfg.data),
                "model": to_plain(cfg.model),
                "train": train,
                "torch": torch.__version__,
            },
            default=str,
        )
    )
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()
    return Fingerprint(hashlib.sha256(blob).hexdigest()[:16], parts)


def _flat(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: obj}


def diff(theirs: dict[str, Any], ours: dict[str, Any], limit: int = 4) -> list[str]:
    """The differing keys, as `key: <theirs> there, <ours> here` (at most `limit`, then a count)."""
    a, b = _flat(theirs), _flat(ours)
    keys = sorted(k for k in set(a) | set(b) if a.get(k, "<absent>") != b.get(k, "<absent>"))
    out = [
        f"{k}: {a.get(k, '<absent>')!r} there, {b.get(k, '<absent>')!r} here" for k in keys[:limit]
    ]
    if len(keys) > limit:
        out.append(f"and {len(keys) - limit} more")
    return out
