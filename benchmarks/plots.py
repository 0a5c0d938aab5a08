"""The report's plots: hand-written SVG (report/html.py) against a plotting library (matplotlib).

Issue 38 item 5 asked whether a well-kept plotting library would serve the HTML report better.
This draws the charts a diagnosis draws (per-layer error with its limit; per position: KL with
its limit, argmax agreement, entropies; four prompts of 96 tokens, 30 layers) both ways, and
prints side by side: the page's size, the time to draw, the time to import, and headless
Chromium's time to load and lay out each page (the rendering check the report's tests run).

Run: python benchmarks/plots.py [--matplotlib-path DIR]   (matplotlib: pip install matplotlib,
or --matplotlib-path a folder it was installed into with pip install --target)
"""

from __future__ import annotations

import argparse
import io
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def series(seed: int = 0, prompts: int = 4, positions: int = 96, layers: int = 30):
    import random

    rng = random.Random(seed)
    per_layer = [{"layer": i, "error": 1e-6 * (1.3 ** i) * (1 + rng.random()), "baseline": 1e-6 * (1.2 ** i),
                  "limit": 3e-6 * (1.2 ** i) + 1e-5} for i in range(layers)]
    runs = []
    for p in range(prompts):
        kl = [None] + [abs(rng.gauss(0, 1e-3)) + 1e-5 for _ in range(positions - 1)]
        runs.append({"prompt": f"prompt {p}", "kl": kl, "kl_limit": 5e-3,
                     "argmax_agree": [None] + [1.0 if rng.random() > 0.02 else 0.0 for _ in range(positions - 1)],
                     "entropy": [2 + math.sin(i / 7) for i in range(positions)],
                     "ref_entropy": [2 + math.sin(i / 7) + 0.01 for i in range(positions)],
                     "tokens": [f"t{i}" for i in range(positions)]})
    return per_layer, runs


def hand_written(per_layer, runs) -> list[str]:
    from ggufcheck.report.html import line_chart

    out = [line_chart("per-layer error", [("engine error", [r["error"] for r in per_layer]),
                                          ("baseline", [r["baseline"] for r in per_layer]),
                                          ("limit", [r["limit"] for r in per_layer])],
                      log_y=True, x_label="layer", y_label="relative error")]
    for run in runs:
        out.append(line_chart("KL per position", [("KL", run["kl"]), ("limit", [run["kl_limit"]] * len(run["kl"]))],
                              log_y=True, x_label="position: token", y_label="KL (nats)", x_ticks=run["tokens"]))
        out.append(line_chart("argmax agreement", [("agree", run["argmax_agree"])], y_range=(0.0, 1.0),
                              x_label="position: token", y_label="argmax agrees", x_ticks=run["tokens"]))
        out.append(line_chart("entropy", [("engine", run["entropy"]), ("reference", run["ref_entropy"])],
                              x_label="position: token", y_label="entropy (nats)", x_ticks=run["tokens"]))
    return out


def with_matplotlib(per_layer, runs) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def svg(fig) -> str:
        buf = io.StringIO()
        fig.savefig(buf, format="svg")
        plt.close(fig)
        return buf.getvalue()

    def nan(values):
        return [float("nan") if v is None else v for v in values]

    out = []
    fig, ax = plt.subplots(figsize=(8.8, 2.6))
    for name in ("error", "baseline", "limit"):
        ax.plot([r[name] for r in per_layer], label=name)
    ax.set_yscale("log"), ax.set_xlabel("layer"), ax.set_ylabel("relative error"), ax.legend(loc="center left",
                                                                                               bbox_to_anchor=(1, 0.5))
    out.append(svg(fig))
    for run in runs:
        for ys, label, log in (((run["kl"], [run["kl_limit"]] * len(run["kl"])), "KL (nats)", True),
                               ((run["argmax_agree"],), "argmax agrees", False),
                               ((run["entropy"], run["ref_entropy"]), "entropy (nats)", False)):
            fig, ax = plt.subplots(figsize=(8.8, 2.6))
            for y in ys:
                ax.plot(nan(y))
            if log:
                ax.set_yscale("log")
            ax.set_xlabel("position: token"), ax.set_ylabel(label)
            out.append(svg(fig))
    return out


def page(svgs: list[str]) -> str:
    return "<!doctype html><html><body>" + "".join(f"<figure>{s}</figure>" for s in svgs) + "</body></html>"


def chromium_seconds(path: Path, runs: int = 3) -> float | None:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        return None
    best = math.inf
    with tempfile.TemporaryDirectory() as profile:
        for _ in range(runs):
            t = time.perf_counter()
            done = subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                   f"--user-data-dir={profile}", "--dump-dom", path.as_uri()],
                                  capture_output=True, timeout=120)
            if done.returncode == 0:
                best = min(best, time.perf_counter() - t)
    return None if best == math.inf else best


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--matplotlib-path", help="a folder matplotlib was installed into (pip install --target)")
    args = ap.parse_args()
    if args.matplotlib_path:
        sys.path.append(args.matplotlib_path)  # after the environment's own packages (numpy stays ours)
    per_layer, runs = series()
    t0 = time.perf_counter()
    import ggufcheck.report.html  # noqa: F401
    t_import_hand = time.perf_counter() - t0
    t0 = time.perf_counter()
    hand = hand_written(per_layer, runs)
    t_hand = time.perf_counter() - t0
    t0 = time.perf_counter()
    try:
        import matplotlib.pyplot  # noqa: F401
    except ImportError:
        print("matplotlib is not installed: pip install matplotlib, or --matplotlib-path DIR")
        return 1
    t_import_mpl = time.perf_counter() - t0
    t0 = time.perf_counter()
    mpl = with_matplotlib(per_layer, runs)
    t_mpl = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for name, svgs in (("hand-written", hand), ("matplotlib", mpl)):
            paths[name] = Path(tmp) / f"{name}.html"
            paths[name].write_text(page(svgs))
        sizes = {n: p.stat().st_size for n, p in paths.items()}
        chrome = {n: chromium_seconds(p) for n, p in paths.items()}
    import matplotlib

    print(f"{len(hand)} charts (per-layer error; per prompt: KL, argmax, entropy; {len(runs)} prompts x 96 positions)")
    print(f"matplotlib {matplotlib.__version__}")
    print(f"{'':22s}{'hand-written SVG':>18s}{'matplotlib SVG':>18s}{'ratio':>8s}")
    print(f"{'page size (kB)':22s}{sizes['hand-written'] / 1e3:18.1f}{sizes['matplotlib'] / 1e3:18.1f}"
          f"{sizes['matplotlib'] / sizes['hand-written']:8.1f}")
    print(f"{'draw (s)':22s}{t_hand:18.3f}{t_mpl:18.3f}{t_mpl / max(t_hand, 1e-9):8.1f}")
    print(f"{'import (s)':22s}{t_import_hand:18.3f}{t_import_mpl:18.3f}")
    if all(chrome.values()):
        print(f"{'chromium load (s)':22s}{chrome['hand-written']:18.2f}{chrome['matplotlib']:18.2f}"
              f"{chrome['matplotlib'] / chrome['hand-written']:8.1f}")
    else:
        print("chromium: not installed or failed; load time not measured")
    return 0


if __name__ == "__main__":
    sys.exit(main())
