"""Read ahead (issue 51): a CSV's next chunk is parsed in a thread of its own while staging
checks, hashes and writes this one; items and errors reach the caller in the generator's
order, at most `depth` items are made ahead, and a caller that stops early stops the thread."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from enn_core.config import DataConfig
from enn_core.data.readahead import ReadAhead
from enn_core.data.tables import CsvSource
from tests.fixtures.data import TABLE_CFG, table_rows, write_table_csv

WAIT = 10.0  # seconds a helper thread gets to reach a point (it takes milliseconds)


def _threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name and t.is_alive()]


def test_items_then_the_error_in_the_generators_order():
    def gen():
        yield 1
        yield 2
        raise ValueError("row 3 is bad")

    got = []
    with pytest.raises(ValueError, match="row 3 is bad"):
        for item in ReadAhead(gen):
            got.append(item)
    assert got == [1, 2]
    assert not _threads("enn-read-ahead")


def test_the_next_item_is_made_while_the_caller_holds_this_one():
    made = [threading.Event() for _ in range(3)]
    makers: list[str] = []

    def gen():
        for i in range(3):
            makers.append(threading.current_thread().name)
            made[i].set()
            yield i

    items = ReadAhead(gen, depth=1)
    assert next(items) == 0
    # the caller has not asked for item 1: the helper thread makes it meanwhile
    assert made[1].wait(WAIT)
    # and no more than that one ahead (depth 1): item 2 waits until item 1 is taken
    assert not made[2].wait(0.2)
    assert next(items) == 1
    assert made[2].wait(WAIT)
    assert list(items) == [2]
    assert set(makers) == {"enn-read-ahead"}


def test_stopping_early_closes_the_generator_and_ends_the_thread():
    closed = threading.Event()

    def gen():
        try:
            yield from range(1000)
        finally:
            closed.set()

    with ReadAhead(gen) as items:
        assert next(items) == 0
    assert closed.is_set()
    assert not _threads("enn-read-ahead")


def test_a_csv_is_parsed_ahead_in_its_own_thread(tmp_path: Path):
    """Staging a CSV: while the caller holds a chunk, the next is parsed in the thread
    "enn-read-ahead"; the thread is gone once the chunks are read, or the caller stops."""
    header, rows = table_rows(2000)
    path = write_table_csv(tmp_path / "t.csv", rows, header)
    cfg = DataConfig(source="csv", path=str(path), chunk_rows=500, **TABLE_CFG)
    source = CsvSource(cfg, path)
    chunks = source.chunks()
    first = next(chunks)
    assert first.rows == 500
    assert _threads("enn-read-ahead")
    assert sum(c.rows for c in chunks) == 1500
    assert not _threads("enn-read-ahead")
    chunks = source.chunks()
    next(chunks)
    chunks.close()  # a caller that stops early (an error in a chunk): the reader stops too
    assert not _threads("enn-read-ahead")
    source.close()
