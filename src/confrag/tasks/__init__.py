"""Tasks that `train.py` runs, selected by `task_name`."""
