"""Train: optimisation, precision, kernels, memory. (Owned by the model/training issue.)"""

from __future__ import annotations

from typing import Literal

from enn_core.config.fields import frozen
from enn_core.errors import ConfigError


@frozen
class TrainConfig:
    epochs: int = 20
    """Maximum epochs."""

    batch_size: int | Literal["auto"] = "auto"
    """Global batch size (rows per optimizer step, across ranks and accumulation); auto = chosen
    for the table's size: the power of two nearest the square root of the training rows, within
    16..4096 (300 rows: 16; 3 million: 2048), a multiple of the world size (logged with its
    reason; enn_core/train/batch.py)."""

    max_steps: int | None = None
    """Stop after this many optimizer steps (the learning-rate schedule ends there); null = no cap
    (train.epochs decides). To try a large table or model quickly."""

    micro_batch: int | str = 0
    """Rows per forward/backward per rank; 0 = global batch / world size (no accumulation); auto =
    the largest divisor of the per-rank batch that fits in memory (measured once before training,
    see enn_core/runtime/batch_probe.py)."""

    memory_headroom: float = 0.2
    """Fraction of memory train.micro_batch=auto keeps free (of the free GPU memory; on CPU of
    MemAvailable shared by the host's ranks)."""

    lr: float = 3e-3
    """Peak learning rate (AdamW)."""

    weight_decay: float = 0.01
    """AdamW weight decay."""

    warmup_steps: int = 20
    """Linear warm-up steps before cosine decay."""

    min_lr_ratio: float = 0.05
    """Cosine floor as a fraction of lr."""

    clip_norm: float = 1.0
    """Gradient clipping norm; 0 disables."""

    loss: Literal["auto", "mse", "l1", "quantile", "huber", "student_t"] = "auto"
    """Loss in normalized units: l1 (mean absolute error, the reported metric's loss), quantile
    (pinball at train.quantile), mse, huber, student_t; auto = the preset's measured default
    (tabular: l1; spatiotemporal and custom: mse; docs/design.md, "Training objective")."""

    quantile: float = 0.5
    """The quantile train.loss=quantile predicts (0.5: the median, as l1)."""

    huber_delta: float = 1.0
    """Huber delta (normalized units)."""

    patience: int = 5
    """Early stopping: epochs without validation improvement; 0 disables."""

    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """Autocast precision; auto = bf16 on GPUs that support it, fp32 on CPU."""

    attention: Literal["auto", "math", "flash", "efficient", "cudnn"] = "auto"
    """Attention backend; auto probes candidates once."""

    compile: bool = False
    """torch.compile the model (falls back to eager on failure)."""

    max_nonfinite_steps: int = 3
    """Consecutive non-finite steps before training stops."""

    max_oom_backoffs: int = 4
    """Out-of-memory back-offs before training stops."""

    shuffle_block: int = 1
    """Rows per contiguous block of the epoch shuffle (1 = row-level shuffle; larger reads big
    staged files in runs)."""

    eval_batch: int | Literal["auto"] = "auto"
    """Rows per validation forward on each rank; auto = twice the training micro-batch, at least
    256 and at most 16384 (no gradients are kept, so it fits where training does)."""

    log_every: int = 50
    """Steps between flushes of the per-step telemetry (data wait, compute, optimizer) to the events
    log."""

    fsdp: bool = True
    """Shard with FSDP2 when world size > 1 (DDP-equivalent at world size 1)."""

    hsdp_replicas: int = 1
    """HSDP replicate dimension (1 = plain FSDP)."""

    def __post_init__(self) -> None:
        if self.epochs < 1:
            raise ConfigError("train.epochs must be >= 1")
        if isinstance(self.micro_batch, str) and self.micro_batch != "auto":
            raise ConfigError(
                f"train.micro_batch={self.micro_batch!r} is not valid; use a positive integer "
                "that divides the per-rank batch, 0 (the whole per-rank batch) or auto "
                "(the largest that fits in memory)"
            )
        if (isinstance(self.batch_size, int) and self.batch_size < 1) or (
            isinstance(self.micro_batch, int) and self.micro_batch < 0
        ):
            raise ConfigError(
                "train.batch_size must be >= 1 (or auto) and train.micro_batch >= 0 (or auto)"
            )
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"train.max_steps={self.max_steps} must be >= 1, or null for no cap")
        if not 0 <= self.memory_headroom < 1:
            raise ConfigError(
                f"train.memory_headroom={self.memory_headroom} must be in [0, 1) "
                "(e.g. 0.2 keeps 20% free)"
            )
        if self.lr <= 0:
            raise ConfigError("train.lr must be > 0")
        if self.clip_norm < 0:
            raise ConfigError("train.clip_norm must be >= 0 (0 disables clipping)")
        eval_batch = 1 if self.eval_batch == "auto" else self.eval_batch
        if self.shuffle_block < 1 or eval_batch < 1 or self.log_every < 1:
            raise ConfigError(
                "train.shuffle_block, train.eval_batch and train.log_every must be >= 1"
            )
        if not 0 < self.quantile < 1:
            raise ConfigError(f"train.quantile={self.quantile} must be in (0, 1) (0.5: the median)")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError("train.min_lr_ratio must be in [0, 1]")
