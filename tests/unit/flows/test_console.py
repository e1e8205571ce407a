"""The console filter: Prefect's account of an enn error (with its traceback) stays in the log
file, since enn says it in one line; any other error from Prefect still reaches the console."""

from __future__ import annotations

import logging
import sys

from enn_core.errors import ConfigError
from flows.console import ConsoleFilter


def _record(name: str, msg: str, exc: BaseException | None = None) -> logging.LogRecord:
    info = None
    if exc is not None:
        try:
            raise exc
        except BaseException:
            info = sys.exc_info()
    return logging.LogRecord(name, logging.ERROR, __file__, 1, msg, None, info)


def test_prefects_traceback_of_an_enn_error_is_not_on_the_console():
    keep = ConsoleFilter().filter
    err = ConfigError("dvc.yaml: stage prepare_checkpoint does not depend on x.py")
    flow = _record("prefect.flow_runs", f"Encountered exception during execution: {err!r}", err)
    task = _record(
        "prefect.task_runs",
        f'Finished in state Failed("Task run encountered an exception ConfigError: {err}")',
    )
    assert not keep(flow) and not keep(task)
    # Ctrl-C: enn prints `interrupted` and exits 130; Prefect's two crash lines are the log's
    aborted = "Execution was aborted by an interrupt signal."
    crashed = _record("prefect.task_runs", f"Finished in state Crashed({aborted!r})")
    detected = _record("prefect.flow_runs", f"Crash detected! {aborted}")
    assert not keep(crashed) and not keep(detected)
    other = _record("prefect.flow_runs", "Encountered exception: KeyError('x')", KeyError("x"))
    assert keep(other)  # a bug is not one of enn's one-line errors: its traceback shows
    assert keep(_record("enn", "error: something"))
