"""The rank's records.

``metrics.jsonl`` and the trackers, the meter (timing and progress), the heartbeat, the rank's output
streams, and the run's summary."""
