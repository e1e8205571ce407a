"""The export helper's own side (enn_core/export_helper.py starts it and talks to it):

    python -m enn_core.export_serve <module> ...

imports the modules (a warm-up: one that fails is only logged), reads one request from
standard input, points its own output at the request's log file, answers on what was standard
output and exits. Ctrl-C or SIGTERM to the group while it works: `{"interrupted": true}`.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import sys
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

from enn_core.atomic import open_own
from enn_core.errors import EnnError
from enn_core.runtime.parent import die_with_parent, exit_process

log = logging.getLogger("enn.export")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def serve(request: dict[str, Any], reply: TextIO) -> dict[str, Any]:
    """One request, in the helper: the export's results, or its error (class and line)."""
    from enn_core.config import RunConfig  # imported once this process dies with its parent
    from enn_core.config.loader import build
    from enn_core.export import export_all, prediction_inputs

    def say(line: str) -> None:
        print(json.dumps({"say": line}), file=reply, flush=True)

    try:
        cfg = build(RunConfig, request["config"], root=RunConfig, where="the export request")
        inputs = prediction_inputs(
            cfg, Path(request["root"]), request["stage"], *map(Path, request["inputs"])
        )
        formats = tuple(request.get("formats", cfg.export.formats))
        required = tuple(f for f in cfg.export.required if f in formats)
        ex = replace(cfg.export, formats=formats, required=required)
        out = Path(request["out"])
        return {
            "results": export_all(
                inputs.path, inputs.heldout, out, ex, inputs.std, say, inputs.heldout_rows
            )
        }
    except EnnError as e:
        return {"error": str(e), "type": type(e).__name__}
    except Exception as e:  # noqa: BLE001 - one line for the parent, the trace in the log
        traceback.print_exc()
        first = (str(e).strip().splitlines() or [""])[0][:300]
        return {"error": f"export: {type(e).__name__}: {first}; see {request['log']}"}


def main(argv: list[str]) -> int:
    die_with_parent()
    missed = []
    for name in argv:  # a warm-up only: export_all applies its own rules to what is missing
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - e.g. an optional ONNX package not installed
            missed.append(f"{name}: {type(e).__name__}: {e}")
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    request = json.loads(line)
    reply = os.fdopen(os.dup(1), "w")  # the answers; prints, warnings and logs go to the log
    logged = open_own(request["log"], mode=0o644)
    for fd in (1, 2):
        os.dup2(logged, fd)
    os.close(logged)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    for miss in missed:
        log.info("warm-up import failed (export decides what it needs): %s", miss)
    # SIGTERM to the group (a scheduler) stops the request as Ctrl-C does: the parent is told
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    answer: dict[str, Any]
    try:
        answer = serve(request, reply)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM reached the group: the parent stops too
        answer = {"interrupted": True}
    print(json.dumps(answer), file=reply, flush=True)
    return 0


if __name__ == "__main__":
    exit_process(main(sys.argv[1:]))
