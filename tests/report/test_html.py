"""The HTML report is one self-contained page that a real browser renders offline."""

from __future__ import annotations

import re
import shutil
from dataclasses import replace
import subprocess

import pytest

from ggufcheck.diagnose.verdict import decide
from ggufcheck.report.html import line_chart, render_html
from ggufcheck.results import StageReport, failed, passed


def sample_stages():
    layers = StageReport("layers", info={"per_layer": [
        {"layer": i, "error": 1e-7 * (1 + i) if i < 3 else 0.5, "baseline": 1e-6} for i in range(6)]})
    layers.add(failed("layers.residual", "attention", "residual diverged 5e5x its baseline", layer=3))
    logits = StageReport("logits", info={"per_position": {
        "kl": [1e-4, 2e-4, 0.5, 0.6], "argmax_agree": [1, 1, 0, 0], "entropy": [2.0, 2.1, 10.8, 10.8],
        "ref_entropy": [2.0, 2.1, 1.5, 1.2]}})
    logits.add(passed("logits.kl", "output", "mean KL 1e-4"))
    return [layers, logits]


def test_page_is_self_contained():
    stages = sample_stages()
    page = render_html("diagnose tiny.gguf", stages, decide(stages))
    # no scripts, no external resources of any kind
    assert "<script" not in page.lower()
    refs = re.findall(r'(?:src|href)\s*=\s*"([^"]*)"', page)
    assert refs == []
    assert page.count("<svg") == 4  # per-layer error, KL, argmax agreement, entropy
    assert "first failing component" in page and "attention" in page and "layer 3" in page


def test_chart_handles_gaps_and_no_data():
    assert "no data" in line_chart("t", [("a", [None, float("nan")])], log_y=True)
    svg = line_chart("t", [("a", [1.0, None, 3.0, 4.0])])
    assert svg.count("<polyline") == 1 and svg.count("<circle") == 1


def test_the_legend_sits_beside_the_plot_and_both_axes_are_labelled():
    """Issue 38 item 5: legends covered the limit line; axes were unlabeled."""
    svg = line_chart("t", [("engine error", [1.0, 2.0, 3.0]), ("limit", [2.5, 2.5, 2.5])], log_y=True,
                     x_label="layer", y_label="relative error")
    axis_end = max(float(x) for x in re.findall(r'<line x1="[\d.]+" y1="[\d.]+" x2="([\d.]+)"', svg))
    legend_x = [float(x) for x in re.findall(r'<rect x="([\d.]+)"', svg)]
    assert len(legend_x) == 2 and min(legend_x) > axis_end  # right of the plot area, over no line
    assert ">layer</text>" in svg and "rotate(-90" in svg and ">relative error</text>" in svg


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(_chromium() is None, reason="chromium is not installed (apt-get install chromium)")
def test_renders_in_headless_chromium(tmp_path):
    stages = sample_stages()
    page_path = tmp_path / "report.html"
    page_path.write_text(render_html("diagnose tiny.gguf", stages, decide(stages)))
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([_chromium(), *flags, "--dump-dom", page_path.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert "first failing component" in dom.stdout and dom.stdout.count("<svg") == 4
    shot = tmp_path / "shot.png"
    run = subprocess.run([_chromium(), *flags, f"--screenshot={shot}", "--window-size=1200,2400",
                          page_path.as_uri()], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert shot.stat().st_size > 10_000  # a real rendering, not a blank page


def test_the_page_leads_with_the_answer_and_collapses_passing_rows():
    """Verdict, then the stage ladder, then the failing checks with their evidence, then plots,
    then details where passing rows are collapsed."""
    stages = sample_stages()
    stages[0].info["eliminates"] = "each layer's computation"
    stages[0].results[0] = replace(stages[0].results[0], worst={"sequence": 1, "position": 7})
    page = render_html("diagnose tiny.gguf", stages, decide(stages))
    order = [page.index(k) for k in ("Verdict:", "Stages, in dependency order", "Failing checks, with their evidence",
                                     "<h2>Plots", "<h2>Details")]
    assert order == sorted(order)
    assert "worst: sequence 1, position 7" in page and "each layer&#x27;s computation" in page
    assert "<details><summary>1 passing check(s)</summary>" in page


def test_kl_plots_show_the_limit_and_log_axes_say_so():
    stages = sample_stages()
    stages[1].info["per_position"]["kl_limit"] = 1e-3
    page = render_html("diagnose tiny.gguf", stages, decide(stages))
    assert "limit (99th percentile)" in page and "(log scale)" in page


def test_position_axes_carry_token_text():
    stages = sample_stages()
    stages[1].info["per_position"]["tokens"] = ["The", " capital", " of", "<b>"]
    page = render_html("diagnose tiny.gguf", stages, decide(stages))
    assert "1: capital" in page and "3:&lt;b&gt;" in page and "position: token" in page


def test_the_argmax_plot_says_what_its_check_counted():
    """issue 38 item 5: the plot draws exact agreement per row; the check also counts the flips
    the engine's own KL explains. The plot's title says both, so the two cannot contradict."""
    logits = StageReport("logits", info={"per_position": {
        "argmax_agree": [1, 0, 1, 1], "argmax_check": {"agree": 479, "exact": 468, "n": 480}}})
    page = render_html("diagnose tiny.gguf", [logits])
    assert "argmax agreement per position, exact; the check, over every prompt: 479/480 agree, 468 exactly and 11 " \
           "flips" in page


def test_the_per_layer_plot_names_the_layer_its_check_names():
    """issue 38 item 5: the check names the layer closest to its limit (error / limit), which
    need not be the plot's highest error; the plot's title names the same layer."""
    layers = StageReport("layers", info={"per_layer": [
        {"layer": 0, "error": 1e-3, "baseline": 1e-4, "limit": 1e-2},   # highest error, 0.1 of its limit
        {"layer": 1, "error": 4e-4, "baseline": 1e-5, "limit": 5e-4}]})  # lower error, 0.8 of its limit
    page = render_html("diagnose tiny.gguf", [layers])
    assert "closest to its limit, as the check reports: layer 1" in page
