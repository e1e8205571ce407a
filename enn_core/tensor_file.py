"""Reading a tensor file that came from outside: the one place enn_core calls `torch.load`.

A checkpoint (`model.pt`, `init.pt`, a downloaded registry version), a DCP byte item, a saved
non-finite batch and a rank's RNG state are all input nobody vouches for: a crafted pickle
runs code on `torch.load(weights_only=False)`. Every reader goes through `load_tensors`, which
loads with `weights_only=True` and turns torch's refusal (whose message advises loading again
with weights_only off, the one thing not to do) into a one-line error naming the file and what
to do instead:

    load_tensors(path, name=str(path), what="consolidated checkpoint", fix="re-train")
"""

from __future__ import annotations

import pickle
import struct
import warnings
import zipfile
from pathlib import Path
from typing import IO, Any

import torch

from enn_core.errors import StaleOutputError, UntrustedCheckpointError

# What torch raises on a damaged file or random bytes (a file that is not a zip archive falls
# back to the legacy format, whose safe unpickler fails with a KeyError or an IndexError on
# garbage): each becomes the one-line refusal
UNREADABLE = (
    RuntimeError,
    zipfile.BadZipFile,
    EOFError,
    struct.error,
    KeyError,
    IndexError,
    ValueError,
    TypeError,
    OverflowError,
)


def load_tensors(
    source: str | Path | IO[bytes], *, name: str, what: str, fix: str, mmap: bool = False
) -> Any:
    """`torch.load(source, weights_only=True)` on the CPU. A file that names code to run raises
    UntrustedCheckpointError; one the safe reader cannot parse, or a damaged one,
    StaleOutputError; both name `name` (the file, or the file and item), `what` it should be,
    and `fix`. Nothing in the file runs either way. `mmap` (a path in torch's zip format): the
    tensors are the file's pages, mapped privately (read from disk as touched, shared with
    other processes mapping it, copied only where written), not a copy in memory."""
    use_mmap = mmap and isinstance(source, (str, Path)) and zipfile.is_zipfile(source)
    try:
        with warnings.catch_warnings():
            # torch warns of an unusual pickle protocol in what is mostly random bytes: the
            # error below says what matters
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(source, map_location="cpu", weights_only=True, mmap=use_mmap)
    except pickle.UnpicklingError as e:
        if "GLOBAL" in str(e):  # it names code to run: crafted, or another program's pickle
            raise UntrustedCheckpointError.refused(name, str(e), fix) from None
        raise StaleOutputError(  # an opcode the safe reader lacks: damaged, or another pickle
            f"{name}: not a readable {what} (it holds something other than tensors and plain "
            f"values, so it was refused and nothing in it ran): {fix}"
        ) from None
    except UNREADABLE as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise StaleOutputError(f"{name}: not a readable {what} ({first[:200]}); {fix}") from e
