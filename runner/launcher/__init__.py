"""The launcher's side: the one process that composes, checks, starts and supervises a job (or a sweep).

Entry point: :mod:`runner.launcher.cli` (``python -m runner``, ``mpitrain``); one run is
:func:`runner.launcher.launch.launch`. Nothing here imports torch, MPI or the ranks' side.
"""
