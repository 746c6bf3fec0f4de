"""The ranks' side: one process per rank under mpirun (``python -m runner.rank.worker RUN_DIR``).

Read :mod:`runner.rank.worker` first (what one rank does, as a list of steps), then :mod:`runner.rank.loop`
(the one training loop every rule shares). Everything here may import torch and the communication layer.
"""
