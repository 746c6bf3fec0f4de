"""The sweep report: reads run folders, scores them, draws and writes ``report.md/.csv/.html``.

Reading is :mod:`.runs`, scoring :mod:`.table`, drawing :mod:`.plots`, writing :mod:`.write`;
``python -m runner.report DIR`` is its command."""
