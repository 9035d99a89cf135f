"""`make overhead-compare`: the proxy's cost per request before and after, in one run.

    python -m bench.overhead_compare [--base COMMIT] [--sizes 2000,8000,32000] [--reps 20]
                                     [--rounds 4] [--out bench/results/issue23]

The commit `--base` is checked out in a temporary git worktree with this tree's
bench/overhead.py and bench/prompts.py copied in, so both builds are measured by the same
harness on the same requests; then `python -m bench.overhead` runs in each tree in turn,
`--rounds` times (before, after, before, after: the machine's noise falls on both), and the
median of the rounds' CPU medians is reported per stage, with the ratio of each round's pair
(its median and range: this machine's speed can move between rounds). A stage the base build
cannot time alone shows as "-".
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
STAGES = [("parse_ms", "parse (limits + API)"), ("prepare_ms", "prepare"),
          ("messages_ms", "of which messages"), ("render_prompt_ms", "of which render_prompt"),
          ("decide_ms", "decide"), ("send_ms", "send (the job to the worker)"),
          ("proxy_ms", "**proxy total**"),
          ("anthropic_ms", "the same through the Anthropic API (Claude Code)"),
          ("cold_prepare_ms", "cold prepare (new conversation)"),
          ("worker_read_ms", "the worker's read of the job (not the proxy's)")]


def run(tree: Path, sizes: str, reps: int, out: Path) -> dict[str, Any]:
    subprocess.run([sys.executable, "-m", "bench.overhead", "--sizes", sizes, "--reps",
                    str(reps), "--worker-sizes", "none", "--out", str(out)],
                   cwd=tree, check=True, stdout=subprocess.DEVNULL)
    res: dict[str, Any] = json.loads((out / "overhead.json").read_text())
    return res


def cell(rows: list[dict[str, Any]], key: str) -> str:
    values = [r[key] for r in rows if r.get(key) is not None]
    if not values:
        return "-"
    return f"{statistics.median(v[0] for v in values):.1f}"


def ratio(before: list[dict[str, Any]], after: list[dict[str, Any]], key: str) -> str:
    """after / before of each round (the two measured back to back), their median and range:
    on a machine whose speed moves between rounds, the pairs say more than the medians."""
    pairs = [a[key][0] / b[key][0] for b, a in zip(before, after, strict=True)
             if a.get(key) is not None and b.get(key) is not None and b[key][0] > 0]
    if not pairs:
        return "-"
    return f"{statistics.median(pairs):.2f}x ({min(pairs):.2f}-{max(pairs):.2f})"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.overhead_compare",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="783a131")
    p.add_argument("--sizes", default="2000,8000,32000")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "issue23"))
    a = p.parse_args(argv)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout.strip()
    results: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="prefixgate-base-") as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), a.base], cwd=ROOT,
                       check=True, capture_output=True)
        try:
            for name in ("overhead.py", "prompts.py"):
                shutil.copy(ROOT / "bench" / name, base / "bench" / name)
            for r in range(a.rounds):
                for label, tree in (("before", base), ("after", ROOT)):
                    print(f"round {r + 1}: {label} ...", file=sys.stderr)
                    res = run(tree, a.sizes, a.reps, Path(tmp) / f"{label}{r}")
                    results[label].append(res)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT,
                           check=False, capture_output=True)
    lines = markdown(results, a.base, head, a.reps, [int(s) for s in a.sizes.split(",")])
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead-compare.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "overhead-compare.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def markdown(results: dict[str, list[dict[str, Any]]], base: str, head: str, reps: int,
             sizes: list[int]) -> list[str]:
    rounds = len(results["after"])
    lines = [
        "# Proxy overhead per request, before and after", "",
        f"CPU ms per request, the median over {rounds} rounds (each the median of {reps} "
        f"requests); before = {base}, after = {head}, measured alternately in one run by the "
        "same harness (bench/overhead.py) on the same requests: a synthetic agent session "
        "grown to the size, the history re-sent unchanged plus one new 300-token user turn. "
        "Cold = a new conversation of that size in a fresh process state. After / before: "
        "each round's pair (measured back to back), the median and the range.", "",
        "| prompt tokens | stage | before | after | after / before |",
        "|---:|---|---:|---:|---:|"]
    for k, size in enumerate(sizes):
        before = [res["sizes"][k] for res in results["before"]]
        after = [res["sizes"][k] for res in results["after"]]
        tokens = after[0]["prompt_tokens"]
        assert all(r["target_tokens"] == size for r in before + after)
        for key, label in STAGES:
            lines.append(f"| {tokens} | {label} | {cell(before, key)} | {cell(after, key)} | "
                         f"{ratio(before, after, key)} |")
    return lines


if __name__ == "__main__":
    main()
