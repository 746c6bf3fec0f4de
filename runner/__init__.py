"""mpitrain: a declarative experiment runner for distributed data-parallel training over MPI.

The folders are the sides of a job, by the process their code runs in:

=====================  ===========================================================================
``launcher/``          the one launching process (``python -m runner``, ``mpitrain``): composes the
                       config with Hydra, checks it, writes the run folder, starts ``mpirun``,
                       supervises the job and names how it ended. Imports no torch, no MPI.
``rank/``              one process per rank under mpirun (``python -m runner.rank.worker RUN_DIR``):
                       placement, the model, data and rule, the training loop, checkpoints, records,
                       fault tolerance; and ``eval=RUN_DIR`` (``runner.rank.evaluate``, no MPI).
``comm/``              the communication layer the ranks and rules talk through (``comm/binding.py``
                       is the only importer of mpi4py); a transport is a route (``comm/routes/``).
``report/``            the sweep report (``python -m runner.report DIR``; the launcher after a sweep).
``schema/``            the typed config both sides read (dataclasses with defaults and checks).
``rules/ optim/ schedule/ tasks/ hardware/``
                       the config groups: each option's schema, and the object it builds (on the
                       ranks; hardware's in the launcher).
``models/ data/ conf/`` the model zoo, data sets and Hydra config tree (the repository's top folders).
=====================  ===========================================================================

Shared by every side: ``run_folder.py`` (the run folder's files, the launcher's environment for the ranks,
the exit statuses, ``summary.json``), ``results.py`` (final and best metrics) and ``lazy.py``.
The launcher, schema and hardware never import ``rank/`` or ``comm/`` (``tests/test_layout.py``).
"""
