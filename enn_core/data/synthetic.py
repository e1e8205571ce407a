"""A seeded synthetic spatio-temporal data set, shaped like the expressway workbook.

One row per (month, day type, direction, replicate day); the label is a [sections, hours]
grid of speeds. Speed = section base level
    - rush-hour dips whose depth depends on day type x direction x section (the interaction a
      per-cell mean cannot see),
    + a seasonal month effect modulated per section,
    + a daily offset shared by the whole row, + cell noise.
A model of the keys fits it to about the noise level; a per-cell mean is off by the group
effects (tests check both). `enn_core.stages.demo.stage_synthetic` stages a small copy for tests.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from enn_core.config import DataConfig, SyntheticConfig  # noqa: F401 - SyntheticConfig documents sizes
from enn_core.data.sources import Chunk, SourceInfo

BASE_SPEED = 85.0
DAYTYPE_NAMES = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")


def key_values(cfg: SyntheticConfig) -> dict[str, list[str]]:
    daytypes = (
        list(DAYTYPE_NAMES[: cfg.n_daytypes])
        if cfg.n_daytypes <= 7
        else [f"d{i}" for i in range(cfg.n_daytypes)]
    )
    directions = (
        ["up", "down"] if cfg.n_directions == 2 else [f"dir{i}" for i in range(cfg.n_directions)]
    )
    return {
        "month": [f"{m + 1:02d}" for m in range(cfg.n_months)],
        "daytype": daytypes,
        "direction": directions,
    }


class Effects:
    """The generator's fixed effects, drawn once from the seed."""

    def __init__(self, cfg: SyntheticConfig) -> None:
        rng = np.random.default_rng([cfg.seed, 0])
        S, H = cfg.n_sections, cfg.n_hours
        hours = np.arange(H) * (24.0 / H)
        self.section = BASE_SPEED + rng.normal(0, 8, S)  # [S]
        am = np.exp(-0.5 * ((hours - 8.0) / 1.5) ** 2)
        pm = np.exp(-0.5 * ((hours - 18.0) / 2.0) ** 2)
        self.peaks = np.stack([am, pm])  # [2, H]
        # busy-ness per day type (weekend light), rush weights per direction x peak
        self.daytype = rng.uniform(0.2, 1.0, cfg.n_daytypes)
        self.rush = rng.uniform(0.2, 1.0, (cfg.n_directions, 2)) * 36.0  # [D, 2]
        self.congestion = rng.uniform(0.2, 1.0, (cfg.n_directions, S))  # [D, S]
        months = np.arange(cfg.n_months)
        self.season = 8.0 * np.sin(2 * np.pi * months / max(cfg.n_months, 1)) + rng.normal(
            0, 1.0, cfg.n_months
        )
        self.season_section = rng.uniform(0.5, 1.5, S)

    def mean(self, m: int, d: int, r: int) -> np.ndarray:
        """Expected [S, H] grid of (month m, day type d, direction r) without daily effects."""
        dip = self.daytype[d] * self.congestion[r][:, None] * (self.rush[r] @ self.peaks)[None, :]
        return self.section[:, None] - dip + (self.season[m] * self.season_section)[:, None]


class SyntheticSource:
    kind = "synthetic"

    def __init__(self, cfg: DataConfig) -> None:
        self.cfg, self.syn = cfg, cfg.synthetic
        self.effects = Effects(self.syn)
        self.values = key_values(self.syn)
        s = self.syn
        self.groups = [
            (m, d, r)
            for m in range(s.n_months)
            for d in range(s.n_daytypes)
            for r in range(s.n_directions)
        ]
        self.info = SourceInfo(
            kind="synthetic",
            path=None,
            feature_names=["month", "daytype", "direction"],
            label_shape=None if cfg.features_only else (s.n_sections, s.n_hours),
            label_axis_values={
                "section": [f"s{i:02d}" for i in range(s.n_sections)],
                "hour": [f"{h:02d}" for h in range(s.n_hours)],
            },
            row_keys=["month", "daytype", "direction"],
            n_rows=len(self.groups) * s.n_replicates,
        )

    def _rows(self, g: int) -> tuple[list[tuple[str, str, str]], np.ndarray]:
        """The replicate rows of group g: keys and [R, S, H] labels (seeded per group)."""
        m, d, r = self.groups[g]
        s = self.syn
        rng = np.random.default_rng([s.seed, 1, g])
        mean = self.effects.mean(m, d, r)
        daily = rng.normal(0, s.daily, (s.n_replicates, 1, 1))
        noise = rng.normal(0, s.noise, (s.n_replicates, s.n_sections, s.n_hours))
        keys = (self.values["month"][m], self.values["daytype"][d], self.values["direction"][r])
        return [keys] * s.n_replicates, mean[None] + daily + noise

    def chunks(self) -> Iterator[Chunk]:
        per = max(1, self.cfg.chunk_rows // self.syn.n_replicates)
        start = 0
        for g0 in range(0, len(self.groups), per):
            keys: list[tuple[str, str, str]] = []
            ys: list[np.ndarray] = []
            for g in range(g0, min(g0 + per, len(self.groups))):
                k, yg = self._rows(g)
                keys += k
                ys.append(yg)
            cols = {
                name: np.array([k[i] for k in keys], dtype=object)
                for i, name in enumerate(self.info.feature_names)
            }
            y = None if self.cfg.features_only else np.concatenate(ys)

            def where(i: int, s: int = start) -> str:
                return f"row {s + i}"

            yield Chunk(start=start, cols=cols, y=y, keys=dict(cols), where=where)
            start += len(keys)

    def close(self) -> None:
        pass
