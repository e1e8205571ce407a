"""collapse-check: find prediction collapse and its cause, and never hide it.

- measures.py: spread, flat outputs, broadcast, correlation, the criteria, the affine fit;
- candidates.py: raw, calibrated, fp32 and per-sample paths side by side, the cause, the choice;
- report.py: the report as records (`report.json` at the file boundary);
- stage.py: the stage (`run`), its metrics and its candidates table.

The prediction path itself (`PredictionPath`, the calibration files) is enn_core/inference.py.
"""
