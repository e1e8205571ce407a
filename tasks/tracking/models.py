"""Registered models as local folders, and the registered model's name.

- `model_name(cfg, root)`: the task's registered model (`TrackingConfig.model_name`); in the
  prediction flow, the one of the training data its input was staged against;
- `champion_uri(cfg, root)`: `models:/<name>@champion`, what the prediction flow predicts
  with when no model is given;
- `materialize(uri, dest)`: a registered version's `data/enn/` folder (checkpoint,
  calibration, sidecar) as `dest`, which DVC can hash, so a new champion re-runs predict:
  linked from the store where it lives on this machine, else downloaded.

Registering, the champion rule and the pyfunc flavor: registry.py and pyfunc.py.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from enn_core.atomic import atomic_dir
from enn_core.config import RunConfig
from enn_core.config.urls import redact_text, redact_url
from enn_core.data.manifest import read_manifest
from enn_core.errors import ConfigError
from tasks.tracking.auth import CREDENTIALS, refused_credentials
from tasks.tracking.uris import client_for, use_store

CHAMPION_REF = "champion"  # --model / checkpoint.init_from shorthand for this task's champion
LOCAL_COPY = "model/model.pt"  # the prediction pipeline's local copy of its registered model


def model_name(cfg: RunConfig, root: Path) -> str:
    """The registered model of the run's task: `tracking.registered_model`, else derived from
    the training data (for features-only input: the training manifest's source)."""
    data = cfg.data
    if data.features_only and data.training_manifest and not cfg.tracking.registered_model:
        manifest = Path(data.training_manifest)
        manifest = manifest if manifest.is_absolute() else root / manifest
        if manifest.is_file():
            source = read_manifest(manifest.parent).source
            return cfg.tracking.model_name(source.kind, source.path)
    return cfg.tracking.model_name(data.source, data.path)


def champion_uri(cfg: RunConfig, root: Path) -> str:
    return f"models:/{model_name(cfg, root)}@champion"


def expand(ref: str, cfg: RunConfig, root: Path) -> str:
    """`champion` -> `models:/<this task's registered model>@champion`; other refs as given."""
    return champion_uri(cfg, root) if ref.strip() == CHAMPION_REF else ref


def materialize(uri: str, dest: Path, tracking_uri: str | None = None) -> Path:
    """`models:/name@alias` as the folder `dest` (replaced atomically): a local folder that DVC
    can hash, so a new champion re-runs predict. Returns `dest / "model.pt"`. A version whose
    artifacts live on this machine (the local store) is linked from there, not copied; any
    other is downloaded."""
    with tempfile.TemporaryDirectory() as tmp, atomic_dir(dest) as out:
        local = stored_model_dir(uri, tracking_uri) or resolve_model_uri(
            uri, Path(tmp), tracking_uri
        )
        for f in local.iterdir():
            if f.is_file():
                _link_or_copy(f, out / f.name)
        (out / "SOURCE").write_text(f"{uri}\n")
    return dest / "model.pt"


def _link_or_copy(src: Path, dst: Path) -> None:
    """A hard link (no bytes copied; the store's files are never written again), else a copy
    (another file system, a store that refuses links)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def stored_model_dir(uri: str, tracking_uri: str | None = None) -> Path | None:
    """The `data/enn/` folder of `models:/name@alias` (or `models:/name/version`) where the
    store keeps it, when that is a folder on this machine; None otherwise (a server's store, a
    `runs:/` reference, no such version: the download then says what is wrong)."""
    from urllib.parse import unquote, urlparse

    import mlflow
    from mlflow.exceptions import MlflowException

    from tasks.tracking.registry import enn_folder

    if not uri.startswith("models:/"):
        return None
    ref = uri.removeprefix("models:/")
    name, alias = ref.split("@", 1) if "@" in ref else (ref.rsplit("/", 1) + [""])[:2]
    try:
        client = client_for(tracking_uri or mlflow.get_tracking_uri())
        if "@" in ref:
            version = client.get_model_version_by_alias(name, alias)
        else:
            version = client.get_model_version(name, alias)
        model_id = getattr(version, "model_id", None) or str(version.source).rsplit("/", 1)[-1]
        location = client.get_logged_model(model_id).artifact_location
        parsed = urlparse(location)
        if parsed.scheme not in ("", "file") or parsed.netloc not in ("", "localhost"):
            return None
        return enn_folder(Path(unquote(parsed.path)))
    except (MlflowException, OSError, ValueError):
        return None


def resolve_model_uri(uri: str, dest: Path, tracking_uri: str | None = None) -> Path:
    """`models:/name@alias` (or `runs:/...`) -> the local folder holding model.pt, calibration,
    sidecar (the model's `data/enn/`), from `tracking_uri` (`tracking.uri`; None: MLflow's
    current one, the project's store)."""
    import mlflow
    import mlflow.artifacts
    from mlflow.exceptions import MlflowException

    from tasks.tracking.registry import enn_folder

    if tracking_uri:  # global, as the Tracker sets it: MLflow resolves models:/ by it
        use_store(tracking_uri)
    try:
        local = mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(dest))
    except MlflowException as e:
        refused = refused_credentials(e)
        if refused:  # the server knows no such user, or this one may not read the model
            shown = redact_url(tracking_uri or mlflow.get_tracking_uri())
            raise ConfigError(
                f"{uri}: the MLflow tracking server {shown} refused this user ({refused}); "
                f"check {CREDENTIALS}"
            ) from None
        first = redact_text(str(e).strip().splitlines()[0][:200])
        hint = (
            "train first (enn run), or give --model a checkpoint path"
            if uri.endswith("@champion")
            else "check the name and alias (the MLflow UI's Models page lists them)"
        )
        raise ConfigError(f"{uri}: no such registered model version ({first}); {hint}") from e
    return enn_folder(Path(local))
