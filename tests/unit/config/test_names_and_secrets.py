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
    ["http://alice:s3cret-pw@node3:5000", "https://node3:5000/?password=s3cret-pw"],
)
def test_a_password_in_tracking_uri_is_refused_unechoed(uri):
    with pytest.raises(
        ConfigError, match="tracking.uri=.* holds a password.*MLFLOW_TRACKING_PASSWORD"
    ) as e:
        load_config(None, [f"tracking.uri={uri}"])
    assert "s3cret-pw" not in str(e.value)


def test_a_tracking_uri_with_a_user_only_is_fine():
    assert load_config(None, ["tracking.uri=http://alice@node3:5000"]).tracking.uri
