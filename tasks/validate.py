"""validate as a Prefect task. The work itself is enn_core's (see tasks/registry.py); this module
only names the task, so the stage has one name everywhere."""

from tasks.prefect_task import stage_task

validate = stage_task("validate")
