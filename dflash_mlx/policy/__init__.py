"""What decides each cycle's plan: the `Policy` / `Run` protocol (`plan.py`)."""
