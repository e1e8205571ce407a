"""Export's artifacts per fingerprint: what a parity check has already proved is not proved
again.

The key is everything the exported programs and their parity depend on: the checkpoint's and
the calibration's bytes, the held-out rows (the data fingerprint and their count), the export
settings, the versions of torch, ONNX and onnxruntime, and the source of the built-in model
and prediction path code. With the same key, export copies the programs and their parity
record from `<work>/cache/<the stage>/<key>/` instead of tracing, converting and checking again
(a copy whose bytes differ from the recorded sha256 is ignored and replaced). A custom model
(`model.preset custom`) is always exported: its code lives outside the key.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from enn_core.atomic import atomic_dir, write_json
from enn_core.config import ExportConfig
from enn_core.inference import sha256_file

FORMAT = 2  # bump when what export writes changes (2: model.onnx.data)
RESULTS = "results.json"
# the only files a cached record may name (model.onnx's weights beside it: onnx_program)
PROGRAMS = ("model.pt2", "model.onnx", "model.onnx.data")
CODE = ("model", "inference.py", "export.py", "export_cache.py", "onnx_program.py")  # enn_core/


def key(
    cfg: ExportConfig,
    ident: Mapping[str, object],
    calibration: Path,
    versions: Mapping[str, str],
) -> str:
    root = Path(__file__).resolve().parent
    files = sorted(
        f
        for name in CODE
        for f in ([root / name] if name.endswith(".py") else (root / name).rglob("*.py"))
    )
    code = hashlib.sha256()
    for f in files:
        code.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    what = {
        "format": FORMAT,
        "ident": dict(ident),
        "calibration": sha256_file(calibration) if calibration.is_file() else "",
        "settings": asdict(cfg),
        "versions": dict(versions),
        "code": code.hexdigest(),
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:24]


def load(folder: Path, out: Path) -> dict[str, dict[str, Any]] | None:
    """Copy the cached programs into `out`; their results, or None (absent, damaged)."""
    try:
        results = json.loads((folder / RESULTS).read_text())
        for res in results.values():
            if res.get("status") != "ok":
                continue
            for part in _files(res):
                if part.get("file") not in PROGRAMS:  # the record is data: it names no other path
                    return None
                src = folder / part["file"]
                if sha256_file(src) != part["sha256"]:
                    return None
                shutil.copy2(src, out / part["file"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return results


def store(folder: Path, out: Path, results: Mapping[str, Mapping[str, Any]]) -> None:
    with atomic_dir(folder) as tmp:
        for res in results.values():
            if res.get("status") == "ok":
                for part in _files(res):
                    shutil.copy2(out / part["file"], tmp / part["file"])
        write_json(tmp / RESULTS, dict(results))


def _files(res: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """A format's files as (file, sha256) records: its program, and model.onnx's weights when
    they are beside it (`external_data`)."""
    return [res, *([res["external_data"]] if "external_data" in res else [])]
