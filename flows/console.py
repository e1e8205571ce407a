"""What a person sees in the terminal while enn runs, and the log file that keeps the rest.

    log_file = setup(layout.work / "logs", "run", verbose=args.verbose)

- **Console** (stderr): the project's own lines (loggers under `enn`: the stages, the flows,
  the per-epoch training lines), warnings and errors from anything else except the known
  noise in `NOISE`, and the progress bars (written around them, `tqdm.write`).
- **Log file** (`work/logs/<time>-<command>.log`, named in the closing summary): every record
  at INFO (DEBUG with `--verbose`), third-party included, the noise too.
- `--verbose`: everything on the console as well.

`NOISE` names each silenced message and why it is safe to hide it; a test runs the training
flow and holds its console to the project's own lines (tests/e2e/test_console.py).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import io
import logging
import os
import re
import sys
import time
from pathlib import Path

from enn_core.atomic import open_own
from enn_core.config.urls import redact_text
from enn_core.errors import EnnError

# (logger, what it says, why nobody needs to see it): these loggers (and their children) are kept
# off the console unless --verbose; the log file keeps their lines. Other third-party INFO
# stays in the log file only as well.
NOISE: tuple[tuple[str, str, str], ...] = (
    (
        "torch.distributed.elastic",
        "Failed to register signal handlers since torchelastic is running on a child thread; "
        "each worker's exit with a traceback",
        "enn runs the elastic agent in a thread and handles SIGINT/SIGTERM itself "
        "(flows/exits.py), stopping the workers' process group; a failure is reported with the "
        "rank and its last phase, and each rank's log is in the run directory",
    ),
    (
        "torch.onnx._internal.exporter._registration",
        "torchvision is not installed. Skipping torchvision::nms (roi_align, roi_pool)",
        "the ONNX exporter probes torchvision's operators at start; no ENN model uses them",
    ),
    (
        "matplotlib.font_manager",
        "Matplotlib is building the font cache; this may take a moment",
        "a one-time cache under work/ (MPLCONFIGDIR), built on the first plot",
    ),
    (
        "optuna",
        "each trial's start and end, a failed trial's traceback (its own stderr handler is off: "
        "tasks/tuning/objective.py)",
        "enn tune says each trial's values and how it ended in its own lines; the log file "
        "keeps Optuna's, and each trial's own log is in its folder",
    ),
)
# Python warnings raised inside libraries, not by anything enn calls with a choice:
# (message regex, category's name, why). Off the console unless --verbose; the log file keeps
# them. A name, not the class: naming Optuna's would import it at every `enn` start.
QUIET_WARNINGS: tuple[tuple[str, str, str], ...] = (
    (
        r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        "FutureWarning",
        "raised by torch.export's own pytree code in torch 2.13 while exporting",
    ),
    (
        r".",
        "ExperimentalWarning",
        "Optuna marks its trial heartbeat experimental (the storage's heartbeat_interval, "
        "fail_stale_trials); enn tune relies on it knowingly, Optuna pinned by constraints.txt",
    ),
    (
        r"[/\\]optuna[/\\]",
        "Warning",  # any category: UserWarning, FutureWarning, ...
        "raised in Optuna's own files during a study (a trial value it could not take: enn "
        "tune's line for the trial says how it ended)",
    ),
)


class Console(logging.StreamHandler):
    """stderr, written through tqdm so that a progress bar is redrawn below the line."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm  # type: ignore[import-untyped]

            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001 - logging must not raise
            self.handleError(record)


class ConsoleFilter(logging.Filter):
    """The project's lines; warnings and errors from the rest, but not the known noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "enn" or record.name.startswith("enn."):
            return True
        if _prefects_account_of_an_enn_error(record):
            return False  # enn says it in one line (`error: ...`, `interrupted`); the log keeps it
        if _noise(record):
            return False  # known and explained (NOISE, QUIET_WARNINGS); the log keeps it
        if _disk_full(record):
            return False  # enn says it in one line (exit 11); the log keeps it if it can
        return record.levelno >= logging.WARNING


def _noise(record: logging.LogRecord) -> bool:
    """A line of a `NOISE` logger, or a `QUIET_WARNINGS` warning (logging.captureWarnings)."""
    if any(record.name == n or record.name.startswith(f"{n}.") for n, _, _ in NOISE):
        return True
    if record.name != "py.warnings":
        return False
    msg = record.getMessage()  # `file:line: Category: message` (warnings.formatwarning)
    return any(
        f"{category}: " in msg and re.search(pattern, msg)
        for pattern, category, _ in QUIET_WARNINGS
    )


DISK_FULL = ("No space left on device", "database or disk is full", "Disk quota exceeded")


def _disk_full(record: logging.LogRecord) -> bool:
    """Another library's account of a full disk (MLflow's store logs the failed INSERT with its
    traceback; Prefect the crashed run)."""
    exc = record.exc_info[1] if record.exc_info else None
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = f"{record.getMessage()} {exc or ''}"
    return any(s in text for s in DISK_FULL)


def _prefects_account_of_an_enn_error(record: logging.LogRecord) -> bool:
    """Prefect's engine logs a failed or crashed task or flow run with the exception and its
    traceback; for an enn error (bad input, a refused checkpoint: one line by design) or a
    Ctrl-C (enn prints `interrupted` and exits 130) that is noise."""
    if not record.name.startswith("prefect."):
        return False
    exc = record.exc_info[1] if record.exc_info else None
    if isinstance(exc, (EnnError, KeyboardInterrupt)):
        return True
    msg = record.getMessage()
    if "aborted by an interrupt signal" in msg:
        return True
    return any(f"exception {n}:" in msg or f"{n}(" in msg for n in _enn_error_names())


@functools.cache
def _enn_error_names() -> frozenset[str]:
    found, todo = set(), [EnnError]
    while todo:
        cls = todo.pop()
        found.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return frozenset(found)


class ConsoleFormat(logging.Formatter):
    """`HH:MM:SS message`; a warning or error says so and whose it is."""

    def format(self, record: logging.LogRecord) -> str:
        when = time.strftime("%H:%M:%S", time.localtime(record.created))
        msg = record.getMessage()
        if record.exc_info and record.levelno >= logging.ERROR:
            msg += "\n" + self.formatException(record.exc_info)
        if record.levelno >= logging.WARNING:
            who = "" if record.name.startswith("enn") else f" ({record.name})"
            return f"{when} {record.levelname}{who}: {msg}"
        return f"{when} {msg}"


LOG_FILE: Path | None = None  # this process's log file, once setup has made it
_ROUTED: list[tuple[logging.Logger, logging.Handler]] = []  # what _route_noise attached


def _route_noise(handlers: list[logging.Handler]) -> None:
    """The NOISE loggers write to this process's console and log file, not past them: torch's
    loggers (torch._logging) do not propagate to the root but print through a stderr handler of
    their own, which would show the noise and keep it out of the log file."""
    for logger, handler in _ROUTED:
        logger.removeHandler(handler)
    _ROUTED.clear()
    for name, _, _ in NOISE:
        logger = logging.getLogger(name)
        logger.propagate = False
        for handler in handlers:
            logger.addHandler(handler)
            _ROUTED.append((logger, handler))


def setup(log_dir: Path | None, command: str, verbose: bool = False) -> Path | None:
    """Console and log file for this process; returns the log file's path (None without a
    log directory)."""
    root = logging.getLogger()
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    for h in list(root.handlers):
        root.removeHandler(h)
    console = Console(sys.stderr)
    console.setFormatter(ConsoleFormat())
    if not verbose:
        console.addFilter(ConsoleFilter())
    root.addHandler(console)
    path = None
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        path = log_dir / f"{time.strftime('%Y%m%d-%H%M%S')}-{command}.log"
        file = LogFile(path, encoding="utf-8")
        file.setLevel(logging.DEBUG if verbose else logging.INFO)
        file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(file)
        global LOG_FILE
        LOG_FILE = path
    for name in ("httpx", "httpcore", "alembic", "mlflow.store.db.utils", "dvc"):
        logging.getLogger(name).setLevel(logging.WARNING)  # request and lock chatter
    _route_noise(root.handlers)
    logging.captureWarnings(True)  # warnings are records: ConsoleFilter holds back QUIET_WARNINGS
    # A handler that cannot write (the log file or Prefect's API on a full disk) would print
    # "--- Logging error ---" and a traceback per record, and under a flow's log_prints that
    # print is logged again, until a RecursionError: the run's one error line says it instead.
    logging.raiseExceptions = verbose
    return path


class LogFile(logging.FileHandler):
    """The log file, never opened through a link; once a write fails (a full disk), it stops
    writing instead of failing on every record."""

    def _open(self) -> io.TextIOWrapper:  # logging's hook
        return os.fdopen(open_own(self.baseFilename), "a", encoding=self.encoding)

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        if self.stream is not None:
            with contextlib.suppress(OSError):
                self.stream.close()
        self.stream = None
        self.setLevel(logging.CRITICAL + 1)


def for_flow_run(log_dir: Path, name: str) -> bool:
    """A flow run in a process `enn` did not start (`enn deploy`'s runs, a Prefect worker's):
    the same console and log file as `enn run` (the project's lines, epoch lines included; the
    known noise in the log file only), in place of Prefect's console handler. Returns whether
    it set them up here (False under `enn run`, which already did)."""
    if LOG_FILE is not None:
        return False
    setup(log_dir, f"flow-{name}")
    return True


def one_line(error: BaseException) -> str:
    """`error: ... (docs/<page>.md)`: how `enn` reports an EnnError (one line, whatever a
    library put in it), ending with the page that covers its kind unless it names one."""
    text = redact_text(" ".join(str(error).split()))  # a library's message may hold a URL
    page = getattr(error, "docs", "")
    return f"error: {text} ({page})" if page and "docs/" not in text else f"error: {text}"
