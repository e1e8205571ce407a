"""Checkpoint, predict, collapse and export sections."""

from __future__ import annotations

from typing import Literal

from enn_core.config.fields import frozen
from enn_core.errors import ConfigError

AUTO_PREDICT_BATCH = 4096  # predict.batch_size=auto's ceiling (rows per forward)


@frozen
class CheckpointConfig:
    init_from: str = ""
    """Warm start: a consolidated checkpoint path, models:/name@alias, or `champion` (this
    task's registered champion); empty = fresh seeded init."""

    dir: str = ""
    """Where distributed-train keeps its DCP checkpoints (one folder per fingerprint); empty =
    <work_dir>/checkpoints. Multi-node jobs need a directory every node sees (shared storage)."""

    every_steps: int = 0
    """DCP save every N optimizer steps (0 = only at epoch ends)."""

    keep_last: int = 2
    """Committed checkpoints kept (the best one is always kept)."""

    async_save: bool = False
    """Asynchronous DCP save on its own gloo group. It stages a CPU copy of the rank's whole
    checkpoint state (its shard of the weights and of AdamW's two moments: 3x its weights)
    first; false = no copy (training waits for each save)."""

    async_staging: Literal["kept", "per_save"] = "kept"
    """With async_save: `kept` holds one staged copy of the state from the first save to the
    end of training (reused: blocks training least); `per_save` makes it at each save and
    frees it once that save is written (memory held only while a save is in flight; each
    save blocks longer)."""

    resume: bool = True
    """Resume an interrupted run from the latest committed checkpoint with the same fingerprint
    (data hash, data/model/train config, torch version); false = start fresh, clearing them."""

    resume_from: str = ""
    """Resume from this checkpoint instead (a step-* directory under <work>/checkpoints/); refused
    with the difference named when its fingerprint differs, unless warm_start."""

    warm_start: bool = False
    """With resume_from: take only its model weights (fresh optimizer, step 0), even when its
    fingerprint differs."""

    def __post_init__(self) -> None:
        if self.every_steps < 0 or self.keep_last < 1:
            raise ConfigError("checkpoint.every_steps must be >= 0 and checkpoint.keep_last >= 1")


@frozen
class PredictConfig:
    split: str = "test"
    """Split to predict in the training flow (train, val, test, all)."""

    model: str = ""
    """Model to predict with: a consolidated checkpoint path or models:/name@alias (in the
    training flow, empty = this pipeline's model). The prediction pipeline's default,
    model/model.pt, is its local copy of this task's champion, which `enn run --flow
    prediction` refreshes from the registry when tracking is on."""

    input_dir: str = ""
    """Features-only staged dataset for the prediction flow; empty = the training staged data."""

    world_size: int = 1
    """Prediction workers on each node (each loads the full model and predicts its own row
    range); across nodes (runtime.nnodes > 1, or under torchrun) the job has nnodes x world_size
    ranks."""

    parts_dir: str = ""
    """Folder of the prediction's parts (a subfolder per output) until they are assembled; empty
    = work/predict-parts. A prediction across nodes needs a folder every node shares."""

    chunk_rows: int = 4096
    """Rows per written chunk."""

    batch_size: int | Literal["auto"] = "auto"
    """Rows per forward pass; auto = predict.chunk_rows, at most 4096 (`forward_rows`)."""

    calibration: Literal["auto", "raw"] = "auto"
    """auto = collapse-check's chosen prediction path when its calibration.json names this model
    (else raw); raw = never calibrate."""

    calibration_dir: str = ""
    """collapse-check output holding calibration.json; empty = beside the model, then
    outputs/collapse-check next to the model's stage output, then this pipeline's."""

    xlsx: bool = True
    """For workbook sources, also write predictions.xlsx in the input's layout."""

    @property
    def forward_rows(self) -> int:
        """predict.batch_size resolved: auto = a written chunk's rows in one forward, at most
        AUTO_PREDICT_BATCH (model(x) gains nothing past a few thousand rows, and a chunk holds
        4096 by default)."""
        if self.batch_size == "auto":
            return min(self.chunk_rows, AUTO_PREDICT_BATCH)
        return self.batch_size

    @property
    def forward_rows_reason(self) -> str:
        """Why `forward_rows` is what it is (the run records it)."""
        if self.batch_size != "auto":
            return f"predict.batch_size={self.batch_size}"
        return (
            f"predict.batch_size=auto: predict.chunk_rows={self.chunk_rows}, "
            f"at most {AUTO_PREDICT_BATCH}"
        )

    def __post_init__(self) -> None:
        batch = 1 if self.batch_size == "auto" else self.batch_size
        if self.world_size < 1 or self.chunk_rows < 1 or batch < 1:
            raise ConfigError(
                "predict.world_size, predict.chunk_rows and predict.batch_size must be >= 1"
            )


@frozen
class ValidateConfig:
    baselines: tuple[str, ...] = ("ridge", "gbt")
    """What validate scores beside the naive predictors, fitted on the training rows: `ridge`
    (RidgeCV on the encoded features, one linear model per output cell) and `gbt` (scikit-learn's
    HistGradientBoosting, one sample per row and output cell); [] = none. Cached per data,
    split and these settings under <work_dir>/cache/baselines/."""

    baseline_max_rows: int = 200_000
    """Training samples a baseline fits on (gbt: rows x output cells); more are subsampled
    (seeded) down to this, and the metrics files say so."""

    baseline_losses: tuple[str, ...] = ("absolute_error",)
    """The losses each fitted baseline is fitted with: `absolute_error` (the loss of the
    reported MAE), `squared_error`, or both (each fitted, the lower validation MAE kept; the
    record names both)."""

    baseline_time_s: float = 60.0
    """Time cap of one baseline: its fits (every loss) and predictions. gbt stops adding trees
    and ridge stops reweighting before the cap (the record says where); when even the least a
    fit can do passes it by more than a tenth, the record says so."""

    def __post_init__(self) -> None:
        bad = [b for b in self.baselines if b not in ("ridge", "gbt")]
        if bad or len(set(self.baselines)) != len(self.baselines):
            raise ConfigError(
                f"validate.baselines={list(self.baselines)}: use some of [ridge, gbt], each once"
            )
        losses = ("absolute_error", "squared_error")
        if (
            not self.baseline_losses
            or any(x not in losses for x in self.baseline_losses)
            or len(set(self.baseline_losses)) != len(self.baseline_losses)
        ):
            raise ConfigError(
                f"validate.baseline_losses={list(self.baseline_losses)}: use one or both of "
                f"{list(losses)}, each once"
            )
        if self.baseline_max_rows < 100 or self.baseline_time_s <= 0:
            raise ConfigError(
                "validate.baseline_max_rows must be >= 100 and validate.baseline_time_s > 0"
            )


@frozen
class CollapseConfig:
    median_ratio_min: float = 0.5
    """Collapse when the median spread ratio (pred std / target std per output) is below this."""

    p10_ratio_min: float = 0.3
    """Collapse when the 10th percentile spread ratio is below this."""

    flat_tolerance: float = 1e-3
    """An output whose spread across samples is below this fraction of its target spread is flat."""

    max_flat_fraction: float = 0.5
    """Collapse when more than this fraction of outputs is flat."""

    broadcast_tolerance: float = 1e-6
    """Two rows' outputs are identical when max |diff| <= this x label std."""

    max_broadcast_fraction: float = 0.5
    """Collapse when more than this fraction of rows with distinct inputs shares its output with
    another such row."""

    min_correlation: float = 0.3
    """Calibrated candidate: median per-output correlation with the targets on held-out rows must
    reach this."""

    calibration_slope_max: float = 3.0
    """Bound on the calibration slope (per output, in [0, max])."""

    calibration_folds: int = 5
    """Cross-fitting folds over the validation rows: the calibrated candidate is judged on rows its
    affine was not fitted on."""

    batch_size: int = 64
    """Rows per forward pass of the batched candidates (batch-level broadcast shows at any size >
    1)."""

    max_rows: int = 2048
    """Validation rows the check uses; more are sampled (seeded) down to this, since the per-sample
    candidate runs one row at a time."""

    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """Precision of the raw candidate; auto = the precision the training run recorded."""

    order: tuple[str, ...] = ("raw", "calibrated", "fp32", "per_sample")
    """Candidate order; the first that passes is chosen."""

    def __post_init__(self) -> None:
        allowed = {"raw", "calibrated", "fp32", "per_sample"}
        bad = [c for c in self.order if c not in allowed]
        if bad:
            raise ConfigError(
                f"collapse.order has unknown candidates {bad}; use some of {sorted(allowed)}"
            )
        if not self.order or len(set(self.order)) != len(self.order):
            raise ConfigError(
                f"collapse.order={list(self.order)} must list each candidate at most once "
                "and not be empty"
            )
        if self.calibration_slope_max <= 0:
            raise ConfigError("collapse.calibration_slope_max must be > 0 (e.g. 3.0)")
        if self.calibration_folds < 2 or self.batch_size < 2 or self.max_rows < 4:
            raise ConfigError(
                "collapse.calibration_folds and collapse.batch_size must be >= 2, "
                "collapse.max_rows >= 4"
            )
        for name in ("max_flat_fraction", "max_broadcast_fraction"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(f"collapse.{name} must be in [0, 1]")


ONNX_EXTERNAL_DATA_MAX_MB = 1536.0  # torch.onnx's own threshold (1.5 GiB of initializers)


@frozen
class ExportConfig:
    formats: tuple[str, ...] = ("torch_export", "onnx")
    """Formats to export."""

    required: tuple[str, ...] = ("torch_export", "onnx")
    """Formats whose failure fails the stage; an optional format is skipped only when its dependency
    is missing."""

    opset: int = 18
    """ONNX opset."""

    parity_batch_sizes: tuple[int, ...] = (1, 37, 64)
    """Batch sizes checked for parity with eager."""

    parity_rel_tol: float = 1e-4
    """Parity: max |diff| <= tol x max(max |reference|, label std)."""

    parity_rows: int = 4096
    """Held-out rows parity is checked on: a fixed (seeded) sample of the validation and test
    rows, all of them when there are fewer (each is run at every batch size, batch 1 included)."""

    example_batch: int = 8
    """Rows of the example input used to trace the model (>= 2, so the batch dimension stays
    dynamic)."""

    units: str = ""
    """Unit of the labels, written to the sidecar (e.g. km/h); empty = 'label units'."""

    onnx_external_data_mb: float = 1536.0
    """ONNX weights above this many MB are written beside model.onnx in model.onnx.data (a
    protobuf file cannot pass 2 GB); 0 = always. At most 1536, where torch's exporter moves them
    out anyway."""

    def __post_init__(self) -> None:
        allowed = {"torch_export", "onnx"}
        bad = [f for f in self.formats if f not in allowed]
        if bad:
            raise ConfigError(
                f"export.formats has unknown formats {bad}; use some of {sorted(allowed)}"
            )
        missing = [f for f in self.required if f not in self.formats]
        if missing:
            raise ConfigError(
                f"export.required lists {missing} which export.formats does not; "
                "add them to formats"
            )
        if not self.parity_batch_sizes or min(self.parity_batch_sizes) < 1:
            raise ConfigError("export.parity_batch_sizes must be a non-empty list of sizes >= 1")
        if self.example_batch < 2:
            raise ConfigError(
                "export.example_batch must be >= 2 (a batch of 1 would be specialized)"
            )
        if self.parity_rel_tol <= 0:
            raise ConfigError("export.parity_rel_tol must be > 0")
        if self.parity_rows < 1:
            raise ConfigError("export.parity_rows must be >= 1 (held-out rows checked for parity)")
        if not 0 <= self.onnx_external_data_mb <= ONNX_EXTERNAL_DATA_MAX_MB:
            raise ConfigError(
                f"export.onnx_external_data_mb={self.onnx_external_data_mb} must be in "
                f"[0, {ONNX_EXTERNAL_DATA_MAX_MB:g}]: above that torch's exporter writes the "
                "weights to model.onnx.data anyway"
            )
