"""tasks: the Prefect side of the stages (one task per stage spec, tasks/prefect_task.py), the
stage runner shared by the CLI and the flows (runner.py), DVC's staleness (dvc_state.py) and
the one MLflow helper (tracking/).

Importing it has no side effects; the entry points contain the environment (env.py) first.
"""
