"""Reading distributed checkpoints (DCP) without running code from them.

torch 2.13's DCP reads each checkpoint's `.metadata` with plain `pickle.load`
(`FileSystemReader.read_metadata`) and every byte item inside a `.distcp` shard with
`torch.load(..., weights_only=False)` (`DefaultLoadPlanner.load_bytes`; the optimizer's
param-group values such as `lr` and `betas` are stored that way). A crafted file therefore runs
code on resume, and a multi-node `checkpoint.dir` is shared storage (FIELD_NOTES). Here:

- `SafeReader.read_metadata` unpickles `.metadata` allowing only the classes DCP metadata is
  made of (its dataclasses, `torch.Size`, dtypes, the layout and memory-format helpers, paths);
- `SafeLoadPlanner.load_bytes` reads byte items with `weights_only=True` (enn_core/tensor_file.py);
- tensors were already read with `weights_only=True` by torch itself.

Anything else is refused with one line naming the file: `UntrustedCheckpointError` (in
enn_core/errors.py, so a worker's refusal reaches the launcher as itself: exit 4). Content
hashes (enn_core/train/ckpt.py) catch corruption; this is the security control.

    load(state_dict, path)          # dcp.load through the safe reader and planner
"""

from __future__ import annotations

import enum
import io
import pickle
from pathlib import Path
from typing import IO, Any, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.utils import CheckpointException

from enn_core.errors import UntrustedCheckpointError
from enn_core.tensor_file import load_tensors

METADATA_MODULE = "torch.distributed.checkpoint.metadata"
# What a DCP `.metadata` pickle is made of (read off the checkpoints torch 2.13 writes).
ALLOWED: frozenset[tuple[str, str]] = frozenset(
    {
        (METADATA_MODULE, "Metadata"),
        (METADATA_MODULE, "MetadataIndex"),
        (METADATA_MODULE, "StorageMeta"),
        (METADATA_MODULE, "TensorStorageMetadata"),
        (METADATA_MODULE, "BytesStorageMetadata"),
        (METADATA_MODULE, "ChunkStorageMetadata"),
        (METADATA_MODULE, "TensorProperties"),
        (METADATA_MODULE, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("collections", "OrderedDict"),
    }
)


def _enum_member(cls: Any, name: Any) -> Any:
    """`builtins.getattr` as Python 3.11.0-3.11.4 pickle an enum member (`getattr(cls, name)`;
    later releases pickle `cls(value)`): allowed for the metadata's own enum only."""
    if (
        isinstance(cls, type)
        and issubclass(cls, enum.Enum)
        and (cls.__module__, cls.__name__) in ALLOWED
        and name in cls.__members__
    ):
        return cls.__members__[name]
    raise pickle.UnpicklingError(f"getattr({cls!r}, {name!r}) is not an enum member lookup")


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, f: IO[bytes], where: str) -> None:
        super().__init__(f)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in ALLOWED or dtype:
            return super().find_class(module, name)
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        raise UntrustedCheckpointError(
            f"{self.where}: refers to {module}.{name}, which checkpoint metadata never holds; "
            "it was not loaded (a crafted or foreign file): delete it, or resume from another "
            "checkpoint"
        )


class SafeReader(FileSystemReader):
    """A FileSystemReader whose `.metadata` cannot run code."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(cast(IO[bytes], f), str(path)).load()
            except UntrustedCheckpointError:
                raise
            except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as e:
                raise UntrustedCheckpointError(
                    f"{path}: not readable checkpoint metadata ({type(e).__name__}: {e}); "
                    "delete the checkpoint or resume from another"
                ) from None
        if not isinstance(metadata, Metadata):
            raise UntrustedCheckpointError(
                f"{path}: holds a {type(metadata).__name__}, not checkpoint metadata; delete it"
            )
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading byte items with `weights_only=True`."""

    def __init__(self, checkpoint: str | Path, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.checkpoint = str(checkpoint)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = load_tensors(
            value,
            name=f"{self.checkpoint}: item {read_item.dest_index.fqn!r}",
            what="checkpoint item",
            fix="checkpoint data never holds that; it was not loaded: delete the checkpoint or "
            "resume from another",
        )
        # placed as DefaultLoadPlanner.load_bytes places what it loads (torch 2.13)
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def load(state_dict: dict[str, Any], path: str | Path, *, process_group: Any = None) -> None:
    """`dcp.load(state_dict, checkpoint_id=path)` through the safe reader and planner; a crafted
    file raises UntrustedCheckpointError (also when DCP wraps it for a rank)."""
    SafeReader(path).read_metadata()  # first on its own: DCP reports its failure as a string
    try:
        dcp.load(
            state_dict,
            storage_reader=SafeReader(path),
            planner=SafeLoadPlanner(path),
            process_group=process_group,
        )
    except CheckpointException as e:
        for failure, _ in e.failures.values():  # (exception, traceback summary) per rank
            if isinstance(failure, UntrustedCheckpointError):
                raise failure from None
        raise
