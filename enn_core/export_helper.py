"""export's programs made in a helper process that started before the stage.

Tracing and converting take seconds of imports (torch.export's tracer, the ONNX exporter) and
of single-threaded Python, so the flow starts a helper when validate starts (tasks/warm.py):

    python -m enn_core.export_serve <module> ...

(enn_core/export_serve.py, the helper's own side) imports those modules on the core validate,
predict and collapse-check leave idle, then waits for one request on standard input (one JSON
line: the run's config, the stage's inputs, the folder the programs go to, a log file). It
answers on standard output, one JSON line per message: `{"say": line}` as each part starts,
then `{"results": ...}`, `{"error": line}`, or `{"interrupted": true}` when Ctrl-C reached it
(the parent then stops as interrupted: its own KeyboardInterrupt can be lost, raised inside a
finalizer while torch traces, which Python only prints as "Exception ignored").
End of input before a request means it was not needed. Only the parent holds the pipes: the
request never comes from a file. It is a child of the process table (enn_core.runtime.children:
the parent-pid handshake, its record by pid and start time); it dies with its parent and with
the parent's process group (Ctrl-C); the parent kills it when the stage is cancelled or
interrupted. `enn export`, `dvc
repro` and any run without a helper export in their own process, with the same code.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from enn_core import errors
from enn_core.errors import EnnError, ExportError
from enn_core.runtime import children

log = logging.getLogger("enn.export")
ONNX_MODULES = ("torch.onnx._internal.exporter._core", "onnxruntime")


@dataclass
class Helper:
    child: children.Child
    reading: bool = False  # a reader thread owns its stdout (it closes it at EOF)

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        return self.child.proc


_helper: list[Helper] = []  # at most one, taken by the next export
_lock = threading.Lock()


def modules(formats: tuple[str, ...]) -> list[str]:
    """What the export of `formats` imports beyond this module."""
    return ["enn_core.export", "torch.export._trace", *(ONNX_MODULES if "onnx" in formats else ())]


def start(formats: tuple[str, ...]) -> Helper:
    """A helper importing what `formats` need, the one the next export takes."""
    command = [sys.executable, "-m", "enn_core.export_serve", *modules(formats)]
    helper = Helper(children.start("export-helper", command, pipes=True))
    with _lock:
        before, _helper[:] = list(_helper), [helper]
    for old in before:
        stop(old)
    return helper


def stop(helper: Helper) -> None:
    """Killed and reaped (children.stop). Its stdout is closed here only when no reader thread
    owns it (closing a pipe another thread reads from waits for that read)."""
    children.stop(helper.child)
    pipes = [helper.proc.stdin, *([] if helper.reading else [helper.proc.stdout])]
    for pipe in pipes:
        with contextlib.suppress(OSError, ValueError):
            assert pipe is not None
            pipe.close()


def release_unused() -> None:
    """The helper no export took, stopped."""
    with _lock:
        unused, _helper[:] = list(_helper), []
    for helper in unused:
        stop(helper)


def take() -> Helper | None:
    """The running helper (None: there is none, or it ended; export runs here then)."""
    with _lock:
        helper = _helper.pop() if _helper else None
    if helper is not None and helper.proc.poll() is not None:
        stop(helper)
        return None
    return helper


@dataclass
class Pending:
    """A request the helper works on; its messages arrive in `lines`."""

    helper: Helper
    request: dict[str, Any]
    lines: queue.SimpleQueue[bytes]


def send(helper: Helper, request: dict[str, Any]) -> Pending:
    """`request` to `helper`, which starts on it; `answer` waits for its end."""
    lines: queue.SimpleQueue[bytes] = queue.SimpleQueue()
    assert helper.proc.stdin is not None and helper.proc.stdout is not None
    out = helper.proc.stdout

    def read() -> None:
        with contextlib.suppress(OSError, ValueError):  # stopped: the pipe is closed
            for line in iter(out.readline, b""):
                lines.put(line)
        lines.put(b"")
        with contextlib.suppress(OSError):
            out.close()

    try:
        helper.proc.stdin.write(json.dumps(request).encode() + b"\n")
        helper.proc.stdin.close()
    except (OSError, ValueError):  # it ended before the request: `answer` says so
        pass
    helper.reading = True
    threading.Thread(target=read, name="enn-export-helper", daemon=True).start()
    return Pending(helper, request, lines)


def answer(
    pending: Pending, say: Callable[[str], None], cancel: threading.Event | None
) -> dict[str, dict[str, Any]]:
    """The results of `pending` (its lines to `say` as they come), or its error raised here
    with its class; the helper is stopped when it ends, fails or is cancelled."""
    helper = pending.helper
    try:
        while True:
            try:
                line = pending.lines.get(timeout=0.2)
            except queue.Empty:
                if cancel is not None and cancel.is_set():
                    raise ExportError("export cancelled; its helper process was stopped") from None
                continue
            if not line:
                break
            msg = parse(line)
            if msg is None:
                raise ExportError(
                    f"export: its helper process answered {line[:80]!r}, which is not one of its "
                    f"messages; see {pending.request['log']}"
                )
            if "say" in msg:
                say(str(msg["say"]))
            elif "interrupted" in msg:
                # its group's Ctrl-C: this process's own may have been lost (raised inside a
                # finalizer, Python only prints it), so the stage stops here either way
                raise KeyboardInterrupt
            elif "error" in msg:
                cls = getattr(errors, str(msg.get("type", "")), ExportError)
                ok = isinstance(cls, type) and issubclass(cls, EnnError)
                raise (cls if ok else ExportError)(str(msg["error"]))
            else:
                return dict(msg["results"])  # it exits as it answers: `stop` reaps it
    finally:
        stop(helper)
    raise ExportError(
        f"export: its helper process ended (exit {helper.proc.returncode}) before it "
        f"answered; see {pending.request['log']} for why"
    )


def parse(line: bytes) -> dict[str, Any] | None:
    """One of the helper's messages, or None (not JSON, not one of them)."""
    try:
        msg = json.loads(line)
    except ValueError:
        return None
    if not isinstance(msg, dict) or not {"say", "interrupted", "error", "results"} & set(msg):
        return None
    if "results" in msg and not isinstance(msg["results"], dict):
        return None
    return msg
