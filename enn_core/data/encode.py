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

from typing import Any, cast

import numpy as np
import pandas as pd

from enn_core.config import DataConfig
from enn_core.data.sources import Chunk
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
        cols = cast("dict[str, np.ndarray]", chunk.cols)  # a chunk without x has named columns
        for j, spec in enumerate(self.specs):
            col = chunk.x[:, j] if chunk.x is not None else cols[spec["name"]]
            if spec["kind"] == "continuous":
                out[:, j] = self._continuous(spec, col, chunk, file)
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

    def _missing(self, spec: dict[str, Any], col: np.ndarray, chunk: Chunk, file: str) -> None:
        bad = np.flatnonzero(pd.isna(col))
        if bad.size:
            raise DataError(
                f"{file} {chunk.where(int(bad[0]))} column {spec['name']!r}: empty or NaN value; "
                "fill it (or set data.nonfinite=drop for numeric features)"
            )

    def _cyclic(self, spec: dict[str, Any], col: np.ndarray, chunk: Chunk, file: str) -> np.ndarray:
        self._missing(spec, col, chunk, file)
        if col.dtype.kind in "OUS":
            self.width[spec["name"]] = max(
                self.width[spec["name"]], max(len(str(v).strip()) for v in col)
            )
        num = pd.to_numeric(pd.Series(col), errors="coerce").to_numpy(np.float64)
        start, period = spec["cyclic_start"], spec["cyclic_period"]
        bad = np.flatnonzero(~((num >= start) & (num < start + period)))
        if bad.size:
            i = int(bad[0])
            raise DataError(
                f"{file} {chunk.where(i)} column {spec['name']!r}: "
                f"value {col[i]!r} is outside its period "
                f"[{start}, {start + period - 1}]; fix the value or data.cyclic_periods"
            )
        if spec["kind"] == "categorical":
            if not np.all(num == np.round(num)):
                i = int(np.flatnonzero(num != np.round(num))[0])
                raise DataError(
                    f"{file} {chunk.where(i)} column {spec['name']!r}: "
                    f"{col[i]!r} is not a whole value"
                )
            return num - start
        return num

    def _codes(self, spec: dict[str, Any], col: np.ndarray, chunk: Chunk, file: str) -> np.ndarray:
        if col.dtype.kind in "fc" or col.dtype == object:
            self._missing(spec, col, chunk, file)
        uniq, first, inv = np.unique(col, return_index=True, return_inverse=True)
        index = self.index[spec["name"]]
        codes = np.empty(len(uniq), np.float64)
        for u in np.argsort(first, kind="stable"):  # new values in order of first appearance
            key = value_key(uniq[u])
            if key not in index:
                if self.fixed:
                    i = int(first[u])
                    raise DataError(
                        f"{file} {chunk.where(i)} column {spec['name']!r}: "
                        f"value {key!r} is not in the training vocabulary {spec['vocab'][:12]}; "
                        "use values the model was trained on, or retrain"
                    )
                index[key] = len(index)
                spec["vocab"].append(key)
            codes[u] = index[key]
        return codes[inv.reshape(-1)]

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
