"""tasks: one module per stage (a thin Prefect task over one enn_core function), the stage
runner shared by the CLI and the flows, and the one MLflow helper (tracking.py).

Importing this package first contains the environment (tasks/env.py), before prefect or
mlflow can be imported by any submodule.
"""

from tasks.env import contain

contain()
