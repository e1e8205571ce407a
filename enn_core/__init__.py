"""enn_core: the ENN runtime (pure PyTorch/numpy). Knows nothing of Prefect, MLflow or DVC.

Imports point down: config, errors, paths, events at the bottom; data; model; runtime;
then the stage modules (train, validate, predict, collapse, export) at the top.
"""

__version__ = "0.1.0"
