"""flows: the Prefect flows (the pipeline DAG), deployments, and the `enn` command.

Importing it has no side effects: `enn` (cli.py) contains the environment (tasks/env.py)
before it imports prefect or mlflow.
"""
