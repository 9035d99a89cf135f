"""`python -m bench.start_stop`: how long a restart keeps an agent waiting: from launch to a
`/health` that answers 200, and from SIGINT (Ctrl-C, `docker stop`) to the process gone,
prefixgate against llama-server from the same llama.cpp, side by side in alternating rounds.

    python -m bench.start_stop --llama-server build/llama-server/build/bin/llama-server \\
        [--base DIR] [--rounds 5] [--model GGUF] [--out DIR]

Each server runs at its defaults on the default model with the same `-c` (prefixgate with a
cache directory of its own per run). `--base DIR`: another checkout of
prefixgate (e.g. `git worktree add /tmp/base HEAD~1`), run with this interpreter, as a third
arm. A prefixgate start on a machine it has not measured yet also measures its prefill batch
and proves exact reuse (a minute or more on a CPU); this bench runs one start of each
prefixgate first, unmeasured, so every round reads what a restart costs. Run it alone on a
quiet machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.replay import ROOT, free_port, http_get
from proxy.worker_link import child_env


def _prefixgate(model: str, ctx: int, port: int, tmp: Path) -> list[str]:
    return [sys.executable, "-m", "proxy.cli", "serve", "--model", model, "-c", str(ctx),
            "--port", str(port), "--cache-dir", str(tmp / "cache")]


def once(cmd: list[str], cwd: Path, env: dict[str, str], port: int, log: Path,
         timeout_s: float = 600) -> dict[str, float]:
    """{"start_s": launch to /health 200, "stop_s": SIGINT to exit}."""
    with open(log, "wb") as out:
        t = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            while http_get(f"http://127.0.0.1:{port}/health", timeout_s=2)[0] != 200:
                if proc.poll() is not None:
                    raise RuntimeError(f"{cmd[0]} exited {proc.returncode}: see {log}")
                if time.perf_counter() - t > timeout_s:
                    raise RuntimeError(f"not ready in {timeout_s} s: see {log}")
                time.sleep(0.01)
            start = time.perf_counter() - t
            t = time.perf_counter()
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
            return {"start_s": start, "stop_s": time.perf_counter() - t}
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def main(argv: list[str] | None = None) -> None:
    from proxy.config import default_model

    p = argparse.ArgumentParser(prog="python -m bench.start_stop", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-server", default="build/llama-server/build/bin/llama-server")
    p.add_argument("--base", type=Path, help="another prefixgate checkout, a third arm")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--model", default="")
    p.add_argument("-c", "--ctx", type=int, default=65536,
                   help="both servers' -c (prefixgate's default; llama-server's is the model's "
                   "training context): the KV both allocate and clear at start")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if not shutil.which(args.llama_server):
        raise SystemExit(f"no llama-server at {args.llama_server}: `make bench-team` builds it, "
                         "or give --llama-server PATH")
    model = args.model or default_model()
    tmp = Path(tempfile.mkdtemp(prefix="prefixgate-start-stop-"))
    arms: dict[str, tuple[Path, list[str] | None]] = {"prefixgate": (ROOT, None)}
    if args.base:
        arms["prefixgate (base)"] = (args.base.resolve(), None)
    arms["llama-server"] = (ROOT, [args.llama_server, "-m", model, "-c", str(args.ctx)])
    runs: dict[str, list[dict[str, float]]] = {a: [] for a in arms}
    for r in range(args.rounds + 1):  # round 0: each prefixgate measures what it remembers
        for arm, (tree, peer) in arms.items():
            if r == 0 and peer is not None:
                continue
            port, where = free_port(), tmp / f"{arm.replace(' ', '-')}-{r}"
            where.mkdir()
            cmd = [*peer, "--port", str(port)] if peer else \
                _prefixgate(model, args.ctx, port, where)
            got = once(cmd, tree, child_env(tree), port, where / "server.log")
            if r:
                runs[arm].append(got)
            print(f"round {r} {arm}: start {got['start_s']:.2f} s, stop {got['stop_s']:.2f} s",
                  flush=True)
    res: dict[str, Any] = {"model": Path(model).name, "rounds": args.rounds, "arms": {}}
    peer = runs["llama-server"]
    for arm, rs in runs.items():
        med = {k: statistics.median(x[k] for x in rs) for k in ("start_s", "stop_s")}
        res["arms"][arm] = {"runs": rs, "median": med, "x_llama_server": {
            k: med[k] / statistics.median(x[k] for x in peer) for k in med}}
    lines = [f"# Start and stop, {res['model']}, -c {args.ctx}, {args.rounds} alternating "
             "rounds (medians)", "",
             "| arm | start s | stop s | start x llama-server | stop x llama-server |",
             "|---|---:|---:|---:|---:|"]
    for arm, a in res["arms"].items():
        lines.append(f"| {arm} | {a['median']['start_s']:.2f} | {a['median']['stop_s']:.2f} | "
                     f"{a['x_llama_server']['start_s']:.2f} | "
                     f"{a['x_llama_server']['stop_s']:.2f} |")
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "start-stop.json").write_text(json.dumps(res, indent=1))
        (args.out / "start-stop.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
