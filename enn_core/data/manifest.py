"""manifest.json of a staged dataset: building it, the content hash, and reading it back.

Version policy: readers accept exactly FORMAT_VERSION. An older manifest is refused with
"re-run stage-data" (staging is cheap and deterministic, so no in-place migration is kept);
a newer one is refused with "upgrade enn". Shapes, dtypes and split sizes are checked
against the files themselves by `enn_core.data.dataset.StagedDataset`.

Hashes name their algorithm ("blake3:<hex>", enn_core.data.hashing) under the key "hash".
Manifests by earlier versions carry "blake2b-256-tree1m:<hex>" or "blake2b-256:<hex>", or a
bare sha256 hex under "sha256"; they are still read and still verify (the content hash of
such a manifest is unchanged).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from enn_core.errors import StaleOutputError

FORMAT_VERSION = 1
FORMAT_POLICY = (
    "readers accept only this format_version; an older staged dataset is refused with "
    "'re-run stage-data' (no migration), a newer one with 'upgrade enn'; hashes name their "
    "algorithm ('blake3:<hex>'; older 'blake2b-256-tree1m:' and 'blake2b-256:' still verify), "
    "a bare hex hash (written before the name) is sha256"
)
MANIFEST = "manifest.json"


def file_hash(spec: dict[str, Any]) -> str:
    """A staged file's data hash from its manifest entry (key "hash"; legacy "sha256")."""
    return spec["hash"] if "hash" in spec else spec["sha256"]


def content_hash(files: dict[str, dict[str, Any]]) -> str:
    """sha256 over each staged array's name, dtype, shape and data hash (hashed while written).

    The data hashes are the algorithm-named strings, so the algorithm is part of what is
    hashed; this outer hash of a few hundred bytes stays sha256, a plain hex fingerprint.
    """
    items = [
        [name, f["dtype"], list(f["shape"]), file_hash(f)] for name, f in sorted(files.items())
    ]
    return hashlib.sha256(json.dumps(items, separators=(",", ":")).encode()).hexdigest()


def read_manifest(directory: str | Path) -> dict[str, Any]:
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
    return manifest
