"""Feature kinds and the raw feature matrix (design.md, "Staged dataset").

- continuous: the value itself; the manifest gets mean/std from train rows (stats.py).
- categorical: the integer code into the manifest vocabulary (never z-scored). In training
  mode the vocabulary grows in order of first appearance; in features-only mode it is the
  training manifest's, and an unseen value is an error.
- cyclic (data.cyclic, data.cyclic_periods, data.cyclic_starts): a periodic key. Its phase is
  2*pi*(x - cyclic_offset)/cyclic_period. A cyclic key that is also categorical stores the
  code (value - first value, vocabulary = the whole period, so a month never seen in
  training still has a code and a phase); otherwise it stores the raw value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import numpy as np
import pandas as pd

from enn_core.config import DataConfig
from enn_core.data.sources import Chunk, Coded, Column
from enn_core.errors import DataError


def value_key(v: object) -> str:
    """One spelling per categorical value: 3, 3.0 and '3' differ only by type, not by key."""
    if isinstance(v, (float, np.floating)) and float(v).is_integer():
        return str(int(v))
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    return str(v).strip()


class Encoder:
    def __init__(
        self, names: list[str], cfg: DataConfig, frozen: list[dict[str, Any]] | None = None
    ) -> None:
        self.names = names
        self.fixed = frozen is not None
        if frozen is not None:
            want = [s["name"] for s in frozen]
            if want != names:
                raise DataError(
                    f"input features {names} differ from the training manifest's {want}; "
                    "give the new data the training features in the same order"
                )
            self.specs = [dict(s) for s in frozen]
        else:
            self.specs = [self._spec(n, cfg) for n in names]
        self.index = {
            s["name"]: {v: i for i, v in enumerate(s.get("vocab", []))} for s in self.specs
        }
        self.width = {s["name"]: 1 for s in self.specs}
        self.passthrough = all(s["kind"] == "continuous" for s in self.specs)

    @staticmethod
    def _spec(name: str, cfg: DataConfig) -> dict[str, Any]:
        spec: dict[str, Any] = {"name": name}
        if name in cfg.cyclic:
            spec["cyclic_period"] = int(cfg.cyclic_periods[cfg.cyclic.index(name)])
            start = int(cfg.cyclic_starts[cfg.cyclic.index(name)])
        if name in cfg.categorical:
            spec["kind"] = "categorical"
            spec["vocab"] = []
            if "cyclic_period" in spec:
                spec["cyclic_start"], spec["cyclic_offset"] = start, 0
        elif "cyclic_period" in spec:
            spec["kind"] = "cyclic"
            spec["cyclic_start"] = spec["cyclic_offset"] = start
        else:
            spec["kind"] = "continuous"
        return spec

    def encode(self, chunk: Chunk, file: str) -> np.ndarray:
        """[rows, F] raw feature values of a chunk (the input itself when all continuous)."""
        if chunk.x is not None and self.passthrough:
            return chunk.x
        n = chunk.rows
        out = np.empty((n, len(self.specs)), np.float64)
        cols = cast("Mapping[str, Column]", chunk.cols)  # a chunk without x has named columns
        for j, spec in enumerate(self.specs):
            col = chunk.x[:, j] if chunk.x is not None else cols[spec["name"]]
            if spec["kind"] == "continuous":  # never coded: tables code only keys and cycles
                out[:, j] = self._continuous(spec, cast(np.ndarray, col), chunk, file)
            elif "cyclic_period" in spec:
                out[:, j] = self._cyclic(spec, col, chunk, file)
            else:
                out[:, j] = self._codes(spec, col, chunk, file)
        return out

    def _continuous(
        self, spec: dict[str, Any], col: np.ndarray, chunk: Chunk, file: str
    ) -> np.ndarray:
        """A continuous column as numbers; text in it (a workbook's group key, say) is named."""
        if col.dtype.kind in "biuf":
            return col
        num = pd.to_numeric(pd.Series(col), errors="coerce").to_numpy(np.float64)
        bad = np.flatnonzero(np.isnan(num) & pd.notna(pd.Series(col)).to_numpy())
        if bad.size:
            i = int(bad[0])
            raise DataError(
                f"{file} {chunk.where(i)} column {spec['name']!r}: non-numeric value "
                f"{col[i]!r}; fix the value or declare the column in data.categorical"
            )
        return num

    def _missing(self, spec: dict[str, Any], missing: np.ndarray, chunk: Chunk, file: str) -> None:
        bad = np.flatnonzero(missing)
        if bad.size:
            raise DataError(
                f"{file} {chunk.where(int(bad[0]))} column {spec['name']!r}: empty or NaN value; "
                "fill it (or set data.nonfinite=drop for numeric features)"
            )

    def _cyclic(self, spec: dict[str, Any], col: Column, chunk: Chunk, file: str) -> np.ndarray:
        if not isinstance(col, Coded):  # each row its own level: checked as it stands
            col = Coded(np.where(pd.isna(col), -1, np.arange(len(col))), col)
        self._missing(spec, col.codes < 0, chunk, file)
        present = col.present()
        values = col.levels[present]
        if values.dtype.kind in "OUS" and len(values):
            self.width[spec["name"]] = max(
                self.width[spec["name"]], max(len(str(v).strip()) for v in values)
            )
        num = pd.to_numeric(pd.Series(values), errors="coerce").to_numpy(np.float64)
        start, period = spec["cyclic_start"], spec["cyclic_period"]
        bad = ~((num >= start) & (num < start + period))
        if bad.any():
            i = col.first_row_in(present[bad])
            raise DataError(
                f"{file} {chunk.where(i)} column {spec['name']!r}: "
                f"value {col.value(i)!r} is outside its period "
                f"[{start}, {start + period - 1}]; fix the value or data.cyclic_periods"
            )
        if spec["kind"] == "categorical":
            odd = num != np.round(num)
            if odd.any():
                i = col.first_row_in(present[odd])
                raise DataError(
                    f"{file} {chunk.where(i)} column {spec['name']!r}: "
                    f"{col.value(i)!r} is not a whole value"
                )
            num = num - start
        lut = np.zeros(len(col.levels), np.float64)
        lut[present] = num
        return lut[col.codes]

    def _codes(self, spec: dict[str, Any], col: Column, chunk: Chunk, file: str) -> np.ndarray:
        if not isinstance(col, Coded):
            if col.dtype.kind in "fc" or col.dtype == object:
                self._missing(spec, pd.isna(col), chunk, file)
            col = Coded.of(col)
        self._missing(spec, col.codes < 0, chunk, file)
        index = self.index[spec["name"]]
        present = col.present()
        keys = {int(u): value_key(col.levels[u]) for u in present}
        new = [u for u, key in keys.items() if key not in index]
        if new:
            first = col.first_rows()
            for u in sorted(new, key=lambda u: first[u]):  # in order of first appearance
                key = keys[u]
                if key in index:  # another spelling of a value added just before
                    continue
                if self.fixed:
                    raise DataError(
                        f"{file} {chunk.where(int(first[u]))} column {spec['name']!r}: "
                        f"value {key!r} is not in the training vocabulary {spec['vocab'][:12]}; "
                        "use values the model was trained on, or retrain"
                    )
                index[key] = len(index)
                spec["vocab"].append(key)
        lut = np.zeros(len(col.levels), np.float64)
        lut[present] = [index[keys[int(u)]] for u in present]
        return lut[col.codes]

    def final_specs(self) -> list[dict[str, Any]]:
        """Feature specs for the manifest (continuous stats are added by the caller)."""
        out = []
        for spec in self.specs:
            s = dict(spec)
            if s["kind"] == "categorical" and "cyclic_period" in s and not self.fixed:
                w, st = self.width[s["name"]], s["cyclic_start"]
                s["vocab"] = [f"{st + i:0{w}d}" for i in range(s["cyclic_period"])]
            out.append(s)
        return out
