"""Read ahead: a generator's next item made in a helper thread while the caller works on this one.

pyarrow's CSV reader parses with the GIL released, on one core (its streaming reader parses
block after block). Staging a CSV spent most of its time waiting for it, then checked, hashed
and wrote each chunk while the parser sat idle (issue 51). `ReadAhead` runs the parser in a
thread of its own, so the next chunk is parsed while this one is staged.

At most `depth` items wait, made and not yet taken (plus the one the caller holds), so the
memory stays bounded by chunks, not rows. An exception of the generator reaches the caller
at the item where it arose, after every item made before it, as if the caller ran the
generator itself. Closing (or the caller's `with`, or a `for` loop left early) stops the
thread at its next item and closes the generator in that thread (its `finally` runs there).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class _End:
    """The generator's end, or its exception (`error`), as the queue's last item."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


class ReadAhead(Generic[T]):
    """Iterate `make()`'s items, each made in a helper thread (`enn-read-ahead`) while the caller
    works on the one before."""

    def __init__(self, make: Callable[[], Iterator[T]], depth: int = 1) -> None:
        self._make = make
        self._items: queue.Queue[T | _End] = queue.Queue()
        self._room = threading.Semaphore(depth)  # items the thread may make ahead of the caller
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._run, name="enn-read-ahead", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        items = None
        try:
            items = self._make()
            while True:
                self._room.acquire()
                if self._stop.is_set():
                    return
                try:
                    item = next(items)
                except StopIteration:
                    self._items.put(_End())
                    return
                self._items.put(item)
        except BaseException as e:  # the caller raises it, in its own thread
            self._items.put(_End(e))
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()

    def __iter__(self) -> ReadAhead[T]:
        return self

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        item = self._items.get()
        if isinstance(item, _End):
            self._done = True
            self._thread.join()
            if item.error is not None:
                raise item.error
            raise StopIteration
        self._room.release()
        return item

    def close(self) -> None:
        """Stop the thread (it finishes the item it is making) and wait for it."""
        self._done = True
        self._stop.set()
        self._room.release()  # a thread waiting for room wakes, sees the stop and ends
        self._thread.join()
        while not self._items.empty():  # what it made ahead, freed now
            self._items.get_nowait()

    def __enter__(self) -> ReadAhead[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
