"""Database URLs in the config: `tune.storage` (an SQLAlchemy URL) and `tracking.uri`.

A URL in params never holds a password: libpq (PostgreSQL) reads it from PGPASSWORD or
~/.pgpass, so `check_storage_url` refuses a URL with one (a ':' written %3A in the user name
included), naming the fix and never echoing it; `tracking.uri` holds no user info at all
(`check_no_credentials`: MLflow takes user and password from the environment). What a URL says
of its user (`user@`, `?user=`) and query values that look like credentials (`?token=`,
`?api_key=`, ...) are redacted wherever a URL is shown: run directories' config.yaml, MLflow
params, the console, error lines and Prefect's run names (`redact_url`, `redact_override`,
`redact_text`; `enn_core.config.to_logged` for the whole config).
"""

from __future__ import annotations

import re
from urllib.parse import SplitResult, parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from enn_core.errors import ConfigError

DIALECTS = ("sqlite", "postgresql", "mysql")  # what Optuna's RDBStorage is tested on
SECRET_QUERY = frozenset({"password", "passwd", "passfile", "sslpassword"})
USER_QUERY = frozenset({"user", "username"}) | SECRET_QUERY
# query keys whose values are redacted when shown (a substring of the key, lower case)
CREDENTIAL_WORDS = ("pass", "token", "secret", "key", "auth", "sig", "cred", "session")
REDACTED = "***"
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>()\[\]{},]+")
URL_KEYS = ("tune.storage", "tracking.uri")  # config keys whose value may be a URL with a user
PASSWORD_FIX = (
    "take it out of the URL and give it in the environment (PGPASSWORD) or in ~/.pgpass "
    "(docs/scale-out.md)"
)


def redact_url(url: str) -> str:
    """`url` with its user info and user/password query values replaced by `***`."""
    if "://" not in url:
        return url
    try:
        parts = urlsplit(url)
        query = parse_qsl(parts.query, keep_blank_values=True)
    except ValueError:
        return REDACTED
    user_query = any(_hidden(k) for k, _ in query)
    if "@" not in parts.netloc and not user_query:
        return url  # nothing to hide (and `sqlite:///x` stays as written)
    if "@" in parts.netloc:
        parts = parts._replace(netloc=f"{REDACTED}@{parts.netloc.rpartition('@')[2]}")
    if user_query:
        safe = [(k, REDACTED if _hidden(k) else v) for k, v in query]
        parts = parts._replace(query=urlencode(safe, safe="*"))
    return urlunsplit(parts)


def _hidden(key: str) -> bool:
    """Whether a query key's value is redacted when shown: a user, a password, a token."""
    k = unquote(key).lower()
    return k in USER_QUERY or any(w in k for w in CREDENTIAL_WORDS)


def redact_text(text: str) -> str:
    """`text` (an error line, a library's message) with every URL in it redacted."""
    return _URL.sub(lambda m: redact_url(m.group(0)), text) if "://" in text else text


def redact_override(text: str) -> str:
    """A `--set key=value` with the value redacted when the key is one of `URL_KEYS`."""
    key, sep, value = text.partition("=")
    return f"{key}{sep}{redact_url(value)}" if key.strip() in URL_KEYS else text


# what libpq says when the server refuses the login (its wording since PostgreSQL 9)
PG_REFUSALS = (
    "password authentication failed",
    "no password supplied",
    "authentication failed for user",
    "password is required",
)


def pg_refused(text: str) -> bool:
    """Whether a database error's text is PostgreSQL refusing the login (the URL's user, with
    the password in PGPASSWORD or ~/.pgpass), not a server that did not answer."""
    low = text.lower()
    return any(r in low for r in PG_REFUSALS)


TRACKING_FIX = (
    "take them out of the URL: MLflow reads them from the environment "
    "(MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN) or "
    "~/.mlflow/credentials (docs/security.md)"
)


def check_no_credentials(url: str, where: str, fix: str) -> None:
    """ConfigError (never echoing them) when `url` holds credentials: user info of any kind
    (`user@`, `TOKEN@`, `user:password@`, percent-encoded or not) or a password in its query."""
    if "://" not in url:
        return
    parts = _split(url, where)
    if "@" in parts.netloc or _holds_password(parts):
        raise ConfigError(
            f"{where}={redact_url(url)!r} holds credentials (a user, token or password): {fix}"
        )


def _split(url: str, where: str) -> SplitResult:
    """`url`'s parts, its password read once (urlsplit is lazy); ConfigError when unparsable."""
    try:
        parts = urlsplit(url)
        _ = parts.password, parse_qsl(parts.query, keep_blank_values=True)
    except ValueError as e:
        raise ConfigError(f"{where}={redact_url(url)!r} is not a URL ({e})") from e
    return parts


def _holds_password(parts: SplitResult) -> bool:
    query = parse_qsl(parts.query, keep_blank_values=True)
    encoded = parts.username is not None and ":" in unquote(parts.username)  # user%3Apassword
    return (
        parts.password is not None
        or encoded
        or any(unquote(k).lower() in SECRET_QUERY for k, _ in query)
    )


def check_storage_url(url: str, where: str) -> None:
    """An SQLAlchemy URL Optuna can store a study in, without a password; else ConfigError."""
    shown = redact_url(url)
    parts = _split(url, where)
    dialect = parts.scheme.split("+")[0]
    if "://" not in url or dialect not in DIALECTS:
        raise ConfigError(
            f"{where}={shown!r}: expected an SQLAlchemy URL of {', '.join(DIALECTS)}, e.g. "
            "postgresql://optuna@node3:5432/studies (several hosts), or empty for "
            "work/tune/<study>.db"
        )
    if _holds_password(parts):
        raise ConfigError(f"{where}={shown!r} holds a password: {PASSWORD_FIX}")
    if dialect == "sqlite" and parts.path.strip("/") in ("", ":memory:"):
        raise ConfigError(
            f"{where}={shown!r} is an in-memory database, which no other process sees; name a "
            "file (sqlite:////shared/studies.db) or leave it empty"
        )
    if dialect != "sqlite" and not parts.hostname and "host=" not in parts.query:
        raise ConfigError(
            f"{where}={shown!r} names no host; write the database server's name, e.g. "
            "postgresql://optuna@node3:5432/studies"
        )
