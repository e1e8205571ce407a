"""`enn gc [--dry-run]`: remove what the `gc:` retention policy lets go (tasks/gc.py) and say
what it freed, and what it left alone because it lies outside the roots gc owns. The plan is
made once: `--dry-run` prints exactly what the real run removes."""

from __future__ import annotations

from pathlib import Path

from enn_core.config import RunConfig
from enn_core.paths import Layout
from tasks import gc


def gc_command(cfg: RunConfig, config: Path, layout: Layout, *, dry_run: bool) -> int:
    planned = gc.plan(cfg, layout)
    for s in planned.skipped:
        print(f"left alone: {s.path} ({s.why})")
    failed = {} if dry_run else gc.remove(cfg, layout, planned.removals)
    done = [r for r in planned.removals if r.path not in failed]
    for r in done:
        print(f"{'would remove' if dry_run else 'removed'}: {r.path} ({mb(r.size)}; {r.why})")
    for path, why in failed.items():
        print(f"not removed: {path} ({why})")
    verb = "would free" if dry_run else "freed"
    total = sum(r.size for r in done)
    print(f"gc: {verb} {mb(total)} in {len(done)} path(s) (policy: gc: in {config.name})")
    return 0


def mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"
