"""Database URLs in the config: `tune.storage` (an SQLAlchemy URL) and `tracking.uri`.

A URL in params never holds a password: libpq (PostgreSQL) reads it from PGPASSWORD or
~/.pgpass, so `check_storage_url` refuses a URL with one, naming the fix and never echoing
it. What a URL says of its user (`user@`, `?user=`) is redacted wherever the config is shown:
run directories' config.yaml, MLflow params, the console and Prefect's run names
(`redact_url`, `redact_override`; `enn_core.config.to_logged` for the whole config).
"""

from __future__ import annotations

from urllib.parse import SplitResult, parse_qsl, urlencode, urlsplit, urlunsplit

from enn_core.errors import ConfigError

DIALECTS = ("sqlite", "postgresql", "mysql")  # what Optuna's RDBStorage is tested on
SECRET_QUERY = frozenset({"password", "passwd", "passfile", "sslpassword"})
USER_QUERY = frozenset({"user", "username"}) | SECRET_QUERY
REDACTED = "***"
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
    user_query = any(k.lower() in USER_QUERY for k, _ in query)
    if "@" not in parts.netloc and not user_query:
        return url  # nothing to hide (and `sqlite:///x` stays as written)
    if "@" in parts.netloc:
        parts = parts._replace(netloc=f"{REDACTED}@{parts.netloc.rpartition('@')[2]}")
    if user_query:
        safe = [(k, REDACTED if k.lower() in USER_QUERY else v) for k, v in query]
        parts = parts._replace(query=urlencode(safe, safe="*"))
    return urlunsplit(parts)


def redact_override(text: str) -> str:
    """A `--set key=value` with the value redacted when the key is one of `URL_KEYS`."""
    key, sep, value = text.partition("=")
    return f"{key}{sep}{redact_url(value)}" if key.strip() in URL_KEYS else text


TRACKING_FIX = (
    "take it out of the URL: MLflow reads the user and password from the environment "
    "(MLFLOW_TRACKING_USERNAME, MLFLOW_TRACKING_PASSWORD) or ~/.mlflow/credentials "
    "(docs/security.md)"
)


def check_no_password(url: str, where: str, fix: str) -> None:
    """ConfigError (never echoing it) when `url` holds a password, in its user info or query."""
    if "://" not in url:
        return
    parts = _split(url, where)
    if _holds_password(parts):
        raise ConfigError(f"{where}={redact_url(url)!r} holds a password: {fix}")


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
    return parts.password is not None or any(k.lower() in SECRET_QUERY for k, _ in query)


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
