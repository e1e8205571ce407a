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


def use_store(uri: str) -> None:
    """Point MLflow's fluent API at `uri` for tracking and the model registry both."""
    import mlflow

    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)


def client_for(uri: str) -> MlflowClient:
    """An MlflowClient whose runs and registered models are both in `uri`."""
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri, registry_uri=uri)
