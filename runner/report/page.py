"""report.html: the report's tables and plots in one static page."""

from __future__ import annotations

import html
from pathlib import Path

from runner.report import network, verdict
from runner.report.table import Report, explanation, headlines, table


def _html_table(header: list[str], cells: list[list[str]], classes: list[str], text_columns: int) -> str:
    """An HTML table, a row's class each (``bad``: red); its first ``text_columns`` aligned left."""
    e = html.escape
    rows = ["<table>", "<tr>" + "".join(f"<th>{e(h)}</th>" for h in header) + "</tr>"]
    for row, kind in zip(cells, classes, strict=True):
        tds = "".join(f"<td{'' if i < text_columns else ' class=n'}>{e(c)}</td>" for i, c in enumerate(row))
        rows.append(f"<tr class='{kind}'>{tds}</tr>")
    return "\n".join([*rows, "</table>"])


STYLE = """body{font-family:sans-serif;margin:2em;max-width:1400px}table{border-collapse:collapse}
td,th{border:1px solid #ccc;padding:4px 8px}td.n{text-align:right}th{background:#eee}
tr.bad td{color:#a00}p.warn{color:#a60}img{max-width:100%;border:1px solid #ddd;margin:0.5em 0}"""


def page(report: Report, plots: list[Path]) -> str:
    """report.html: the table, the runs that did not end ok and the plots (relative paths); static."""
    e = html.escape
    header, cells = table(report)
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>Report: {e(report.title)}</title>"]
    parts.append(f"<style>{STYLE}</style></head><body><h1>Report: {e(report.title)}</h1>")
    (bold, numbers), *more = headlines(report)
    parts.append(f"<p><b>{e(bold)}</b> {e(numbers)}</p>")
    parts += [f"<p>{e(b)} {e(n)}</p>" for b, n in more]
    parts += [f"<p>{e(text)}</p>" for text in verdict.paragraphs(report.standing)]
    if (cross := network.crossover(report)) is not None:
        parts.append(f"<h2>{e(network.heading(cross))}</h2>")
        parts.append("<ul>" + "".join(f"<li>{e(t)}</li>" for t in network.section(cross)) + "</ul>")
        parts += [f"<p class=warn><b>{e(report.load_note)}</b></p>"] if report.load_note else []
        parts.append(f"<p>{e(network.explanation(cross))}</p>")
        header_cross, cells_cross = network.grid(cross)
        parts.append(_html_table(header_cross, cells_cross, ["ok"] * len(cells_cross), 1))
    if report.repeated:
        parts.append("<h2>Points (mean over seeds)</h2>")
        kinds = ["ok" if p.ok else "bad" for p in report.points]
        parts.append(_html_table(*verdict.points_table(report.standing), kinds, 1))
    if report.repeated or cross is not None:
        parts.append("<h2>Runs</h2>")
    parts.append(f"<p>{e(explanation(report))}</p>")
    if report.load_note:
        parts.append(f"<p class=warn><b>{e(report.load_note)}</b></p>")
    parts.append(_html_table(header, cells, ["ok" if run.ok else "bad" for run in report.runs], 2))
    if report.failed:
        parts.append("<h2>Runs that did not end ok</h2><ul>")
        for r in report.failed:
            parts.append(f"<li><b>{e(r.name)}</b> ({e(r.status)}, {e(str(r.dir))}): {e(r.cause or '')}</li>")
        parts.append("</ul>")
    if plots:
        parts.append("<h2>Plots</h2>")
        parts += [f"<p><img src='{e(p.name)}' alt='{e(p.stem)}'></p>" for p in plots]
    parts.append("</body></html>\n")
    return "\n".join(parts)
