"""flows: the Prefect flows (the pipeline DAG), deployments, and the `enn` command.

Importing `tasks` first contains the environment before prefect is imported.
"""

import tasks  # noqa: F401  (contains the environment: tasks/env.py)
