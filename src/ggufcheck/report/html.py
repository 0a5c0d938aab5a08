"""HTML report: one self-contained page (inline CSS and SVG, no scripts, no network).

Plots are drawn as SVG here, from what the stages leave in their ``info``:
- layers stage: ``info["per_layer"] = [{"layer", "error", "baseline"}, ...]``: the
  per-layer error of the engine against its baseline (log scale);
- logits stage: ``info["per_position"] = {"kl": [...], "argmax_agree": [...],
  "entropy": [...], "ref_entropy": [...]}`` (or a list of those, one per prompt, each
  with a "prompt" name): per-position KL, argmax agreement and entropy.
"""

from __future__ import annotations

import html
import math
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

from ggufcheck import __version__
from ggufcheck.errors import UsageError
from ggufcheck.results import StageReport, Status

COLORS = {"PASS": "#1a7f37", "FAIL": "#cf222e", "SKIP": "#9a6700", "ERROR": "#8250df", "WARN": "#bc4c00"}
SERIES = ["#0969da", "#cf222e", "#1a7f37", "#8250df"]

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2rem;color:#1f2328;max-width:1100px}
h1{font-size:1.6rem} h2{font-size:1.2rem;margin-top:2rem;border-bottom:1px solid #d0d7de} h3{font-size:1rem}
details{margin:.3rem 0} summary{cursor:pointer;color:#656d76}
.verdict{padding:1rem;border-radius:6px;border:2px solid} .bad{border-color:#cf222e;background:#ffebe9}
.good{border-color:#1a7f37;background:#dafbe1} .unk{border-color:#8250df;background:#fbefff}
table{border-collapse:collapse;width:100%;font-size:.85rem} td,th{border:1px solid #d0d7de;padding:3px 6px;text-align:left;vertical-align:top}
.status{font-weight:bold} code{background:#f6f8fa;padding:0 3px} .muted{color:#656d76}
svg{background:#fff;border:1px solid #d0d7de;margin:.5rem 0}
"""


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def line_chart(
    title: str,
    series: Sequence[tuple[str, Sequence[float | None]]],
    *,
    log_y: bool = False,
    y_range: tuple[float, float] | None = None,
    x_label: str = "",
    y_label: str = "",
    x_ticks: Sequence[str] | None = None,
    width: int = 880,
    height: int = 260,
) -> str:
    """A small SVG line chart; None / non-finite points are gaps; a log axis says so in the title.
    Both axes are labelled; the legend sits right of the plot area, never over a line."""
    if log_y:
        title += " (log scale)"
    pad_l, pad_r, pad_t, pad_b = 72, 175, 30, 35
    points = [v for _, ys in series for v in ys if v is not None and math.isfinite(v) and (v > 0 or not log_y)]
    n = max((len(ys) for _, ys in series), default=0)
    if not points or n == 0:
        return f'<p class="muted">{_esc(title)}: no data</p>'

    def tr(v: float) -> float:
        return math.log10(v) if log_y else v

    lo, hi = min(map(tr, points)), max(map(tr, points))
    if y_range is not None:
        lo, hi = tr(y_range[0]), tr(y_range[1])
    if hi - lo < 1e-12:
        lo, hi = lo - 1, hi + 1
    w, h = width - pad_l - pad_r, height - pad_t - pad_b

    def xy(i: int, v: float) -> tuple[float, float]:
        x = pad_l + (w * i / max(1, n - 1))
        y = pad_t + h * (1 - (tr(v) - lo) / (hi - lo))
        return x, y

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
             f'aria-label="{_esc(title)}">',
             f'<text x="{pad_l}" y="18" font-size="13" font-weight="bold">{_esc(title)}</text>',
             f'<line x1="{pad_l}" y1="{pad_t + h}" x2="{pad_l + w}" y2="{pad_t + h}" stroke="#888"/>',
             f'<line x1="{pad_l}" y1="{pad_t}" x2="{pad_l}" y2="{pad_t + h}" stroke="#888"/>']
    for frac in (0.0, 0.5, 1.0):
        val = lo + (hi - lo) * frac
        label = f"{10 ** val:.2g}" if log_y else f"{val:.3g}"
        y = pad_t + h * (1 - frac)
        parts.append(f'<text x="{pad_l - 5}" y="{y + 4:.1f}" font-size="10" text-anchor="end">{label}</text>')
    parts.append(f'<text x="{pad_l + w / 2}" y="{height - 5}" font-size="11" text-anchor="middle">{_esc(x_label)}</text>')
    if y_label:
        mid = pad_t + h / 2
        parts.append(f'<text x="14" y="{mid:.1f}" font-size="11" text-anchor="middle" '
                     f'transform="rotate(-90 14 {mid:.1f})">{_esc(y_label)}</text>')
    if x_ticks:  # a few positions labelled with their token text
        step = max(1, math.ceil(n / 10))
        for i in range(0, min(n, len(x_ticks)), step):
            x = pad_l + (w * i / max(1, n - 1))
            text = x_ticks[i].replace("\n", "\\n")[:8]
            parts.append(f'<text x="{x:.1f}" y="{pad_t + h + 14}" font-size="9" text-anchor="middle">'
                         f"{i}:{_esc(text)}</text>")
    else:
        parts.append(f'<text x="{pad_l}" y="{pad_t + h + 14}" font-size="10">0</text>')
        parts.append(f'<text x="{pad_l + w}" y="{pad_t + h + 14}" font-size="10" text-anchor="end">{n - 1}</text>')
    for k, (name, ys) in enumerate(series):
        color = SERIES[k % len(SERIES)]
        segments, current = [], []
        for i, v in enumerate(ys):
            if v is None or not math.isfinite(v) or (log_y and v <= 0):
                if current:
                    segments.append(current)
                current = []
                continue
            current.append(xy(i, v))
        if current:
            segments.append(current)
        for seg in segments:
            if len(seg) == 1:
                x, y = seg[0]
                parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{color}"/>')
            else:
                pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in seg)
                parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.6" points="{pts}"/>')
        legend_x = pad_l + w + 12  # right of the plot area
        parts.append(f'<rect x="{legend_x}" y="{pad_t + 14 * k}" width="10" height="10" fill="{color}"/>'
                     f'<text x="{legend_x + 15}" y="{pad_t + 9 + 14 * k}" font-size="11">{_esc(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _plots(stages: Iterable[StageReport]) -> list[str]:
    out = []
    for stage in stages:
        per_layer = stage.info.get("per_layer")
        if per_layer:
            ratios = [(r["error"] / r["limit"], r["layer"]) for r in per_layer
                      if r.get("limit") and r.get("error") is not None]
            closest = f" (closest to its limit, as the check reports: layer {max(ratios)[1]})" if ratios else ""
            out.append(line_chart(
                f"{stage.stage}: per-layer error vs baseline{closest}",
                [("engine error", [r.get("error") for r in per_layer]),
                 ("baseline", [r.get("baseline") for r in per_layer])]
                + ([("limit", [r.get("limit") for r in per_layer])] if any("limit" in r for r in per_layer) else []),
                log_y=True, x_label="layer", y_label="relative error",
            ))
        per_position = stage.info.get("per_position")
        if per_position:
            runs = per_position if isinstance(per_position, list) else [per_position]
            for run in runs:
                name = f" ({run['prompt']})" if run.get("prompt") else ""
                if run.get("kl"):
                    series = [("KL", run["kl"])]
                    if run.get("kl_limit"):
                        series.append(("limit (99th percentile)", [run["kl_limit"]] * len(run["kl"])))
                    out.append(line_chart(f"KL(reference || engine) per position{name}", series, log_y=True,
                                          x_label="position: token", y_label="KL (nats)", x_ticks=run.get("tokens")))
                if run.get("argmax_agree"):
                    judged = run.get("argmax_check")
                    said = "" if not judged else (
                        f"; the check, over every prompt: {judged['agree']}/{judged['n']} agree, {judged['exact']} "
                        f"exactly" + (f" and {judged['agree'] - judged['exact']} flips the engine's own KL explains"
                                      if judged["agree"] > judged["exact"] else ""))
                    out.append(line_chart(f"argmax agreement per position, exact{name}{said}",
                                          [("agree (1) / differ (0)",
                                            [None if v is None else float(v) for v in run["argmax_agree"]])],
                                          y_range=(0.0, 1.0), x_label="position: token", y_label="argmax agrees",
                                          x_ticks=run.get("tokens")))
                if run.get("entropy"):
                    series = [("engine entropy", run["entropy"])]
                    if run.get("ref_entropy"):
                        series.append(("reference entropy", run["ref_entropy"]))
                    out.append(line_chart(f"entropy per position (nats){name}", series, x_label="position: token",
                                          y_label="entropy (nats)", x_ticks=run.get("tokens")))
    return out


def _ladder(stages: list[StageReport]) -> str:
    """The stage overview: what each stage eliminates and its pass / fail / skip / error counts."""
    rows = []
    for stage in stages:
        counts = [sum(r.status == st for r in stage.results) for st in (Status.PASS, Status.FAIL, Status.SKIP,
                                                                         Status.ERROR)]
        skip = next((r.message for r in stage.results if r.status == Status.SKIP), "") if counts[0] == 0 else ""
        rows.append(f'<tr><td>{_esc(stage.stage)}</td><td class="status" style="color:{COLORS[stage.status.value]}">'
                    f"{stage.status.value}</td><td>{_esc(stage.info.get('eliminates', ''))}"
                    + (f'<br><span class="muted">{_esc(skip)}</span>' if skip else "")
                    + f"</td><td>{'/'.join(str(c) for c in counts)}</td></tr>")
    return ("<h2>Stages, in dependency order</h2><table><tr><th>stage</th><th>status</th><th>eliminates</th>"
            "<th>pass/fail/skip/error</th></tr>" + "".join(rows) + "</table>")


def _rows(results, evidence: bool = False) -> str:
    rows = []
    for stage, r in results:
        where = " ".join(x for x in (r.tensor or "", f"layer {r.layer}" if r.layer is not None else "") if x)
        extra = ""
        if evidence and (r.worst or r.stats):
            from ggufcheck.report.diagnosis import plain

            parts = []
            if r.worst:
                parts.append(f"worst: {plain(r.worst)}")
            if r.stats:
                parts.append(", ".join(f"{k} {_short(v)}" for k, v in r.stats.items()
                                       if isinstance(v, (int, float, str, bool)) and not isinstance(v, bool)))
            extra = f'<br><span class="muted">{_esc("; ".join(p for p in parts if p))}</span>'
        rows.append(f'<tr><td class="status" style="color:{COLORS[r.status.value]}">{r.status.value}</td>'
                    f"<td>{_esc(stage)}</td><td>{_esc(r.check)}</td><td>{_esc(r.component)}</td><td>{_esc(where)}</td>"
                    f"<td>{_esc(r.message)}{extra}</td></tr>")
    return ("<table><tr><th>status</th><th>stage</th><th>check</th><th>component</th><th>where</th>"
            "<th>message</th></tr>" + "".join(rows) + "</table>")


def _short(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def render_html(title: str, stages: list[StageReport], verdict: Any | None = None,
                summary: dict[str, Any] | None = None) -> str:
    body = [f"<h1>{_esc(title)}</h1>",
            f'<p class="muted">ggufcheck {_esc(__version__)}</p>']
    if summary:  # what was tested, with which, when and where: first, before any plot
        rows = "".join(f"<tr><th>{_esc(k)}</th><td>{_esc(v)}</td></tr>" for k, v in summary.items()
                       if not isinstance(v, (dict, list)))
        body.append(f"<table>{rows}</table>")
    if verdict is not None:
        cls = "good" if verdict.healthy else ("unk" if verdict.component is None else "bad")
        head = "healthy" if verdict.healthy else (
            f"first failing component: <code>{_esc(verdict.component)}</code>"
            + (f" at layer {verdict.layer}" if verdict.layer is not None else "")
            if verdict.component else ("not verified" if getattr(verdict, "unverified", False) else "inconclusive"))
        body.append(f'<div class="verdict {cls}"><b>Verdict:</b> {head}<br>{_esc(verdict.message)}'
                    + (f"<br><b>Next:</b> {_esc(verdict.next_steps)}" if verdict.next_steps else "")
                    + "</div>")
    body.append(_ladder(stages))
    failing = [(stage.stage, r) for stage in stages for r in stage.results if r.failed]
    if failing:
        body.append("<h2>Failing checks, with their evidence</h2>" + _rows(failing, evidence=True))
    plots = _plots(stages)
    if plots:
        body.append("<h2>Plots</h2>" + "".join(plots))
    body.append("<h2>Details</h2>")
    for stage in stages:
        shown = [(stage.stage, r) for r in stage.results if r.status != Status.PASS]
        passing = [(stage.stage, r) for r in stage.results if r.status == Status.PASS]
        body.append(f'<h3>Stage: {_esc(stage.stage)} <span style="color:{COLORS[stage.status.value]}">'
                    f"{stage.status.value}</span></h3>")
        if shown:
            body.append(_rows(shown))
        if passing:  # collapsed, as the terminal does
            body.append(f"<details><summary>{len(passing)} passing check(s)</summary>{_rows(passing)}</details>")
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{_esc(title)}</title><style>{CSS}</style></head><body>"
            + "\n".join(body) + "</body></html>\n")


def write_html(path: str | os.PathLike, page: str) -> None:
    path = Path(path)
    try:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(page, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as err:
        raise UsageError(f"cannot write HTML report to {path}: {err.strerror or err}") from None


__all__ = ["render_html", "write_html", "line_chart", "Status"]
