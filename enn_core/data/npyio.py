""".npy streaming: a writer whose row count grows as chunks arrive, and header readers.

`NpyWriter` reserves a fixed-size header, appends C-ordered chunks, hashes the data bytes
in a helper thread while the main thread reads and writes the next chunk (BLAKE3 and file
writes release the GIL, so they overlap), and rewrites the header with the final row count
on close. Headers are plain npy 1.0, so `np.load(mmap_mode="r")` reads the files. The hash
is enn_core.data.hashing's BLAKE3, at several GB/s a core: one thread keeps up with a write.
"""

from __future__ import annotations

import os
import struct
import tokenize
import zipfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any, BinaryIO

import numpy as np
import numpy.typing as npt

from enn_core.data import hashing
from enn_core.errors import DataError

MAGIC = b"\x93NUMPY\x01\x00"
HEADER_BYTES = 128  # magic + length + dict, padded: room for any realistic shape


def _header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    text = repr(
        {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    )
    body_len = HEADER_BYTES - len(MAGIC) - 2
    if len(text) + 1 > body_len:
        raise DataError(
            f"array shape {shape} is too long for the staged .npy header; reduce its rank"
        )
    body = text.ljust(body_len - 1) + "\n"
    return MAGIC + struct.pack("<H", body_len) + body.encode("latin1")


class NpyWriter:
    """Append rows of `tail_shape` to `path`; `close()` fixes the header and fsyncs."""

    def __init__(self, path: str | Path, dtype: npt.DTypeLike, tail_shape: tuple[int, ...]) -> None:
        self.path = Path(path)
        self.dtype = np.dtype(dtype)
        self.tail_shape = tuple(int(d) for d in tail_shape)
        self.rows = 0
        self._hash = hashing.new()
        # the source's own hasher (BLAKE3, untyped), once its bytes differ from the staged ones
        self._src: Any = None
        self._src_seen = False
        self._pool = ThreadPoolExecutor(max_workers=1)
        self._pending: Future[None] | None = None  # the previous chunk's hashing
        self._f: BinaryIO = open(self.path, "wb")  # noqa: SIM115 - closed in close()
        self._f.write(_header(self.dtype, (0, *self.tail_shape)))

    def write(self, chunk: np.ndarray, raw: np.ndarray | None = None) -> None:
        """Append `chunk`; `raw` is the input array it came from, whose data hash is kept too.

        While the staged bytes equal the input bytes (the common float32 pass-through) one
        hash serves both; at the first difference the input's hash forks (a copy of the hasher).
        """
        if chunk.shape[1:] != self.tail_shape:
            raise ValueError(f"chunk shape {chunk.shape} does not match rows of {self.tail_shape}")
        if chunk.shape[0] == 0:  # e.g. every row of a chunk dropped: nothing to append
            return
        arr = np.ascontiguousarray(chunk, dtype=self.dtype)
        # = memoryview(arr); numpy's stubs make ndarray a Buffer only on Python >= 3.12
        view = arr.data.cast("B")
        src = None
        if raw is not None:
            self._src_seen = True
            raw = np.ascontiguousarray(raw)
            same = (
                raw.nbytes == arr.nbytes
                and raw.ctypes.data == arr.ctypes.data
                and raw.dtype == arr.dtype
            )
            if not same or self._src is not None:
                src = raw.data.cast("B")
        self._wait()  # one chunk hashing at a time: memory stays at two chunks
        if src is not None and self._src is None:
            self._src = self._hash.copy()
        self._pending = self._pool.submit(_hash_chunk, self._hash, view, self._src, src)
        if arr.size:
            self._f.write(view)
        self.rows += arr.shape[0]

    def source_hash(self) -> str | None:
        """Hash of the input arrays' data bytes passed as `raw` (None if none were)."""
        if not self._src_seen:
            return None
        return hashing.named(self._src or self._hash)

    def _wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.rows, *self.tail_shape)

    def close(self, sync: bool = True) -> str:
        """Finish the file (fsynced unless `sync` is off: a scratch file); returns its data hash."""
        self._wait()
        self._pool.shutdown()
        self._f.seek(0)
        self._f.write(_header(self.dtype, self.shape))
        self._f.flush()
        if sync:
            os.fsync(self._f.fileno())
        self._f.close()
        return hashing.named(self._hash)

    def abort(self) -> None:
        self._wait()
        self._pool.shutdown()
        self._f.close()


def _hash_chunk(h: Any, view: memoryview, src_h: Any, src: memoryview | None) -> None:
    """Feed the staged hasher and, when the input's bytes differ, the input's (BLAKE3 hashers:
    the blake3 package ships no types)."""
    h.update(view)
    if src is not None:
        src_h.update(src)


def write_npy(path: str | Path, arr: np.ndarray) -> str:
    """Write a small array in one go (same header and hashing as the streaming writer)."""
    w = NpyWriter(path, arr.dtype, arr.shape[1:])
    w.write(arr)
    return w.close()


def read_header(f: IO[bytes], where: str) -> tuple[tuple[int, ...], np.dtype, bool]:
    """Shape, dtype and fortran flag of the .npy stream at `f` (refuses object arrays)."""
    try:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
    # numpy parses the header with Python's tokenizer: a corrupt one raises what that raises
    except (ValueError, SyntaxError, tokenize.TokenError, EOFError) as e:
        raise DataError(
            f"{where}: not a valid .npy array ({' '.join(str(e).split())[:200]}); save it with "
            "numpy.save"
        ) from e
    if dtype.hasobject:
        raise DataError(
            f"{where}: holds an object array, which needs pickle and is refused; "
            "save a numeric array (e.g. arr.astype('float32'))"
        )
    if dtype.kind not in "biuf":
        raise DataError(
            f"{where}: dtype {dtype} is not numeric; save features and labels as numbers"
        )
    return tuple(shape), dtype, fortran


def npz_member(
    path: Path, key: str
) -> tuple[zipfile.ZipFile, IO[bytes], tuple[int, ...], np.dtype]:
    """Open member `key` of an .npz for streaming reads (stored or deflated)."""
    try:
        zf = zipfile.ZipFile(path)
    except zipfile.BadZipFile as e:
        raise DataError(f"{path}: not a valid .npz (zip) file; save it with numpy.savez") from e
    names = [n[:-4] for n in zf.namelist() if n.endswith(".npy")]
    if key not in names:
        zf.close()
        raise DataError(
            f"{path}: has no array {key!r} (it has {names}); "
            "set data.npz_features_key / npz_labels_key"
        )
    f = zf.open(f"{key}.npy")
    shape, dtype, fortran = read_header(f, f"{path}[{key}]")
    if fortran and len(shape) > 1:
        zf.close()
        raise DataError(
            f"{path}[{key}]: Fortran-ordered array; save it C-ordered (np.ascontiguousarray)"
        )
    return zf, f, shape, dtype


def read_rows(f: IO[bytes], dtype: np.dtype, tail: tuple[int, ...], n: int) -> np.ndarray:
    """Read `n` rows from a stream positioned inside an npy payload."""
    itemsize = dtype.itemsize * int(np.prod(tail, dtype=np.int64))
    buf = f.read(n * itemsize)
    if len(buf) != n * itemsize:
        raise DataError(f"{getattr(f, 'name', 'array')}: truncated array data; re-save the file")
    return np.frombuffer(buf, dtype=dtype).reshape((n, *tail))
