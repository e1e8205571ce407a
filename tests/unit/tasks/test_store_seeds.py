"""The seed databases (tasks/store_seeds.py): made once per environment by Prefect's and
MLflow's own migrations, copied 0600 into a work directory that has no database yet, and never
over anything already there (a database, a link)."""

from __future__ import annotations

import sqlite3
import time

from tasks.store_seeds import make, seed, seed_path


def made_seed(store, prefix, table: str):
    """`make(store)` under `prefix`: the seed's path, after checking it holds the tool's schema
    (an Alembic version) and no row of `table`."""
    made = make(store, prefix)
    assert made == seed_path(store, prefix) and made.is_file()
    with sqlite3.connect(made) as db:
        (version,) = db.execute("select version_num from alembic_version").fetchone()
        rows = db.execute(f"select count(*) from {table}").fetchone()[0]  # noqa: S608 - ours
    assert version and rows == 0
    return made


def test_the_seed_is_prefects_schema_copied_once_and_never_over_anything(tmp_path):
    prefix = tmp_path / "env"
    made = made_seed("prefect", prefix, "flow_run")
    t0 = time.monotonic()
    assert make("prefect", prefix) == made and time.monotonic() - t0 < 1  # once per version

    home = tmp_path / "work" / "prefect"
    assert seed(home / "prefect.db", "prefect", prefix)
    assert (home / "prefect.db").stat().st_mode & 0o777 == 0o600
    assert (home / "prefect.db").read_bytes() == made.read_bytes()
    assert [p.name for p in home.iterdir()] == ["prefect.db"]  # no temporary file left

    (home / "prefect.db").write_bytes(b"the user's own")
    assert not seed(home / "prefect.db", "prefect", prefix)
    assert (home / "prefect.db").read_bytes() == b"the user's own"

    victim = tmp_path / "victim"
    victim.write_text("kept")
    other = tmp_path / "other" / "prefect.db"
    other.parent.mkdir()
    other.symlink_to(victim)
    assert not seed(other, "prefect", prefix) and victim.read_text() == "kept"
    dangling = tmp_path / "dangling" / "prefect.db"
    dangling.parent.mkdir()
    dangling.symlink_to(tmp_path / "nowhere.db")
    assert not seed(dangling, "prefect", prefix) and not (tmp_path / "nowhere.db").exists()

    assert not seed(
        tmp_path / "fresh" / "prefect.db", "prefect", tmp_path / "no-env"
    )  # no seed: migrate


def test_the_mlflow_seed_is_its_schema_and_the_store_opened_on_a_copy_is_its_own(tmp_path):
    """MLflow's seed holds the schema only (no experiment: the Default experiment's artifact
    location would be the seed's); a copy opened through MlflowClient answers at once, with the
    Default experiment under its own store and the registry's tables there."""
    from mlflow import MlflowClient

    prefix = tmp_path / "env"
    made = made_seed("mlflow", prefix, "experiments")
    assert str(tmp_path).encode() not in made.read_bytes()  # no path of where it was made

    store = tmp_path / "work" / "mlflow" / "mlflow.db"
    assert seed(store, "mlflow", prefix)
    assert store.stat().st_mode & 0o777 == 0o600
    client = MlflowClient(f"sqlite:///{store}", registry_uri=f"sqlite:///{store}")
    (default,) = client.search_experiments()
    assert default.experiment_id == "0" and str(prefix) not in default.artifact_location
    exp = client.create_experiment("enn", artifact_location=str(tmp_path / "artifacts"))
    run = client.create_run(exp)
    assert client.get_run(run.info.run_id).info.experiment_id == exp
    client.create_registered_model("m")
    assert [m.name for m in client.search_registered_models()] == ["m"]
    assert not seed(store, "mlflow", prefix)  # a store in use is never replaced

    # a seed that holds a row (made by another recipe, or written to since) is never copied,
    # nor one that is a link; `make` makes it again
    with sqlite3.connect(made) as db:
        db.execute(
            "insert into experiments (experiment_id, name, lifecycle_stage, workspace) "
            "values (7, 'planted', 'active', 'default')"
        )
    assert not seed(tmp_path / "a" / "mlflow.db", "mlflow", prefix)
    assert not (tmp_path / "a" / "mlflow.db").exists()
    assert make("mlflow", prefix) == made
    assert seed(tmp_path / "b" / "mlflow.db", "mlflow", prefix)
    with sqlite3.connect(tmp_path / "b" / "mlflow.db") as db:
        assert db.execute("select count(*) from experiments").fetchone() == (0,)
    real = tmp_path / "real.db"
    made.rename(real)
    made.symlink_to(real)
    assert not seed(tmp_path / "c" / "mlflow.db", "mlflow", prefix)
