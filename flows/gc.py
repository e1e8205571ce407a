"""`enn gc [--dry-run]`: remove what the `gc:` retention policy lets go (tasks/gc.py) and say
what it freed."""

from __future__ import annotations

from pathlib import Path

from enn_core.config import RunConfig
from enn_core.paths import Layout
from tasks import gc


def gc_command(cfg: RunConfig, config: Path, layout: Layout, *, dry_run: bool) -> int:
    removals = gc.plan(cfg, layout)
    for r in removals:
        print(f"{'would remove' if dry_run else 'removed'}: {r.path} ({mb(r.size)}; {r.why})")
    total = sum(r.size for r in removals)
    if not dry_run:
        total = gc.remove(cfg, layout, removals)
    verb = "would free" if dry_run else "freed"
    print(f"gc: {verb} {mb(total)} in {len(removals)} path(s) (policy: gc: in {config.name})")
    return 0


def mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"
