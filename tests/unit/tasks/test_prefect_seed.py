"""The Prefect seed database (tasks/prefect_seed.py): made once per environment by Prefect's
own migrations, copied 0600 into a work directory that has no prefect.db yet, and never over
anything already there (a database, a link)."""

from __future__ import annotations

import sqlite3
import time

from tasks.prefect_seed import make, seed, seed_path


def test_the_seed_is_prefects_schema_copied_once_and_never_over_anything(tmp_path):
    prefix = tmp_path / "env"
    made = make(prefix)
    assert made == seed_path(prefix) and made.is_file()
    with sqlite3.connect(made) as db:
        (version,) = db.execute("select version_num from alembic_version").fetchone()
        runs = db.execute("select count(*) from flow_run").fetchone()[0]
    assert version and runs == 0
    t0 = time.monotonic()
    assert make(prefix) == made and time.monotonic() - t0 < 1  # once per Prefect version

    home = tmp_path / "work" / "prefect"
    assert seed(home / "prefect.db", prefix)
    assert (home / "prefect.db").stat().st_mode & 0o777 == 0o600
    assert (home / "prefect.db").read_bytes() == made.read_bytes()
    assert [p.name for p in home.iterdir()] == ["prefect.db"]  # no temporary file left

    (home / "prefect.db").write_bytes(b"the user's own")
    assert not seed(home / "prefect.db", prefix)
    assert (home / "prefect.db").read_bytes() == b"the user's own"

    victim = tmp_path / "victim"
    victim.write_text("kept")
    other = tmp_path / "other" / "prefect.db"
    other.parent.mkdir()
    other.symlink_to(victim)
    assert not seed(other, prefix) and victim.read_text() == "kept"
    dangling = tmp_path / "dangling" / "prefect.db"
    dangling.parent.mkdir()
    dangling.symlink_to(tmp_path / "nowhere.db")
    assert not seed(dangling, prefix) and not (tmp_path / "nowhere.db").exists()

    assert not seed(tmp_path / "fresh" / "prefect.db", tmp_path / "no-env")  # no seed: migrate
