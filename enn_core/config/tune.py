"""Tune and gc: what `enn tune` searches (Optuna) and what `enn gc` may delete.

`tune.space` maps a dotted config key of a section the trials re-run (`model.*`, `train.*`)
to its range: `{low, high}` (`log: true` for a log scale, `step` for a grid), or
`{choices: [...]}`. `dimensions()` turns it into typed records; a bad entry is one line
naming `tune.space.<key>`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from decimal import Decimal
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from enn_core.config.fields import FrozenMap, frozen
from enn_core.config.urls import check_storage_url
from enn_core.errors import ConfigError, DataError

if TYPE_CHECKING:
    from optuna.distributions import BaseDistribution
    from optuna.trial import Trial

# A trial re-runs prepare-checkpoint and distributed-train on the study's staged data, so
# only what those read can vary between trials.
SEARCHABLE = ("model.", "train.")
SPEC_KEYS = frozenset({"low", "high", "log", "step", "choices"})
# A study's name is a file name under work/tune/ (its database and folder), never a path
STUDY_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
MAX_BOUND = 2.0**53  # a bound past this is no hyperparameter (and no longer an exact integer)
MAX_CHOICES = 1000
MAX_KEEP_DAYS = 1e6  # gc's cutoff is a time in milliseconds: 1e300 days overflowed it
SIGNIFICANT = 4  # digits of a sampled float a trial runs (Optuna samples all 17)


class Dimension(NamedTuple):
    """One searched key: a float or int range (optionally log or stepped), or choices (a
    record, not a config section: tune.space's values are its plain mappings)."""

    key: str
    kind: Literal["float", "int", "choice"]
    low: float = 0.0
    high: float = 0.0
    log: bool = False
    step: float | None = None
    choices: tuple[Any, ...] = ()

    def holds(self, value: Any) -> bool:
        """Whether `value` is a point of this dimension (a study record's values are checked
        so before they reach a trial or the params file)."""
        if self.kind == "choice":
            return any(type(value) is type(c) and value == c for c in self.choices)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.kind == "int" and not float(value).is_integer():
            return False
        return math.isfinite(value) and self.low <= value <= self.high

    def point(self, value: Any) -> Any:
        """The value a trial runs and `enn tune --apply` writes: Optuna samples a float with
        all its 17 digits (`0.002358412537954837`), which say nothing about a hyperparameter and
        made the params file unreadable. A sampled float is kept to `SIGNIFICANT` digits (more
        where the range is narrower than the value), a stepped one to its grid `low + k * step`
        in the decimals of step and low (`0.30000000000000004` -> `0.3`), inside [low, high];
        ints and choices as they are. The file then holds, in its shortest form, the very float
        the best trial trained with."""
        if self.kind != "float" or isinstance(value, bool) or not isinstance(value, (int, float)):
            return value
        if not math.isfinite(value):
            return value
        if self.step is not None:  # on the grid low + k * step, in the decimals both need
            decimals = max(_decimals(self.step), _decimals(self.low))
            k = round((float(value) - self.low) / self.step)
            rounded = round(self.low + k * self.step, decimals)
        elif value == 0:
            rounded = 0.0
        else:
            narrow = math.log10(abs(value) / (self.high - self.low))
            digits = SIGNIFICANT + max(0, math.ceil(narrow))
            rounded = float(f"{value:.{digits}g}")
        return min(max(rounded, self.low), self.high)

    def distribution(self) -> BaseDistribution:
        """This dimension as Optuna's distribution."""
        from optuna.distributions import CategoricalDistribution as Choice
        from optuna.distributions import FloatDistribution, IntDistribution

        if self.kind == "choice":
            return Choice(list(self.choices))
        if self.kind == "int":
            step = int(self.step) if self.step is not None else 1
            return IntDistribution(int(self.low), int(self.high), log=self.log, step=step)
        return FloatDistribution(self.low, self.high, log=self.log, step=self.step)

    def suggest(self, trial: Trial) -> Any:
        """The trial's value of this dimension (a queued point's own, else the sampler's)."""
        if self.kind == "choice":
            return trial.suggest_categorical(self.key, list(self.choices))
        if self.kind == "int":
            step = int(self.step) if self.step is not None else 1
            return trial.suggest_int(
                self.key, int(self.low), int(self.high), step=step, log=self.log
            )
        return trial.suggest_float(self.key, self.low, self.high, step=self.step, log=self.log)


def space_values(
    values: Mapping[str, Any], dims: Sequence[Dimension], where: str, then: str
) -> dict[str, Any]:
    """`values` when every key is one of `dims` and every value a point of it (a study record
    is data); else DataError (`where` names the record, `then` what was not done)."""
    space = {d.key: d for d in dims}
    extra = sorted(set(values) - set(space))
    if extra:
        raise DataError(
            f"{where} holds {extra[0]}, which is not a key of tune.space ({', '.join(space)}); "
            f"{then}"
        )
    for key, value in values.items():
        if not space[key].holds(value):
            raise DataError(f"{where} holds {key}={value!r}, outside tune.space.{key}; {then}")
    return dict(values)


def _decimals(x: float) -> int:
    """The decimals `x` is written with (0.25 -> 2, 10 -> 0)."""
    return max(0, -int(Decimal(repr(float(x))).normalize().as_tuple().exponent))


def _number(key: str, spec: Mapping[str, Any], name: str) -> float:
    value = spec.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(
            f"tune.space.{key}.{name} must be a number, got {value!r}; "
            "write e.g. {low: 0.001, high: 0.1, log: true}"
        )
    if not (math.isfinite(value) and abs(value) <= MAX_BOUND):
        raise ConfigError(
            f"tune.space.{key}.{name}={value} must be a finite number of at most "
            f"{MAX_BOUND:.0e} in size; write the range the key really takes"
        )
    return value


def dimension(key: str, spec: Any) -> Dimension:
    """The record for `tune.space.<key>`, or a one-line ConfigError naming it."""
    if not key.startswith(SEARCHABLE) or key.count(".") != 1:
        raise ConfigError(
            f"tune.space.{key}: only model.* and train.* keys can be searched (a trial re-runs "
            "prepare-checkpoint and distributed-train on the study's staged data)"
        )
    if not isinstance(spec, Mapping) or not spec or set(spec) - SPEC_KEYS:
        raise ConfigError(
            f"tune.space.{key}: expected {{low, high[, log, step]}} or {{choices: [...]}}, "
            f"got {dict(spec) if isinstance(spec, Mapping) else spec!r}"
        )
    if "choices" in spec:
        choices = spec["choices"]
        if set(spec) != {"choices"} or not isinstance(choices, (list, tuple)) or not choices:
            raise ConfigError(
                f"tune.space.{key}: choices must be a non-empty list, alone (no low/high)"
            )
        _check_choices(key, choices)
        return Dimension(key, "choice", choices=tuple(choices))
    low, high = _number(key, spec, "low"), _number(key, spec, "high")
    log, step = bool(spec.get("log", False)), spec.get("step")
    if not low < high:
        raise ConfigError(f"tune.space.{key}: low={low} must be below high={high}")
    if log and low <= 0:
        raise ConfigError(f"tune.space.{key}: a log scale needs low > 0 (got {low})")
    if log and step is not None:
        raise ConfigError(f"tune.space.{key}: step and log cannot be combined; drop one")
    if step is not None:
        step = _number(key, spec, "step")
        if step <= 0:
            raise ConfigError(f"tune.space.{key}: step must be > 0 (got {step})")
    ints = all(isinstance(v, int) for v in (low, high)) and (step is None or isinstance(step, int))
    kind: Literal["float", "int"] = "int" if ints else "float"
    return Dimension(key, kind, float(low), float(high), log, step)


def _check_choices(key: str, choices: list[Any] | tuple[Any, ...]) -> None:
    """Values a study stores and a trial gets as `--set key=value`: plain scalars."""
    if len(choices) > MAX_CHOICES:
        raise ConfigError(f"tune.space.{key}: {len(choices)} choices; at most {MAX_CHOICES}")
    for c in choices:
        if c is not None and not isinstance(c, (str, int, float, bool)):
            raise ConfigError(
                f"tune.space.{key}: choice {c!r} is a {type(c).__name__}; choices are numbers, "
                "strings, booleans or null"
            )
        if isinstance(c, float) and not math.isfinite(c):
            raise ConfigError(f"tune.space.{key}: choice {c} is not finite")


@frozen
class TuneConfig:
    study: str = ""
    """Name of the study (in its storage, by default `work/tune/<study>.db`, and its folder
    `work/tune/<study>/`): letters, digits, '.', '_' and '-', never a path; empty = the config
    file's name (`params`, `expressway`)."""

    space: Mapping[str, Mapping[str, Any]] = FrozenMap()
    """The search space: a `model.*` or `train.*` key -> `{low, high}` (numbers; `log: true` for a
    log scale, `step` for a grid; integers when low, high and step are) or `{choices: [...]}`."""

    n_trials: int = 20
    """Trials the study runs to an end (complete or pruned); a resumed study counts those it has."""

    metric: Literal["val_loss", "val_mae"] = "val_loss"
    """Objective, minimized: the best epoch's validation loss or MAE (`epoch/<metric>`, validation
    rows only; the test split is never read). The same per-epoch value drives the pruner."""

    sampler: Literal["tpe", "random"] = "tpe"
    """Optuna sampler: tpe (TPESampler) or random (RandomSampler)."""

    seed: int = 0
    """Seed of the sampler."""

    pruner: Literal["median", "none"] = "median"
    """Optuna pruner: median (MedianPruner: stop a trial whose epoch value is worse than the median
    of earlier trials at that epoch) or none."""

    n_startup_trials: int = 5
    """MedianPruner: trials that finish before any is pruned."""

    n_warmup_steps: int = 0
    """MedianPruner: epochs of a trial before it may be pruned."""

    parallel: int = 0
    """Trials run side by side; 0 = the GPUs (one each), or on CPU the cores // (world size x
    threads per worker, at least 1 thread each). Never more than that."""

    enqueue: tuple[Mapping[str, Any], ...] = ()
    """Trials to run first, each a mapping of some space keys to values (e.g. the current config);
    keys left out are sampled."""

    storage: str = ""
    """Where the study lives, as an SQLAlchemy URL; empty = the SQLite file
    `work/tune/<study>.db`. Several hosts join one study through one database server:
    `postgresql://USER@HOST:PORT/DB` (psycopg2). Never a password: libpq reads it from
    PGPASSWORD or ~/.pgpass. The user name is shown as `***` wherever the config is logged."""

    heartbeat_s: int = 10
    """Seconds between heartbeats: the study records one for each of its running trials in the
    storage (Optuna's trial heartbeat) and fails the study's stale trials this often."""

    stale_after_s: int = 120
    """A running trial whose last heartbeat is older than this (its host died, or lost the
    database) is failed by whichever host sees it first and its values queued again; at least
    2 x heartbeat_s."""

    def __post_init__(self) -> None:
        dims = {d.key: d for d in dimensions(self)}
        if self.study:
            check_study_name(self.study, "tune.study")
        if self.n_trials < 1:
            raise ConfigError(f"tune.n_trials={self.n_trials} must be >= 1")
        if self.parallel < 0:
            raise ConfigError(f"tune.parallel={self.parallel} must be >= 0 (0 = automatic)")
        if self.n_startup_trials < 0 or self.n_warmup_steps < 0:
            raise ConfigError("tune.n_startup_trials and tune.n_warmup_steps must be >= 0")
        if self.storage:
            check_storage_url(self.storage, "tune.storage")
        if self.heartbeat_s < 1 or self.stale_after_s < 2 * self.heartbeat_s:
            raise ConfigError(
                f"tune.heartbeat_s={self.heartbeat_s} must be >= 1 and tune.stale_after_s="
                f"{self.stale_after_s} at least twice that (a trial misses one beat before it "
                "is stale)"
            )
        for i, trial in enumerate(self.enqueue):
            unknown = sorted(set(trial) - set(self.space))
            if unknown:
                raise ConfigError(
                    f"tune.enqueue[{i}]: {unknown[0]} is not a tune.space key; add it to the "
                    "space or drop it"
                )
            outside = sorted(k for k, v in trial.items() if not dims[k].holds(v))
            if outside:
                raise ConfigError(
                    f"tune.enqueue[{i}]: {outside[0]}={trial[outside[0]]!r} is outside "
                    f"tune.space.{outside[0]}; enqueue points of the space"
                )


def check_study_name(name: str, where: str) -> None:
    """A study's name becomes `work/tune/<name>.db` and `work/tune/<name>/`: a plain name."""
    if not STUDY_NAME.match(name) or ".." in name:
        raise ConfigError(
            f"{where}={name!r} is not a study name: letters, digits, '.', '_' and '-' only (up "
            "to 100, no path); e.g. --set tune.study=fold0"
        )


def dimensions(tune: TuneConfig) -> tuple[Dimension, ...]:
    """The search space as records, checked."""
    return tuple(dimension(key, spec) for key, spec in tune.space.items())


def points(values: Mapping[str, Any], dims: tuple[Dimension, ...]) -> dict[str, Any]:
    """A trial's values as it runs them (`Dimension.point`; a key outside `dims` as it is)."""
    by_key = {d.key: d for d in dims}
    return {k: by_key[k].point(v) if k in by_key else v for k, v in values.items()}


@frozen
class GcConfig:
    keep_fingerprints: int = 2
    """Training checkpoint fingerprints (`work/checkpoints/<fp>/`) kept, newest first; older ones
    are removed unless an unfinished run may resume them (no COMPLETE marker and younger than
    `keep_days`)."""

    keep_days: float = 7.0
    """Age in days after which leftovers (unfinished fingerprints, finished trials' folders, run
    directories, failed runs' MLflow artifacts) may be removed."""

    trials: bool = True
    """Remove finished trials' folders (`work/tune/<study>/trial-N/`); the study's database
    stays."""

    failed_runs: bool = True
    """Remove the artifacts of FAILED and KILLED MLflow runs older than `keep_days` (the runs stay,
    marked `enn.gc`)."""

    def __post_init__(self) -> None:
        if self.keep_fingerprints < 0 or not 0 <= self.keep_days <= MAX_KEEP_DAYS:
            raise ConfigError(
                f"gc.keep_fingerprints must be >= 0 and gc.keep_days in [0, {MAX_KEEP_DAYS:g}]"
            )
