"""The one MLflow helper (the only place that imports mlflow).

- runs.py: parent run per pipeline run, child run per stage, events forwarded, killed runs swept;
- models.py: the exported model in the ONNX flavor, registered with its checkpoint,
  calibration and sidecar; `candidate` and `champion` aliases; lineage tags;
- plots.py: PNG plots (loss curves, predicted vs actual heatmaps, residual histogram);
- study.py: a tuning study's parent run and its trials' child runs (tasks/tuning calls it).
"""

from tasks.tracking.runs import Tracker, git_commit

__all__ = ["Tracker", "git_commit"]
