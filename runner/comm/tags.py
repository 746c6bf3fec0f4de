"""The message tags of the job: every point-to-point message's tag, in one table.

A tag names what a message is, on the communicator it travels on. Tags of different users may share a
communicator (a server's probe sees the rule's tags and ``GROW``; the workers' communicator carries
``VALIDATED`` beside GoSGD's), so no two tags here are equal: ``tests/comm/test_tags.py`` checks it. A rule
with messages of its own adds its tags here, in a block of its own.
"""

from __future__ import annotations

# -- EASGD (runner/rules/easgd.py): worker <-> center server
EASGD_EXCHANGE = 11  # a worker's parameters to the server, the center back
EASGD_FETCH = 12  # a worker asks for the center (header only)
EASGD_DONE = 13  # a worker has finished training
EASGD_CHECKPOINT = 14  # a worker asks the server to save (header: the step)

# -- GoSGD (runner/rules/gosgd.py): worker -> worker
GOSGD_WEIGHT = 21  # the gossip weight sent before the parameters
GOSGD_PARAMS = 22  # the parameters of a gossip message

# -- ASGD/Downpour (runner/rules/asgd.py): worker <-> parameter servers
ASGD_PUSH = 31  # a worker's push header (the step, the staleness it computed from)
ASGD_PUSH_DATA = 32  # the pushed update, one server's shard of it
ASGD_FETCH = 33  # a worker asks for the parameters (header only)
ASGD_REPLY = 34  # a server's header, then its shard of the parameters
ASGD_DONE = 35  # a worker has finished training
ASGD_CHECKPOINT = 36  # a worker asks the servers to save (header: the step)

# -- the loop and the job (runner/rank/)
VALIDATED = 98  # a validation a worker took alone, to worker 0 to record (runner/rank/validator.py)
GROW = 99  # worker 0 tells each server that the job grows (runner/rank/resilience/elastic.py)
SPARE = 97  # the job's rank 0 calls each waiting spare: come, or leave (runner/comm/spares.py)

# -- the communication layer (runner/comm/)
WATCH = 32001  # never sent: Comm.check_peers probes for it only to ask ULFM whether a peer died
COUNTER_CALL = 32003  # a rank's call on a served counter, to its host's thread (counter.py)
COUNTER_RESULT = 32004  # the host's thread answers a call on a served counter (counter.py)


def table() -> dict[str, int]:
    """Every tag of this module, by name."""
    return {name: value for name, value in globals().items() if name.isupper() and isinstance(value, int)}
