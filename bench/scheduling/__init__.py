"""LAPS-SD and its baselines measured: `python -m bench.scheduling paper|queues|load|estimate|real`
(see `__main__`)."""
