"""A server that refused this user's credentials, as one line naming the credential to check,
whichever library met the refusal first: Prefect's API (PREFECT_API_AUTH_STRING), an MLflow
tracking server (MLFLOW_TRACKING_USERNAME/PASSWORD), PostgreSQL behind a study (PGPASSWORD).

    error = refused(exception)   # a ConfigError, or None when it is no refusal

The libraries' classes are looked up among the modules already imported: a library that was
never imported raised nothing here, and the error path imports none of them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

from enn_core.config.urls import pg_refused, redact_text, redact_url
from enn_core.errors import ConfigError

PREFECT_FIX = (
    "check PREFECT_API_AUTH_STRING: the user:password the server was started with "
    "(its PREFECT_SERVER_API_AUTH_STRING; docs/scale-out.md)"
)
PG_FIX = "check PGPASSWORD (or ~/.pgpass) for the user the URL names (docs/scale-out.md)"


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _loaded(module: str, name: str) -> type | None:
    found = getattr(sys.modules.get(module), name, None)
    return found if isinstance(found, type) else None


def refused(error: BaseException) -> ConfigError | None:
    """The one line for a refusal of credentials behind `error`, or None."""
    http = _loaded("httpx", "HTTPStatusError")
    mlflow = _loaded("mlflow.exceptions", "MlflowException")
    for e in _chain(error):
        if http is not None and isinstance(e, http):
            status = e.response.status_code  # type: ignore[attr-defined]
            if status in (401, 403):
                api = os.environ.get("PREFECT_API_URL") or str(e.request.url)  # type: ignore[attr-defined]
                return ConfigError(
                    f"the Prefect API at {redact_url(api)} refused this client ({status}); "
                    f"{PREFECT_FIX}"
                )
        if mlflow is not None and isinstance(e, mlflow):
            from tasks.tracking.auth import CREDENTIALS, refused_credentials

            why = refused_credentials(e)
            server = os.environ.get("MLFLOW_TRACKING_URI", "the MLflow tracking server")
            fix = (
                f"check {CREDENTIALS}"
                if why.startswith("401")
                else f"this user ({CREDENTIALS}) lacks a permission it needs there"
            )
            if why:
                return ConfigError(f"{redact_url(server)} refused this user ({why}); {fix}")
        if type(e).__name__ == "OperationalError" and pg_refused(str(e)):
            first = redact_text((str(e).strip().splitlines() or [""])[0][:200])
            return ConfigError(f"the PostgreSQL server refused the login ({first}); {PG_FIX}")
    return None
