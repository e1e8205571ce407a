"""A progress bar on long work (staging chunks, training steps, prediction parts): on stderr
when it is a terminal and `runtime.progress` is on, silent otherwise (CI logs, Prefect workers,
redirected output). A leaf: any layer may draw one (enn_core/progress.py follows training)."""

from __future__ import annotations

import os
import sys

from tqdm import tqdm  # type: ignore[import-untyped]  # tqdm ships no type stubs

BAR_DELAY_S = 1.0  # a bar shows once work has lasted this long: no "0chunk" flash for a blink


def bar(
    total: int | None, desc: str, enabled: bool = True, unit: str = "it", delay: float = BAR_DELAY_S
) -> tqdm:
    """A bar on stderr when it is a terminal, shown once the work has lasted `delay` seconds
    (it shows at an `update`; a bar drawn by `refresh` alone needs delay 0, or its `close`
    would not clear it)."""
    on = shows(enabled)
    # A terminal that reports no size (a fresh pseudo-terminal, `docker run -t`) would make
    # tqdm draw nothing at all (0 columns; -1 rows hides every bar): 100 x 24 then.
    cols, rows = _size() if on else (0, 0)
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        disable=not on,
        leave=False,
        delay=delay,
        dynamic_ncols=cols > 0 and rows > 0,
        ncols=None if cols > 0 else 100,
        nrows=None if rows > 0 else 24,
    )


def shows(enabled: bool = True) -> bool:
    """Whether a bar is drawn: `runtime.progress` on and stderr a terminal. Where none is, the
    stages' loops say their progress in a line now and then (enn_core.progress.Ticker)."""
    return enabled and sys.stderr.isatty()


def _size() -> tuple[int, int]:
    try:
        size = os.get_terminal_size(sys.stderr.fileno())
    except (OSError, ValueError):
        return 0, 0
    return size.columns, size.lines
