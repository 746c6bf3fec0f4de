"""The ranks' side: one process per rank under mpirun (``python -m runner.rank.worker RUN_DIR``).

Read :mod:`runner.rank.worker` first (what one rank does, as a list of steps), then :mod:`runner.rank.loop`
(the one training loop every rule shares). The loop holds its components: the pace of its steps
(:mod:`runner.rank.pace`: static shards or dynamic assignment), the validator (:mod:`runner.rank.validator`),
the training state's three uses (:mod:`runner.rank.trainer_state`) and the workers' agreement
(:mod:`runner.rank.agreement`); its records are in :mod:`runner.rank.records`, and surviving lost workers
and growing the job in :mod:`runner.rank.resilience`, which only the loop and the worker import. Everything
here may import torch and the communication layer.
"""
