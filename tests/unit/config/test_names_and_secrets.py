"""Names and secrets in the config (issue 38.4): runtime.rdzv_id is a name (it names run
folders under torchrun's worker logs too); a password in tracking.uri is refused as one in
tune.storage is, never echoed."""

from __future__ import annotations

import pytest

from enn_core.config import load_config
from enn_core.errors import ConfigError


@pytest.mark.parametrize("job", ["../../tmp/x", "a/b", "..", "job id", "-x"])
def test_rdzv_id_is_a_name(job):
    with pytest.raises(ConfigError, match=r"runtime.rdzv_id=.* is not a name"):
        load_config(
            None, ["runtime.nnodes=2", "runtime.rdzv_endpoint=n1:29400", f"runtime.rdzv_id={job}"]
        )


def test_a_good_rdzv_id_passes():
    cfg = load_config(
        None, ["runtime.nnodes=2", "runtime.rdzv_endpoint=n1:29400", "runtime.rdzv_id=job-1.a"]
    )
    assert cfg.runtime.rdzv_id == "job-1.a"


@pytest.mark.parametrize(
    "uri",
    [
        "http://alice:s3cret-pw@node3:5000",
        "https://node3:5000/?password=s3cret-pw",
        "http://s3cret-pw@node3:5000",  # a token as the user (issue 52.6)
        "http://alice%3As3cret-pw@node3:5000",  # a ':' written %3A: no password to urlsplit
        "http://alice@node3:5000",  # a user alone: MLflow and the probe take it from the env
    ],
)
def test_credentials_in_tracking_uri_are_refused_unechoed(uri):
    with pytest.raises(
        ConfigError, match="tracking.uri=.* holds credentials .*MLFLOW_TRACKING_PASSWORD"
    ) as e:
        load_config(None, [f"tracking.uri={uri}"])
    assert "s3cret-pw" not in str(e.value) and "alice" not in str(e.value)


def test_a_percent_encoded_password_in_the_study_storage_is_refused_unechoed():
    with pytest.raises(ConfigError, match="tune.storage=.* holds a password.*PGPASSWORD") as e:
        load_config(None, ["tune.storage=postgresql://optuna%3As3cret-pw@node3:5432/studies"])
    assert "s3cret-pw" not in str(e.value)
    assert load_config(None, ["tune.storage=postgresql://optuna@node3:5432/studies"])


@pytest.mark.parametrize(
    "url",
    [
        "http://alice%3As3cret-pw@node3:5000/x",
        "https://node3/api?token=s3cret-pw&run=7",
        "https://node3/api?api_key=s3cret-pw",
        "https://node3/api?X-Amz-Signature=s3cret-pw",
        "postgresql://u@h/db?sslpassword=s3cret-pw",
    ],
)
def test_credentials_in_a_shown_url_are_redacted(url):
    from enn_core.config.urls import redact_text, redact_url

    assert "s3cret-pw" not in redact_url(url) and "***" in redact_url(url)
    line = redact_text(f"the server at {url} said no ('{url}')")
    assert "s3cret-pw" not in line and line.startswith("the server at ")
    assert redact_url("https://node3/api?run=7") == "https://node3/api?run=7"


def test_a_store_error_never_shows_the_credentials_in_a_url():
    from tasks.tracking.runs import store_error

    uri = "http://alice%3As3cret-pw@127.0.0.1:9/"
    msg = str(store_error(uri, OSError(f"cannot reach {uri}?token=s3cret-pw")))
    assert "s3cret-pw" not in msg and "alice" not in msg and "did not answer" in msg


def test_what_enn_prints_never_shows_a_urls_credentials():
    """Issue 52.6: an error line (whatever library wrote its text) and `enn deploy`'s banner
    redact the user info and token-like query values of every URL in them."""
    from types import SimpleNamespace

    from enn_core.errors import StoreError
    from flows.console import one_line
    from flows.deploy import banner

    error = StoreError("GET http://bob%3As3cret-pw@node3:4200/api/x?token=s3cret-pw failed")
    line = one_line(error)
    assert "s3cret-pw" not in line and "bob" not in line and "node3:4200/api/x" in line
    deployment = SimpleNamespace(flow_name="prediction", name="nightly", schedules=[])
    shown = "\n".join(banner([deployment], "http://s3cret-pw@node3:4200/api"))
    assert "s3cret-pw" not in shown and "***@node3:4200/api" in shown


def test_credentials_in_mlflow_tracking_uri_are_refused_as_in_tracking_uri(tmp_path, monkeypatch):
    from enn_core.paths import Layout
    from tasks.tracking import Tracker

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://s3cret-tok@127.0.0.1:9")
    (tmp_path / "params.yaml").write_text("{}\n")
    with pytest.raises(ConfigError, match="MLFLOW_TRACKING_URI=.* holds credentials") as e:
        Tracker(load_config(None, []), Layout.for_root(tmp_path))
    assert "s3cret-tok" not in str(e.value)
