"""The Prefect API a flow run of `enn` reports to."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import urllib.parse
from collections.abc import Callable, Iterator

from enn_core.config import redact_url
from enn_core.paths import Layout

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@contextlib.contextmanager
def prefect_api(
    layout: Layout, while_starting: Callable[[], object] | None = None
) -> Iterator[str]:
    """The Prefect API a flow run reports to: PREFECT_API_URL when set, else a temporary one
    that enn starts in its own session (a terminal's Ctrl-C must not kill it mid-run) and
    stops when it exits. Set before prefect is imported, which reads it then.
    `while_starting` (the flow's imports) runs while a temporary API starts."""

    def warm(api: str) -> None:
        # the API's URL is known before it answers: prefect reads it at import
        os.environ["PREFECT_API_URL"] = api
        if while_starting is not None:
            while_starting()

    if os.environ.get("PREFECT_API_URL"):
        api = os.environ["PREFECT_API_URL"]
        logging.getLogger("enn").info("Prefect API: %s (PREFECT_API_URL)", redact_url(api))
        yield api
        return
    from flows.servers import temporary_prefect_api
    from tasks.ui import running_ui

    ui = running_ui(layout.work)
    if ui is not None:  # `enn ui` serves this project's Prefect database: report to it
        logging.getLogger("enn").info(
            "Prefect API: %s (enn ui's; the run shows at %s)",
            ui["prefect_api"],
            ui["prefect_api"].removesuffix("/api"),
        )
        os.environ["PREFECT_API_URL"] = ui["prefect_api"]
        yield ui["prefect_api"]
        return

    api = temporary_prefect_api(layout.work / "logs" / "prefect-api.log", while_starting=warm)
    logging.getLogger("enn").info("Prefect API: %s (temporary: it stops with this run)", api)
    os.environ["PREFECT_API_URL"] = api
    yield api


def host_in_name() -> str:
    """`@<host>` for a flow run's name when it reports to a server other machines share
    (PREFECT_API_URL not on loopback: a cluster's nodes name their runs alike), else ""; MLflow's
    run names say the host the same way (`training #3 @node1 synthetic`)."""
    return f"@{socket.gethostname()}" if shared_api(os.environ.get("PREFECT_API_URL", "")) else ""


def shared_api(api: str) -> bool:
    """Whether a Prefect API is a server other machines reach (not on loopback)."""
    host = urllib.parse.urlparse(api).hostname
    return bool(host) and host not in LOOPBACK
