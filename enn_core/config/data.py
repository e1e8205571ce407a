"""Data: what stage-data reads and how it stages it. (Owned by the stage-data issue.)"""

from __future__ import annotations

import re
from dataclasses import field
from typing import Literal

from enn_core.config.fields import frozen
from enn_core.errors import ConfigError

MAX_PERIOD = 10**9  # a cycle's length in its units (seconds of a year are 3e7): floats stay finite


@frozen
class SyntheticConfig:
    n_months: int = 12
    """Values of the month key."""

    n_daytypes: int = 7
    """Values of the day-type key."""

    n_directions: int = 2
    """Values of the direction key."""

    n_sections: int = 12
    """Sections (first label axis)."""

    n_hours: int = 24
    """Hours (second label axis)."""

    n_replicates: int = 3
    """Replicate days per (month, day type, direction) group."""

    noise: float = 2.0
    """Noise std (label units)."""

    daily: float = 1.5
    """Std of the per-day offset (label units), shared by all cells of a row."""

    seed: int = 0
    """Generator seed."""

    def __post_init__(self) -> None:
        sizes = (
            self.n_months,
            self.n_daytypes,
            self.n_directions,
            self.n_sections,
            self.n_hours,
            self.n_replicates,
        )
        if min(sizes) < 1:
            raise ConfigError("data.synthetic sizes (n_months, n_daytypes, ...) must all be >= 1")
        if self.noise < 0 or self.daily < 0:
            raise ConfigError("data.synthetic.noise and data.synthetic.daily must be >= 0")


@frozen
class WorkbookLayout:
    sheet_pattern: str = r"^(?P<month>\d{2})월 (?P<daytype>\S)요일$"
    """Regex over sheet names; its named groups give key values (e.g. month, day type)."""

    row_keys: tuple[str, ...] = ("구간", "방향")
    """Columns that key the rows inside a sheet (section, direction)."""

    section_column: str = "구간"
    """Column naming the section, as 'A-B'."""

    direction_column: str = "방향"
    """Column giving the direction."""

    direction_key: str = "direction"
    """Key name under which the direction column's value is a group key."""

    section_separator: str = "-"
    """Separator between a section's two ends."""

    canonical_sections: bool = True
    """Sort a section's two ends so both directions share one section order."""

    time_pattern: str = r"^(?P<hour>\d{2})시$"
    """Regex matching the time-axis columns; group 'hour' orders them."""

    group_keys: tuple[str, ...] = ("month", "daytype", "direction")
    """Keys that make one sample (one label grid)."""

    ignore_columns: tuple[str, ...] = ("노선",)
    """Columns read and ignored (e.g. route name)."""

    def __post_init__(self) -> None:
        for name in (self.section_column, self.direction_column):
            if name not in self.row_keys:
                raise ConfigError(
                    f"data.workbook.row_keys={list(self.row_keys)} must include the column {name!r}"
                )
        for pattern in (self.sheet_pattern, self.time_pattern):
            try:
                re.compile(pattern)
            except re.error as e:
                raise ConfigError(
                    f"data.workbook pattern {pattern!r} is not a valid regex: {e}"
                ) from e
        if "hour" not in re.compile(self.time_pattern).groupindex:
            raise ConfigError(
                f"data.workbook.time_pattern={self.time_pattern!r} needs a named group 'hour'"
            )


@frozen
class DataConfig:
    source: Literal["synthetic", "npy", "npz", "csv", "parquet", "workbook"] = "synthetic"
    """Input kind."""

    path: str = ""
    """Input file (features for npy; the table or workbook otherwise). Relative paths resolve from
    the project root."""

    labels_path: str = ""
    """Labels .npy when source=npy."""

    npz_features_key: str = "features"
    """Member of the .npz holding the features."""

    npz_labels_key: str = "labels"
    """Member of the .npz holding the labels."""

    feature_columns: tuple[str, ...] = ()
    """Feature columns (csv/parquet) or names (npy); empty = all non-label columns."""

    categorical: tuple[str, ...] = ("month", "daytype", "direction")
    """Features that get a vocabulary and an embedding (never z-scored)."""

    cyclic: tuple[str, ...] = ("month",)
    """Periodic keys encoded as sine/cosine (may also be categorical)."""

    cyclic_periods: tuple[int, ...] = (12,)
    """Period of each cyclic key, in the order of data.cyclic (month 12, hour 24, weekday 7);
    ignored when data.cyclic is empty."""

    cyclic_starts: tuple[int, ...] = (1,)
    """First value of each cyclic key's period, in the order of data.cyclic (month 1, hour 0);
    ignored when data.cyclic is empty."""

    label_columns: tuple[str, ...] = ()
    """Label columns (csv/parquet)."""

    label_shape: tuple[int, ...] = ()
    """Reshape labels to this shape (e.g. [39, 24]); empty = flat."""

    label_axes: tuple[str, ...] = ("section", "hour")
    """Names of the label axes."""

    encoding: str = "utf-8"
    """Text encoding of a CSV input (e.g. latin-1, cp1252); other formats carry their own."""

    nonfinite: Literal["error", "drop"] = "error"
    """NaN/inf in features or labels: fail naming the first row and column, or drop the rows."""

    features_only: bool = False
    """Stage new data against a training manifest (no labels), reusing its vocabularies and
    scaler."""

    training_manifest: str = ""
    """Training manifest to stage against in features-only mode."""

    chunk_rows: int = 65536
    """Rows read at once: staging's chunks of the table, and validate's passes over the staged
    rows (the naive predictors' statistics, every predictor's scores), each of which also caps
    the numbers it holds at once. Lower it when a stage runs out of memory."""

    val_fraction: float = 0.15
    """Validation share of the training rows (seeded)."""

    test_fraction: float = 0.15
    """Test share of all rows when no folds are declared (seeded)."""

    split_seed: int = 0
    """Seed of the split shuffle."""

    fold_key: str = ""
    """Column whose values define group folds (e.g. month); empty = random splits. It splits
    the rows and is not a model input unless data.feature_columns names it (so new inputs to
    predict need not carry it)."""

    folds: tuple[tuple[str, ...], ...] = ()
    """Fold definitions: each a list of fold_key values held out together."""

    test_fold: int = 0
    """Index of the fold held out as the test split."""

    val_fold: int = -1
    """Index of the fold held out as the validation split; -1 = a seeded val_fraction of the
    non-test rows."""

    val_by_key: bool = False
    """With data.folds and val_fold -1: the validation rows are whole fold_key values (e.g.
    months) drawn (seeded) from the training folds, a val_fraction share of them (at least
    one), instead of a share of the rows; early stopping then measures what the test fold asks
    of the model, a key value no training row had."""

    naive_keys: tuple[str, ...] = ("daytype", "direction")
    """Keys of the conditional naive predictor (mean of the same cell over training rows sharing
    them)."""

    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    """Synthetic spatio-temporal generator."""

    workbook: WorkbookLayout = field(default_factory=WorkbookLayout)
    """Spatio-temporal workbook layout."""

    def __post_init__(self) -> None:
        self._check_cyclic()
        if self.source != "synthetic" and not self.path:
            raise ConfigError(
                f"data.path is empty but data.source={self.source}; set data.path to the input file"
            )
        if not 0 <= self.val_fraction < 1 or not 0 <= self.test_fraction < 1:
            raise ConfigError("data.val_fraction and data.test_fraction must be in [0, 1)")
        if self.val_fraction + self.test_fraction >= 1:
            raise ConfigError(
                "data.val_fraction + data.test_fraction must be < 1 to leave training rows"
            )
        if self.chunk_rows < 1:
            raise ConfigError("data.chunk_rows must be >= 1")
        if self.folds and not self.fold_key:
            raise ConfigError(
                "data.folds is set but data.fold_key is empty; name the key the folds hold out"
            )
        if self.folds and not 0 <= self.test_fold < len(self.folds):
            raise ConfigError(
                f"data.test_fold={self.test_fold} but only {len(self.folds)} folds are declared"
            )
        if self.val_fold >= 0 and (
            not self.folds or self.val_fold >= len(self.folds) or self.val_fold == self.test_fold
        ):
            raise ConfigError(
                f"data.val_fold={self.val_fold} must name a declared fold other than "
                "data.test_fold, or be -1"
            )
        if self.val_by_key and (not self.folds or self.val_fold >= 0):
            raise ConfigError(
                "data.val_by_key needs data.folds and data.val_fold -1 (it draws the "
                "validation key values from the training folds); set them or turn it off"
            )
        if self.features_only and not self.training_manifest:
            raise ConfigError(
                "data.features_only=true needs data.training_manifest "
                "(the staged training manifest.json)"
            )

    def _check_cyclic(self) -> None:
        """One period and one first value per cyclic key; none without a cyclic key (issue 54:
        `data.cyclic=[]` alone failed on the default cyclic_starts=[1])."""
        if not self.cyclic:  # its periods and starts describe nothing
            object.__setattr__(self, "cyclic_periods", ())
            object.__setattr__(self, "cyclic_starts", ())
        if len(self.cyclic_starts) != len(self.cyclic):
            raise ConfigError(
                f"data.cyclic_starts={list(self.cyclic_starts)} must give one first value per "
                "data.cyclic key"
            )
        if len(self.cyclic_periods) != len(self.cyclic) or any(
            not 2 <= p <= MAX_PERIOD for p in self.cyclic_periods
        ):
            raise ConfigError(
                f"data.cyclic_periods={list(self.cyclic_periods)} must give one period per "
                f"data.cyclic key {list(self.cyclic)}, each from 2 to {MAX_PERIOD:.0e}"
            )
