"""A test's folder tells its tier: after collection, every test under tests/distributed/
carries the `distributed` marker, every test under tests/e2e/ the `e2e` marker, every test
under tests/multihost/ the `multihost` marker, and no other test carries any of them
(scripts/test.sh selects the tiers by these markers)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.tiers import TESTS, TIERS


class Markers:
    """A plugin recording each collected test's file and marker names, after every
    `pytest_collection_modifyitems` hook has run."""

    def __init__(self) -> None:
        self.items: dict[str, tuple[Path, set[str]]] = {}

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        for item in session.items:
            self.items[item.nodeid] = (item.path, {m.name for m in item.iter_markers()})


@pytest.mark.timeout(120)
def test_every_test_carries_the_tier_of_its_folder_and_no_other(pytester):
    markers = Markers()
    rec = pytester.inline_run(
        "--collect-only", "-p", "no:cacheprovider", str(TESTS), plugins=[markers]
    )
    failed = [r.nodeid for r in rec.getreports("pytest_collectreport") if r.failed]
    assert not failed, f"collection errors: {failed}"
    seen = {folder: 0 for folder in ("unit", *TIERS)}
    wrong = []
    for nodeid, (path, names) in markers.items.items():
        folder = path.relative_to(TESTS).parts[0]
        seen[folder] = seen.get(folder, 0) + 1
        want = {folder} & set(TIERS)
        if names & set(TIERS) != want:
            wrong.append(f"{nodeid}: {sorted(names & set(TIERS))}, its folder says {sorted(want)}")
    assert all(seen.values()), f"no tests collected in some folder: {seen}"
    assert not wrong, "tier markers that disagree with the test's folder:\n" + "\n".join(wrong)


def test_a_bare_pytest_runs_the_fast_tier_and_paths_or_markers_the_rest():
    """`pytest` alone selects the fast tier (CONVENTIONS); `-m e2e`, a path, or an xdist
    worker (which receives its controller's choice) keep pytest's own selection."""
    from types import SimpleNamespace

    from tests.fixtures.tiers import bare_run_tiers

    def config(markexpr: str, source: pytest.Config.ArgsSource, **extra) -> SimpleNamespace:
        return SimpleNamespace(
            option=SimpleNamespace(markexpr=markexpr), args_source=source, **extra
        )

    sources = pytest.Config.ArgsSource
    assert bare_run_tiers(config("", sources.TESTPATHS))
    assert not bare_run_tiers(config("e2e", sources.TESTPATHS))
    assert not bare_run_tiers(config("", sources.ARGS))  # pytest tests/e2e/test_x.py
    assert not bare_run_tiers(config("", sources.TESTPATHS, workerinput={}))


def test_the_test_script_runs_the_fast_tier_without_the_slow_tests_and_then_them():
    """Issue 39: the fast tier took 587 s on a loaded two-core machine against its 360 s; the
    unit tests that fit real models (marked `slow`) are a tier of their own after it."""
    import re

    from tests.fixtures.tiers import FAST, SLOW

    script = (TESTS.parent / "scripts" / "test.sh").read_text()
    tiers = dict(re.findall(r'^tier (\w+) \d+ \d+ "([^"]+)"', script, flags=re.M))
    assert tiers["fast"] == FAST and "not slow" in FAST, tiers
    assert tiers["slow"] == SLOW and SLOW.startswith("slow and "), tiers
    assert list(tiers)[:2] == ["fast", "slow"], tiers
