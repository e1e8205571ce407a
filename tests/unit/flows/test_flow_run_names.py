"""A flow run's name says its host when the Prefect API is a server other machines share
(issue 54.1: two nodes' runs were both `tuning params.yaml`), and not on this machine's own
API (loopback: `enn run`'s temporary one, `enn ui`'s)."""

from __future__ import annotations

import socket

import pytest

from flows.prefect_api import host_in_name


@pytest.mark.parametrize(
    ("api", "named"),
    [
        ("http://node3:4200/api", True),
        ("https://prefect.example.org/api", True),
        ("http://127.0.0.1:4200/api", False),
        ("http://localhost:4200/api", False),
        ("", False),
    ],
)
def test_the_host_is_in_a_flow_runs_name_on_a_shared_server_only(monkeypatch, api, named):
    monkeypatch.setenv("PREFECT_API_URL", api)
    assert host_in_name() == (f"@{socket.gethostname()}" if named else "")
