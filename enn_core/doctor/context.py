"""What the doctor's checks share: the config, the layout, the device, a data sample and the
model built from it (computed once, by the first check that needs it), and filesystem facts.

The sample comes from the staged data (`outputs/stage-data`) when it opens, else from a small
synthetic dataset staged into a temporary directory; `sample_source` says which.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from enn_core.config import RunConfig
from enn_core.errors import ConfigError, EnnError
from enn_core.paths import Layout
from enn_core.runtime.device import resolve_device
from enn_core.stages import STAGE_DATA

if TYPE_CHECKING:
    from enn_core.data.manifest import StagedManifest
    from enn_core.model.enn import ENN

# Filesystems whose random reads are slow or whose semantics surprise memmaps and renames.
NETWORK_FS = (
    "nfs",
    "nfs4",
    "cifs",
    "smb3",
    "smbfs",
    "lustre",
    "gpfs",
    "beegfs",
    "ceph",
    "glusterfs",
    "9p",
    "fuse.sshfs",
    "fuse.s3fs",
    "fuse.gcsfuse",
    "fuse.juicefs",
)
MEMORY_FS = ("tmpfs", "ramfs")
SAMPLE_ROWS = 8


@dataclass(frozen=True)
class Mount:
    """The mount a path lives on (longest mount-point prefix in /proc/self/mounts)."""

    fstype: str
    mountpoint: str
    source: str
    options: str

    @property
    def read_only(self) -> bool:
        return "ro" in self.options.split(",")

    @property
    def kind(self) -> str:
        if self.fstype in MEMORY_FS:
            return "memory"
        if self.fstype in NETWORK_FS or self.fstype.startswith("fuse"):
            return "network"
        return "local"


def _unescape(s: str) -> str:
    """Mount table fields escape spaces and tabs as octal (\\040)."""
    return s.encode().decode("unicode_escape") if "\\" in s else s


def mount_of(path: str | Path) -> Mount:
    """The mount holding `path` (its nearest existing ancestor). 'unknown' without /proc."""
    p = Path(path).resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    unknown = Mount("unknown", "/", "unknown", "")
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return unknown
    best: Mount | None = None
    for line in lines:  # the longest mount point wins; a later (stacked) mount over an earlier
        parts = line.split()
        if len(parts) < 4:
            continue
        point = _unescape(parts[1])
        inside = str(p) == point or str(p).startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best.mountpoint)):
            best = Mount(parts[2], point, _unescape(parts[0]), parts[3])
    return best or unknown


def free_bytes(path: str | Path) -> tuple[int, int]:
    """(free, total) bytes of the filesystem holding `path` (nearest existing ancestor)."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    usage = shutil.disk_usage(p)
    return usage.free, usage.total


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def doctor_device(requested: str) -> tuple[torch.device, str]:
    """The device the runtime would use (runtime.device's one resolver), and a problem instead
    of its refusal when the config asks for a missing CUDA device: the doctor reports it."""
    try:
        device, _ = resolve_device(requested)
    except ConfigError:
        return torch.device("cpu"), "runtime.device=cuda but torch.cuda.is_available() is False"
    return device, ""


@dataclass
class DoctorContext:
    cfg: RunConfig
    layout: Layout
    quick: bool
    device: torch.device
    device_problem: str = ""
    shared: dict[str, Any] = field(default_factory=dict)
    _tmp: list[Path] = field(default_factory=list)

    @classmethod
    def create(cls, cfg: RunConfig, layout: Layout, quick: bool) -> DoctorContext:
        device, problem = doctor_device(cfg.runtime.device)
        return cls(cfg, layout, quick, device, problem)

    @property
    def staged_dir(self) -> Path:
        return STAGE_DATA.output_dir(self.layout)

    def tempdir(self, prefix: str) -> Path:
        """A temporary directory removed by `close()`."""
        d = Path(tempfile.mkdtemp(prefix=f"enn-doctor-{prefix}-"))
        self._tmp.append(d)
        return d

    def close(self) -> None:
        for d in self._tmp:
            shutil.rmtree(d, ignore_errors=True)
        self._tmp.clear()

    def sample(self) -> tuple[StagedManifest, np.ndarray, Path, str]:
        """(manifest, a few feature rows, data dir, 'staged' | 'synthetic (why)'), cached."""
        if "sample" not in self.shared:
            self.shared["sample"] = self._load_sample()
        return self.shared["sample"]

    def _load_sample(self) -> tuple[StagedManifest, np.ndarray, Path, str]:
        from enn_core.data.dataset import StagedDataset

        why = "no staged data"
        if (self.staged_dir / "manifest.json").exists():
            try:
                ds = StagedDataset(self.staged_dir)
                rows = np.array(ds.features[: min(SAMPLE_ROWS, ds.n_rows)], dtype=np.float32)
                if len(rows):
                    return ds.manifest, rows, self.staged_dir, "staged data"
                why = "staged data has no rows"
            except (EnnError, OSError, ValueError) as e:
                why = f"staged data unusable ({str(e).splitlines()[0][:120]})"
        return (*self._synthetic(), f"synthetic manifest ({why})")

    def _synthetic(self) -> tuple[StagedManifest, np.ndarray, Path]:
        from enn_core.data.dataset import StagedDataset
        from enn_core.stages.demo import stage_synthetic

        root = self.tempdir("synthetic")
        (root / "params.yaml").write_text("{}\n")
        with _quiet_logs():
            path = stage_synthetic(root, n_months=4, n_daytypes=2, n_sections=4, n_hours=6)
        ds = StagedDataset(path)
        return ds.manifest, np.array(ds.features[:SAMPLE_ROWS], dtype=np.float32), path

    def model(self) -> ENN:
        """The configured model built for the sample's manifest (raises the build error)."""
        if "model" not in self.shared:
            from enn_core.model import ModelCode, build_model

            manifest, _, data_dir, _ = self.sample()
            code = ModelCode.of(self.cfg.model, self.layout.root)
            self.shared["model"] = build_model(
                self.cfg.model, manifest.data_spec(), data_dir=data_dir, code=code
            ).eval()
        return self.shared["model"]

    def precision_dtype(self) -> torch.dtype:
        """The autocast dtype the trainer would pick (fp32 when the config is refused)."""
        from enn_core.runtime.precision import choose_precision

        try:
            return choose_precision(self.cfg.train, self.device).dtype
        except EnnError:
            return torch.float32


@contextlib.contextmanager
def _quiet_logs() -> Iterator[None]:
    """Staging logs progress at INFO; the doctor's table is the output."""
    import logging

    logger = logging.getLogger("enn")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)
