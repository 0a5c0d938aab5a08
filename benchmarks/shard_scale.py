"""Issue 35: `shard --tp 8` at GLM-5's real dimensions, vocabulary included, against a baseline commit.

    python benchmarks/shard_scale.py [--dir DIR] [--baseline COMMIT] [--layers 1] [--experts 8]

Builds (one tensor at a time) a glm-dsa file with GLM-5's per-layer dims AND its real
vocabulary (154880 rows: a 951e6-weight embedding and lm_head), then runs ``ggufcheck shard
--tp 8`` on it twice in fresh processes, side by side: this tree, and ``--baseline`` (a git
commit checked out in a temporary worktree, default the one before the shard changes of
2026-12-07's sixth session). For each it prints wall time, the peak RSS of the main process
and the peak PSS of the whole process tree (the 8 rank processes share the main's pages
through fork; PSS counts each shared page once), sampled from /proc every 0.3 s, and which
layer kinds ran, were skipped, or failed.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASELINE = "1366aed"  # main before: every kind on 2052 tokens; vocab kinds over the budget not run


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _tree(pid: int) -> list[int]:
    todo, seen = [pid], []
    while todo:
        p = todo.pop()
        seen.append(p)
        todo += _children(p)
    return seen


def _kib(path: str, key: str) -> int:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def measured(cmd: list[str], env: dict[str, str], timeout: float) -> dict:
    """Run ``cmd``; wall seconds, peak main RSS, peak tree PSS (bytes), exit status, output."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        main = tree = 0
        while p.poll() is None:
            if time.perf_counter() - t0 > timeout:
                p.kill()
                break
            main = max(main, _kib(f"/proc/{p.pid}/status", "VmRSS:"))
            tree = max(tree, sum(_kib(f"/proc/{q}/smaps_rollup", "Pss:") for q in _tree(p.pid)))
            time.sleep(0.3)
        p.wait()
        log.seek(0)
        text = log.read()
    return {"rc": p.returncode, "wall": time.perf_counter() - t0, "main": main, "tree": tree, "out": text}


def kinds(text: str) -> str:
    """``PASS tp.mla, SKIP tp.lm_head, ...`` from the report's table."""
    found = re.findall(r"│ (PASS|FAIL|SKIP|ERROR|WARN)\s*│ sharding\.tp\.(\w+)", text)
    return ", ".join(f"{status} {kind}" for status, kind in found)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path(os.environ.get("GGUFCHECK_SCALE_DIR", "/tmp/ggufcheck-scale")))
    ap.add_argument("--baseline", default=BASELINE, help="a git commit to run side by side ('' for none)")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=1800)
    opts = ap.parse_args()
    opts.dir.mkdir(parents=True, exist_ok=True)
    from ggufcheck.synthetic.streaming import build_streaming_gguf, scale_dims

    path = opts.dir / f"glm5-{opts.layers}L-{opts.experts}E-v154880.gguf"
    if not path.exists():
        t0 = time.perf_counter()
        m = build_streaming_gguf(scale_dims("glm-5", n_layer=opts.layers, n_expert=opts.experts, n_vocab=154880),
                                 path, workers=os.cpu_count() or 2)
        print(f"built {path.name}: {m.n_weights / 1e9:.2f}e9 weights, {m.file_bytes / 1e9:.2f} GB in "
              f"{time.perf_counter() - t0:.0f} s")
    print(f"file: {path.name}, {path.stat().st_size / 1e9:.2f} GB; cores: {os.cpu_count()}; "
          f"load average {os.getloadavg()[0]:.1f}")
    trees = [("this tree", ROOT / "src")]
    worktree = None
    if opts.baseline:
        worktree = Path(tempfile.mkdtemp(prefix="ggufcheck-baseline-"))
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(worktree), opts.baseline],
                       check=True, capture_output=True)
        trees.append((f"baseline {opts.baseline}", worktree / "src"))
    rows = []
    try:
        for label, src in trees:
            env = dict(os.environ, PYTHONPATH=str(src), COLUMNS="150")
            r = measured([sys.executable, "-m", "ggufcheck", "shard", str(path), "--tp", "8"], env, opts.timeout)
            rows.append((label, r))
            print(f"{label:<20} rc {r['rc']}  {r['wall']:7.1f} s  main peak {r['main'] / 2**30:5.2f} GiB  "
                  f"tree peak (PSS) {r['tree'] / 2**30:5.2f} GiB\n    kinds: {kinds(r['out'])}", flush=True)
    finally:
        if worktree is not None:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)],
                           capture_output=True)
    if len(rows) == 2:
        (_, new), (_, old) = rows
        print(f"ratios this tree / baseline: wall {new['wall'] / old['wall']:.2f}, tree peak "
              f"{new['tree'] / max(old['tree'], 1):.2f}, main peak {new['main'] / max(old['main'], 1):.2f}")
    return 0 if all(r["rc"] == 0 for _, r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
