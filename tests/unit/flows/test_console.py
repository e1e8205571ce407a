"""The console filter: Prefect's account of an enn error (with its traceback) stays in the log
file, since enn says it in one line; any other error from Prefect still reaches the console.
The known noise (console.NOISE, console.QUIET_WARNINGS) is kept off the console but not out of
the log file; --verbose shows it."""

from __future__ import annotations

import logging
import sys
import warnings

import pytest

from enn_core.errors import ConfigError
from flows import console
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


@pytest.fixture
def root_logging():
    """console.setup rewires the root logger: put it back after the test."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    noise = [logging.getLogger(n) for n, _, _ in console.NOISE]
    before = [(n.propagate, list(n.handlers)) for n in noise]
    yield
    for logger, (propagate, kept) in zip(noise, before, strict=True):
        logger.propagate = propagate
        for h in list(logger.handlers):
            logger.removeHandler(h)
        for h in kept:
            logger.addHandler(h)
    console._ROUTED.clear()
    if "optuna" in sys.modules:  # _say_everything turned its stderr handler off, as enn tune does
        sys.modules["optuna"].logging.enable_default_handler()
    for h in list(root.handlers):
        root.removeHandler(h)
        if h not in handlers:
            h.close()
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)
    logging.captureWarnings(False)


def _say_everything() -> None:
    import torch.distributed.elastic.agent.server.api  # noqa: F401 - torch's own log handlers

    # a NOISE logger's child, as torchelastic's agent logs from its thread
    logging.getLogger("torch.distributed.elastic.agent.server.api").warning(
        "Failed to register signal handlers since torchelastic is running on a child thread"
    )
    logging.getLogger("torch.onnx._internal.exporter._registration").warning(
        "torchvision is not installed. Skipping torchvision::nms"
    )
    # a QUIET_WARNINGS warning, as logging.captureWarnings hands it on
    leaf = "`isinstance(treespec, LeafSpec)` is deprecated, use `treespec.is_leaf()` instead."
    logging.getLogger("py.warnings").warning(
        "%s", warnings.formatwarning(leaf, FutureWarning, "torch/utils/_pytree.py", 1)
    )
    # Optuna's trial lines (its own stderr handler off, as enn tune does) and its heartbeat's
    # ExperimentalWarning, raised by Optuna itself
    import optuna

    optuna.logging.disable_default_handler()
    logging.getLogger("optuna.study.study").warning("Trial 3 failed with value None.")
    with warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("always")
        optuna.storages.RDBStorage("sqlite://", heartbeat_interval=60)
        study = optuna.create_study(storage="sqlite://")
        study.tell(study.ask(), float("nan"))  # Optuna's UserWarning: nan is no value
    for w in raised:  # as logging.captureWarnings hands them on (its hook is per process)
        text = warnings.formatwarning(w.message, w.category, w.filename, w.lineno)
        logging.getLogger("py.warnings").warning("%s", text)
    logging.getLogger("enn.distributed-train").info("distributed-train: epoch 1/3")
    logging.getLogger("somelib").warning("a warning nobody explained")


QUIET = (
    "Failed to register signal handlers",
    "Skipping torchvision::nms",
    "LeafSpec",
    "Trial 3 failed",
    "``heartbeat_interval`` is an experimental feature",
    "UserWarning: The value nan is not acceptable",
)


def test_known_noise_reaches_the_log_file_not_the_console(tmp_path, capsys, root_logging):
    log_file = console.setup(tmp_path / "logs", "run-training")
    assert log_file is not None
    _say_everything()
    shown = capsys.readouterr().err
    kept = log_file.read_text()
    assert "distributed-train: epoch 1/3" in shown and "a warning nobody explained" in shown
    assert not [q for q in QUIET if q in shown], shown
    assert [q for q in QUIET if q in kept] == list(QUIET), kept  # "full detail" is there


def test_verbose_shows_the_noise_on_the_console(tmp_path, capsys, root_logging):
    log_file = console.setup(tmp_path / "logs", "run-training", verbose=True)
    assert log_file is not None
    _say_everything()
    shown = capsys.readouterr().err
    assert [q for q in QUIET if q in shown] == list(QUIET), shown
    assert [q for q in QUIET if q in log_file.read_text()] == list(QUIET)
