"""Training checkpoints on disk: DCP saves, atomic commit, retention, discovery.

One directory per fingerprint (enn_core.train.fingerprint), kept across `dvc repro` under the
work directory and never cached by DVC (only the consolidated `model.pt` is):

    <work>/checkpoints/<digest>/
        fingerprint.json                 what the digest covers (names a difference on refusal)
        step-00000042/                   a committed checkpoint, named by its global position
            __<rank>_0.distcp .metadata  DCP shards: model (+ loss parameters) and optimizer
            trainer.json                 loop state: position, scheduler, early stopping, history
            rng-rank<r>.pt               each rank's RNG state
            COMMITTED                    written last (with every file's content hash);
                                         readers ignore a directory without it
        quarantine/step-00000040-<t>/    a committed checkpoint whose files no longer match
                                         their hashes, moved aside on resume
        .tmp-step-00000042-a<attempt>-<random>/   being written (named by rank 0)
        COMPLETE                         the run finished: the next run of this fingerprint
                                         starts fresh

Why this shape:
- Atomic: every rank writes into the temporary directory; after DCP's collective save has
  returned (its coordinator writes `.metadata` only once every rank's shards are written),
  rank 0 renames it and writes COMMITTED last (fsynced). A crash anywhere before leaves the
  previous checkpoint the latest usable one; the next start sweeps the debris.
- Retention keeps the last `keep_last` plus the best epoch's checkpoint, which early stopping
  restores at the end (also after a resume).
- Asynchronous save (`checkpoint.async_save`) runs on its own gloo group: on the default
  group its background collectives interleave with training's and crash it (FIELD_NOTES).
  At most one is in flight; it is awaited before the next save and at the end.
- One stager serves every asynchronous save of a run. DCP's default builds a new one, with
  new CPU staging buffers, per save; reusing the buffers blocked training 2.4x less again
  (bench/bench_dcp.py), at the cost of holding one staged copy of the state between saves
  (the rank's weights and optimizer state: 403 MB for 134 MB of weights under AdamW).
  `checkpoint.async_staging=per_save` makes a stager per save instead and closes it once
  that save is written, so the copy is held only while a save is in flight.
  Reuse is safe because the previous save (and so its upload from those buffers) has
  finished before the next stages. Staging stays synchronous, so training cannot change
  weights mid-copy; the CUDA-only options (pinned memory, background staging, non-blocking
  copies) are off: unmeasured here, with no GPU.
- Corruption: COMMITTED records each file's BLAKE3 hash. Resume verifies the checkpoint it
  chooses; a mismatch (a truncated shard, a bad disk) moves it to quarantine/ with a warning
  and an event naming the files, and resume falls back to the previous committed checkpoint
  (or starts fresh). The hashes catch corruption; they are not the security control: crafted
  files are refused by the safe reader (enn_core/runtime/safe_dcp.py).
- A finished run leaves COMPLETE: resume is for interrupted runs, so re-running a finished
  configuration (`dvc repro -f`) trains again instead of returning the old result.
- Rank 0 decides which checkpoint to resume and broadcasts it, so ranks never disagree
  because of a directory listing taken at different moments.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from enn_core.atomic import fsync_dir, not_a_link, own_folder, write_json
from enn_core.config import CheckpointConfig
from enn_core.data.hashing import hash_files
from enn_core.errors import StaleOutputError
from enn_core.runtime.dist import broadcast_json

if TYPE_CHECKING:  # DCP (0.6 s of imports) only where a worker saves: not in the stage's parent
    from torch.distributed.checkpoint.staging import DefaultStager

COMMITTED = "COMMITTED"
COMPLETE = "COMPLETE"
QUARANTINE = "quarantine"
log = logging.getLogger("enn.checkpoint")
TRAINER = "trainer.json"


def step_name(position: int) -> str:
    return f"step-{position:08d}"


def committed(root: Path) -> list[Path]:
    """Committed checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step-*") if not p.is_symlink() and (p / COMMITTED).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def content_hashes(step: Path) -> dict[str, str]:
    """Each file of a checkpoint directory and its BLAKE3 hash (COMMITTED itself excluded)."""
    return {
        p.name: hash_files([p])
        for p in sorted(step.iterdir())
        if p.is_file() and p.name != COMMITTED
    }


def corrupt_files(step: Path) -> list[str]:
    """The files of a committed checkpoint that no longer match the hashes its COMMITTED
    recorded (missing ones included); [] when they match or it recorded none (older runs)."""
    try:
        recorded = json.loads((step / COMMITTED).read_text()).get("files") or {}
    except (OSError, json.JSONDecodeError, AttributeError):
        return [COMMITTED]
    if not isinstance(recorded, dict):
        return [COMMITTED]
    bad = []
    for name, digest in recorded.items():
        path = step / str(name)
        if path.name != name or path.is_symlink() or not path.is_file():  # none outside it
            bad.append(str(name))
        elif hash_files([path]) != digest:
            bad.append(name)
    return bad


def quarantine(step: Path, bad: list[str]) -> Path:
    """Move a corrupt committed checkpoint out of the way (kept for inspection)."""
    dest = step.parent / QUARANTINE / f"{step.name}-{int(time.time())}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.rename(step, dest)
    log.warning(
        "checkpoint %s is corrupt (%s no longer match their hashes): moved to %s; resuming "
        "from the previous committed checkpoint",
        step,
        ", ".join(bad),
        dest,
    )
    return dest


LINK_FIX = "remove the link, or choose another checkpoint.dir"


def remove(p: Path) -> None:
    """Delete a checkpoint folder of ours; a link is removed as a link (never followed) and
    named."""
    if p.is_symlink():
        log.warning(
            "checkpoint folder %s is a link (to %s): removed the link only", p, os.readlink(p)
        )
        p.unlink(missing_ok=True)
    else:
        shutil.rmtree(p, ignore_errors=True)


def read_trainer(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / TRAINER).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise StaleOutputError(
            f"{path / TRAINER}: unreadable checkpoint state ({e}); delete {path} to fall back "
            "to the previous checkpoint"
        ) from e


class Checkpointer:
    """Save, commit, prune and find the checkpoints of one fingerprint directory.

    Every rank holds one; file-system changes (sweep, rename, marker, prune) are rank 0's.
    `on_event(name, **fields)` reports saves to the run record (rank 0's events log)."""

    def __init__(
        self,
        root: Path,
        cfg: CheckpointConfig,
        *,
        rank: int,
        distributed: bool,
        attempt: int = 0,
        on_event: Callable[..., None] | None = None,
        before_commit: Callable[[int], None] | None = None,
    ) -> None:
        self.root, self.cfg, self.rank = Path(root), cfg, rank
        self.distributed, self.attempt = distributed, attempt
        self.on_event = on_event or (lambda *a, **k: None)
        self.before_commit = before_commit or (lambda position: None)
        self.pending: tuple[Any, Path, int, dict, float] | None = None
        self.pg = None
        self.stager: DefaultStager | None = None  # the asynchronous saves' one stager
        self.saved: list[int] = []
        self.best: str | None = None
        self.quarantined: list[str] = []  # corrupt checkpoints moved aside by prepare()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # -- start ---------------------------------------------------------------------------
    def prepare(self, *, resume: bool, keep: bool = False) -> Path | None:
        """Sweep debris; return the checkpoint to resume (the same on every rank), or None.

        Without `resume`, or after a finished run, the directory is cleared (a fresh start),
        unless `keep` (an explicit checkpoint.resume_from may point into it)."""
        choice = None
        if self.is_main:
            not_a_link(self.root, LINK_FIX)
            self.root.mkdir(parents=True, exist_ok=True)
            for p in [*self.root.glob(".tmp-step-*"), *self.root.glob("step-*")]:
                if p.is_symlink() or not (p / COMMITTED).is_file():
                    remove(p)
            if not keep and ((self.root / COMPLETE).exists() or not resume):
                self.clear()
            (self.root / COMPLETE).unlink(missing_ok=True)
            choice = self._latest_sound()
        if self.cfg.async_save and self.distributed:
            self.pg = dist.new_group(backend="gloo")  # collective: every rank, same point
        return Path(choice) if (choice := self._broadcast(choice)) else None

    def _latest_sound(self) -> str | None:
        """The newest committed checkpoint whose files match their hashes; corrupt ones are
        quarantined on the way (recorded as events)."""
        for step in reversed(committed(self.root)):
            bad = corrupt_files(step)
            if not bad:
                return str(step)
            moved = quarantine(step, bad)
            self.quarantined.append(str(moved))
            self.on_event("checkpoint_quarantined", path=str(step), files=bad, moved_to=str(moved))
        return None

    def clear(self) -> None:
        for p in self.root.glob("step-*"):
            remove(p)
        (self.root / COMPLETE).unlink(missing_ok=True)

    def _draw(self) -> str:
        """Rank 0's random name part, the same on every rank (a collective when distributed:
        every rank saves at the same position)."""
        return str(self._broadcast(secrets.token_hex(8) if self.is_main else None))

    def _broadcast(self, value: Any) -> Any:
        if not (self.distributed and dist.is_initialized()):
            return value
        return broadcast_json(value, src=0)  # JSON, not a pickle from a peer

    # -- save ----------------------------------------------------------------------------
    def save(self, state: dict, trainer: dict, position: int) -> None:
        """Write a checkpoint at global position `position` (steps done); commit when written."""
        self.wait()
        not_a_link(self.root, LINK_FIX)
        # A name nobody can guess before rank 0 draws it (every rank writes into it): a folder
        # planted in the shared checkpoint.dir beforehand, links inside, is never the one
        # written into (a leftover another user made could not even be removed)
        tmp = self.root / f".tmp-{step_name(position)}-a{self.attempt}-{self._draw()}"
        own_folder(tmp, LINK_FIX)
        rng: dict[str, torch.Tensor | list[torch.Tensor]] = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        torch.save(rng, tmp / f"rng-rank{self.rank}.pt")
        if self.is_main:
            (tmp / TRAINER).write_text(json.dumps(trainer, default=str))
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        if self.cfg.async_save:
            if self.stager is None:
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

                self.stager = DefaultStager(StagingOptions(False, False, False, False))
            resp = dcp.async_save(
                state, checkpoint_id=str(tmp), process_group=self.pg, async_stager=self.stager
            )
            fut = getattr(resp, "upload_completion", resp)
            self.pending = (fut, tmp, position, trainer, t0)
            self.on_event(
                "checkpoint_started", position=position, blocked_s=time.perf_counter() - t0
            )
        else:
            dcp.save(state, checkpoint_id=str(tmp))
            self._commit(tmp, position, trainer, t0)

    def poll(self) -> None:
        """Commit the asynchronous save in flight if it has finished (never blocks)."""
        if self.pending is not None and self.pending[0].done():
            self.wait()

    def wait(self) -> None:
        """Await the asynchronous save in flight (if any) and commit it."""
        if self.pending is None:
            return
        fut, tmp, position, trainer, t0 = self.pending
        self.pending = None
        fut.result()
        if self.cfg.async_staging == "per_save" and self.stager is not None:
            self.stager.close()  # its upload is done: the staged copy is freed until the next
            self.stager = None
        self._commit(tmp, position, trainer, t0)

    def _commit(self, tmp: Path, position: int, trainer: dict, t0: float) -> None:
        self.before_commit(position)  # fault injection: a crash between write and commit
        self.saved.append(position)
        if trainer.get("best_checkpoint"):
            self.best = trainer["best_checkpoint"]
        if not self.is_main:
            return
        final = self.root / step_name(position)
        if final.exists() or final.is_symlink():  # one this run supersedes (same position)
            remove(final)
        os.rename(tmp, final)
        files = content_hashes(final)  # every rank's shards are there: the save returned
        with open(final / COMMITTED, "w") as f:
            f.write(
                json.dumps(
                    {
                        "position": position,
                        "time": time.time(),
                        "attempt": self.attempt,
                        "files": files,
                    }
                )
            )
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(self.root)
        self.prune()
        self.on_event(
            "checkpoint_saved",
            position=position,
            seconds=time.perf_counter() - t0,
            path=str(final),
            epoch_end=bool(trainer.get("epoch_end")),
        )

    def prune(self) -> None:
        """Keep the last `keep_last` committed checkpoints and the best one."""
        found = committed(self.root)
        keep = {p.name for p in found[-self.cfg.keep_last :]}
        if self.best:
            keep.add(self.best)
        for p in found:
            if p.name not in keep:
                remove(p)

    def complete(self) -> None:
        """The run finished: await the last save, then mark the directory COMPLETE."""
        self.wait()
        if self.is_main:
            write_json(self.root / COMPLETE, {"time": time.time(), "saved": self.saved})

    def close(self) -> None:
        """At exit. After an error an in-flight save is not awaited (its peers may be gone):
        it stays uncommitted, so the next start sweeps it and resumes the previous one."""
        if self.pg is not None and self.pending is None:
            dist.destroy_process_group(self.pg)
        if self.stager is not None and self.pending is None:
            self.stager.close()  # frees the staging buffers; an in-flight save keeps its own
        self.pg, self.stager = None, None
