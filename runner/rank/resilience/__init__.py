"""Going on when workers die and growing the job.

Recovery (:mod:`.recovery`), the loop's side of it (the survivor protocol, :mod:`.survivor`), and growth
(:mod:`.elastic`, :mod:`.growth`). Only the loop and the worker import this wing
(tests/rank/test_rank_wings.py)."""
