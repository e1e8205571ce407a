"""What a tracking server with users (MLflow's basic-auth app, docs/security.md) refuses, as one
line naming what to change: the credentials it did not take (401), or a registered model
another user holds (403), found before training rather than at export.

    refused_credentials(error)            # '' or "401, not authenticated" / "403, ..."
    check_model_name(client, name, uri)   # ConfigError when this user may not add versions
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from enn_core.config.urls import redact_url
from enn_core.errors import ConfigError

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

CREDENTIALS = "MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD (or ~/.mlflow/credentials)"
WRITE_CHECK_TAG = "enn.write_check"  # set and removed at once: a harmless write


def refused_credentials(error: BaseException) -> str:
    """'' unless `error` is a tracking server's answer that it does not know the user (401) or
    does not let it do that (403): then what it said, in a few words."""
    from mlflow.exceptions import MlflowException

    if not isinstance(error, MlflowException):
        return ""
    status = error.get_http_status_code()
    if status == 401 or error.error_code == "UNAUTHENTICATED":
        return "401, not authenticated"
    if status == 403 or error.error_code == "PERMISSION_DENIED":
        return "403, permission denied"
    return ""


def model_held(name: str, uri: str) -> ConfigError:
    """The line for a registered model this user may not add versions to."""
    return ConfigError(
        f"the registered model {name!r} on {redact_url(uri)} belongs to another user (403, "
        "permission denied: this user may not add versions to it); set "
        "tracking.registered_model to a name of your own, or ask its owner or the server's "
        "admin for EDIT permission on it"
    )


def check_model_name(client: MlflowClient, name: str, uri: str) -> None:
    """Before training: when the registered model `name` exists, that this user may write it (a
    tag set and removed at once); a model another user registered under the name is
    `model_held`, instead of a 403 at export minutes later. A name nobody holds yet passes."""
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
    except MlflowException as e:
        if e.error_code == "RESOURCE_DOES_NOT_EXIST":
            return
        if refused_credentials(e).startswith("403"):
            raise model_held(name, uri) from None
        raise
    try:
        client.set_registered_model_tag(name, WRITE_CHECK_TAG, "1")
        client.delete_registered_model_tag(name, WRITE_CHECK_TAG)
    except MlflowException as e:
        if refused_credentials(e).startswith("403"):
            raise model_held(name, uri) from None
        raise
