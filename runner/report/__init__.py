"""The sweep report: reads run folders (:mod:`.runs`), scores them (:mod:`.table`), draws (:mod:`.plots`)
and writes ``report.md/.csv/.html`` (:mod:`.write`); ``python -m runner.report DIR`` is its command."""
