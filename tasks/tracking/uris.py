"""One MLflow store for runs and registered models: every client and every fluent call here
names the tracking URI as the registry URI too.

Why: MLflow takes the registry from a process-wide setting (`mlflow.set_registry_uri`, or
MLFLOW_REGISTRY_URI) when a client is given only a tracking URI. A registry set earlier in the
same process, by a notebook or another caller, sent the registered-name check and
`models:/` lookups to that other store: a model name another user holds on the server was
"free", and a wrong password still downloaded a model from the earlier store. The champion,
its versions and the runs they point at live in one store; this pins them there.

    use_store(uri)      # mlflow's fluent API (log_model, download_artifacts) on `uri`
    client_for(uri)     # an MlflowClient on `uri`, registry included
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient


ENV_KEYS = ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")


def use_store(uri: str) -> None:
    """Point MLflow's fluent API at `uri` for tracking and the model registry both, leaving
    the process environment as it was: MLflow's setters also export MLFLOW_TRACKING_URI (and
    the registry's), for subprocesses; the environment is tasks/env.py's, and the next
    `contain` of the run (the prediction flow's stages, after its model came from a server)
    read the changed variable as a setting gone stale and warned on the console (issue 54)."""
    import os

    import mlflow

    before = {k: os.environ.get(k) for k in ENV_KEYS}
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def client_for(uri: str) -> MlflowClient:
    """An MlflowClient whose runs and registered models are both in `uri`."""
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri, registry_uri=uri)
