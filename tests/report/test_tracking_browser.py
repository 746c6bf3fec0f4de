"""TensorBoard's HParams view as a user sees it: ``tensorboard --logdir`` served, the page opened in headless
Chromium, the table read from the page once its scripts have drawn it (docs/tracking.md, "Checking it in
a browser"). Skipped, with the reason, where no Chromium is installed (``apt-get install
chromium-headless-shell``) or the ``tensorboard`` command is missing."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.report.test_tracking import EVERY_RUN, sweep

BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")
#: The texts of the HParams table's header and body cells, through the page's shadow roots, each with its
#: place on the page (the grid appends the cells of a column ticked later, so their order is not the table's).
TABLE = r"""(() => { const out = {headers: [], cells: []};
  const place = (n) => { const r = n.getBoundingClientRect();
    return [n.textContent.trim(), Math.round(r.top), Math.round(r.left)]; };
  const walk = (n) => {
    if (n.shadowRoot) walk(n.shadowRoot);
    for (const c of (n.children || [])) walk(c);
    if (n.classList && n.classList.contains('table-header')) out.headers.push(place(n));
    if (n.classList && n.classList.contains('table-cell')) out.cells.push(place(n));
  };
  walk(document); return JSON.stringify(out); })()"""
#: Tick every hparam column left unticked in the query pane, as a user would click each: how many.
TICK_ALL = r"""(() => { let n = 0;
  const walk = (e) => {
    if (e.shadowRoot) walk(e.shadowRoot);
    for (const c of (e.children || [])) walk(c);
    if (e.classList && e.classList.contains('hparam-checkbox') && !e.checked) { e.click(); n++; }
  };
  walk(document); return n; })()"""

pytestmark = pytest.mark.slow


class Browser:
    """Headless Chromium driven through the DevTools protocol over a pipe (``--remote-debugging-pipe``:
    JSON messages ended by a NUL byte on file descriptors 3 and 4), so no WebSocket client is needed."""

    def __init__(self, binary: str):
        to_r, self._to = os.pipe()
        self._from, from_w = os.pipe()

        def descriptors() -> None:  # in the child: the pipe's ends as fds 3 (commands) and 4 (replies)
            a, b = os.dup(to_r), os.dup(from_w)
            os.dup2(a, 3)
            os.dup2(b, 4)

        argv = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe"]
        self.proc = subprocess.Popen(
            [*argv, "--window-size=1600,1000", "about:blank"],
            preexec_fn=descriptors,
            close_fds=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_r)
        os.close(from_w)
        self.ids, self.buffer = 0, b""

    def call(self, method: str, session: str | None = None, **params) -> dict:
        """Send one command, return its result (events in between are skipped)."""
        self.ids += 1
        message = {"id": self.ids, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self._to, json.dumps(message).encode() + b"\0")
        while True:
            while b"\0" not in self.buffer:
                chunk = os.read(self._from, 65536)
                if not chunk:
                    raise RuntimeError(f"Chromium closed the pipe (exit status {self.proc.poll()})")
                self.buffer += chunk
            raw, self.buffer = self.buffer.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self.ids:
                assert "error" not in reply, reply
                return reply["result"]

    def open(self, url: str) -> str:
        """A new tab at ``url``: its session id."""
        target = self.call("Target.createTarget", url=url)["targetId"]
        return self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]

    def evaluate(self, session: str, expression: str):
        return self.call("Runtime.evaluate", session, expression=expression, returnByValue=True)[
            "result"
        ].get("value")

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        os.close(self._to)
        os.close(self._from)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def laid_out(headers: list, cells: list) -> tuple[list[str], list[list[str]]]:
    """The table as the page lays it out: the header texts left to right, and the body's rows top to
    bottom (cells ``[text, top, left]`` grouped by their top), each as wide as the header; rows with no
    text, and the header's own row, are left out."""
    names = [text for text, _, _ in sorted(headers, key=lambda h: h[2])]
    lines: list[list] = []
    for cell in sorted(cells, key=lambda c: c[1]):  # a row's texts sit a few pixels apart, rows ~40 apart
        if not lines or cell[1] - lines[-1][0][1] > 20:
            lines.append([])
        lines[-1].append(cell)
    rows = [[text for text, _, _ in sorted(line, key=lambda c: c[2])] for line in lines]
    return names, [r for r in rows if len(r) == len(names) and any(r) and r != names]


def hparams_page(
    logdir: Path, timeout: float = 90, every_column: bool = False
) -> tuple[list[str], list[list[str]]]:
    """The HParams table's column headers and rows as the page first shows them (no click), from a real
    ``tensorboard --logdir LOGDIR`` (its default loader) in headless Chromium; ``every_column``: after
    ticking every hparam column in the query pane."""
    binary = next((b for b in BROWSERS if shutil.which(b)), None)
    if binary is None:
        pytest.skip(f"no headless Chromium ({', '.join(BROWSERS)}): apt-get install chromium-headless-shell")
    tensorboard = Path(sys.executable).with_name("tensorboard")
    if not tensorboard.exists():
        pytest.skip("the tensorboard command is not installed beside this Python")
    port = free_port()
    server = subprocess.Popen(
        [str(tensorboard), "--logdir", str(logdir), "--port", str(port), "--host", "127.0.0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    browser = None
    try:
        deadline = time.time() + timeout
        while True:  # the server answers
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.time() < deadline and server.poll() is None, "tensorboard did not start"
                time.sleep(0.5)
        browser = Browser(binary)
        session = browser.open(f"http://127.0.0.1:{port}/#hparams")
        before = None
        while True:  # the page's scripts have drawn the table's rows (the same twice, once ticked)
            table = json.loads(browser.evaluate(session, TABLE) or '{"headers": [], "cells": []}')
            headers, rows = laid_out(table["headers"], table["cells"])
            if rows and every_column and browser.evaluate(session, TICK_ALL):
                before = None  # columns ticked: read the table again once it is redrawn with them
            elif rows and (not every_column or table == before) or time.time() > deadline:
                return headers, rows
            before = table if rows else None
            time.sleep(1)
    finally:
        if browser is not None:
            browser.close()
        server.kill()
        server.wait()


def test_the_hparams_view_shows_final_accuracy_and_every_compared_key_without_a_click(tmp_path):
    """A 4-point EASGD sweep of alpha, and beside it a DiLoCo sweep of the learning rate on an MLP: the
    table TensorBoard's page draws, before any click, has ``Outcome/final_val_acc`` with each trial's
    value, trials named by what they are, and no blank in any shown column: a rule's own key reads ``n/a``
    on another rule's rows (DiLoCo has no alpha), and ticking every hparam column leaves none blank."""
    outputs = tmp_path / "outputs" / "multirun" / "2026-01-01"
    sweep(outputs / "10-00-00", ["rule=easgd"], [{"rule.alpha": a} for a in (0.1, 0.25, 0.5, 0.75)])
    headers, rows = hparams_page(outputs / "10-00-00")
    assert "Outcome/final_val_acc" in headers, headers
    names = sorted(row[0] for row in rows)
    assert names == [
        f"rule=easgd,rule.alpha={a} (2026-01-01/10-00-00/{n})" for n, a in enumerate((0.1, 0.25, 0.5, 0.75))
    ]
    final = headers.index("Outcome/final_val_acc")
    assert sorted(float(row[final]) for row in rows) == pytest.approx([0.5, 0.6, 0.7, 0.8])

    sweep(outputs / "11-00-00", ["rule=diloco", "model=mlp"], [{"optim.lr": 0.05}, {"optim.lr": 0.1}])
    headers, rows = hparams_page(tmp_path / "outputs")
    assert len(rows) == 6 and "Outcome/final_val_acc" in headers, (headers, rows)
    shown = [k for k in headers if k in EVERY_RUN or k.startswith("rule.")]
    assert {"rule", "model", "rule.alpha"} <= set(shown), headers
    for row in rows:
        blank = [k for k in shown if row[headers.index(k)] == ""]
        assert blank == [], (row, headers)
        if row[0].startswith("rule=diloco"):
            assert row[headers.index("rule.alpha")] == "n/a" and row[headers.index("model")] == "mlp"
    headers, rows = hparams_page(tmp_path / "outputs", every_column=True)
    assert len(rows) == 6 and {"rule.alpha", "rule.inner_steps", *EVERY_RUN} <= set(headers), headers
    for row in rows:
        shown = headers[2:]  # after the trial's name and its "Show Metrics" button
        assert [k for k in shown if row[headers.index(k)] == ""] == [], (row, headers)
