"""Hypothesis profiles: `ci` (the default) runs the same examples everywhere, with no
per-example deadline (a shared 2-core machine is noisy) and no example database written into
the repository; `explore` searches with fresh randomness (HYPOTHESIS_PROFILE=explore)."""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None, database=None, max_examples=40)
settings.register_profile("explore", deadline=None, max_examples=400)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
