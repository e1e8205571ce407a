"""The Prefect API a flow run of `enn` reports to."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator

from enn_core.paths import Layout


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
        yield os.environ["PREFECT_API_URL"]
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
