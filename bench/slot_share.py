"""`python -m bench.slot_share`: what a restore of a large state from disk costs another slot
that generates meanwhile (issue 41: restores run on the worker's reader thread; before, a
restore ran inside one scheduler step on the llama thread and every other slot stopped).

    python -m bench.slot_share [--state-gib 1.0] [--answer 160] [--model GGUF] [--out DIR]

A real `prefixgate worker` with two slots, driven through its HTTP API (backend/protocol.py):

1. slot 1 prefills a prompt whose state is about `--state-gib` GiB (f32 KV) and snapshots it at
   its end: a state file in the cache directory;
2. alone: slot 0 answers `--answer` greedy tokens after a short prompt; its time per token
   (the median gap between its `Token` events);
3. beside a restore: slot 0 answers again, and once it has generated a few tokens slot 1 is
   given a job that restores that file (read, verified and prepared on the reader thread, then
   loaded); slot 0's time per token while the restore is under way (from the restore job's
   arrival to its `Start`), against (2).

The worker runs with its default threads (`--threads`: one per physical core, less one where
every CPU is a core of its own, so the reader thread's reading, hashing and copying has a CPU
of its own; llama.cpp's threads spin at their barriers, and one of them sharing a core with the
reader slows every step several-fold: 3.06x with 2 decode threads on 2 vCPUs). The
default model is generated here (`bench.random_model`, cached in /tmp): plain attention
shaped so that a state is large for little compute (64 layers of 8 KV heads of 128, an FFN of
256: 512 KiB of f32 KV a token, so 1 GiB is 2,048 tokens). Run it alone on a quiet machine.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from backend.protocol import Done, Event, Job, Saved, Start, Token, parse_event
from bench.replay import ROOT, free_port, http_get
from policies.decide import Plan, Restore, Save
from proxy.worker_link import child_env

MODEL_ARGS = ["--arch", "llama", "--layers", "64", "--size", "1024,8,8,256"]
KV_BYTES_PER_TOKEN = 64 * 8 * 128 * 2 * 4  # layers x KV heads x head dim x (K, V) x f32


def _model(vocab: Path) -> Path:
    out = Path(tempfile.gettempdir()) / "prefixgate-bench" / "slot-share-llama-64x1024.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "bench.random_model", *MODEL_ARGS, "--vocab",
                        str(vocab), "--out", str(out)], check=True, cwd=ROOT,
                       env=child_env(ROOT))
    return out


def _run(port: int, job: Job, events: list[tuple[float, Event]]) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    conn.request("POST", "/run", body=job.encode(),
                 headers={"Content-Type": "application/octet-stream"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"/run: {resp.status} {resp.read()!r}")
    while line := resp.readline():
        events.append((time.perf_counter(), parse_event(line)))
    conn.close()


def _job(run: str, ids: list[int], slot: int, max_tokens: int, plan: Plan) -> Job:
    return Job(run, tuple(ids), b"", "", plan, {"temperature": 0.0}, max_tokens, (), None,
               slot)


def _gaps(events: list[tuple[float, Event]], start: float = 0.0,
          end: float = float("inf")) -> list[float]:
    times = [t for t, e in events if isinstance(e, Token) and e.id is not None]
    return [b - a for a, b in zip(times, times[1:], strict=False) if start <= a and b <= end]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench.slot_share",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--state-gib", type=float, default=1.0)
    p.add_argument("--answer", type=int, default=160)
    p.add_argument("--model", default="", help="a GGUF (default: generated, see above)")
    p.add_argument("--vocab", type=Path,
                   default=ROOT / "build/fixtures/llama.cpp/models/ggml-vocab-llama-bpe.gguf")
    p.add_argument("--threads", type=int, default=0, help="the worker's decode threads (0: its "
                   "default, which leaves the reader thread a CPU)")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    model = Path(a.model) if a.model else _model(a.vocab)
    n_state = int(a.state_gib * (1 << 30) / KV_BYTES_PER_TOKEN) // 128 * 128
    long_ids = [1000 + (i * 7919) % 20000 for i in range(n_state + 1)]
    short_ids = [300 + (i * 31) % 5000 for i in range(200)]
    tmp = Path(tempfile.mkdtemp(prefix="slot-share-"))
    port = free_port()
    cmd = [sys.executable, "-m", "proxy.cli", "worker", "--listen", f"127.0.0.1:{port}",
           "--model", str(model), "--n-ctx", str(2 * (n_state + 1024)), "--parallel", "2",
           *(["--threads", str(a.threads)] if a.threads else []),
           "--cache-dir", str(tmp / "cache"), "--cache-ram", "0",
           "--cache-type-k", "f32", "--cache-type-v", "f32", "--no-exact-check",
           "--ubatch-size", "128"]
    log = open(tmp / "worker.log", "wb")  # noqa: SIM115 (open for the process's life)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env=child_env(ROOT))
    try:
        while http_get(f"http://127.0.0.1:{port}/health", timeout_s=2)[0] != 200:
            if proc.poll() is not None:
                raise SystemExit(f"the worker did not start: {(tmp / 'worker.log').read_text()}")
            time.sleep(0.5)
        # 1. the large state, snapshotted at the prompt's last edge
        made: list[tuple[float, Event]] = []
        t = time.perf_counter()
        _run(port, _job("make", long_ids, 1, 1,
                        Plan((), (Save(n_state, "cold"),), 0, False, "miss", None, None)), made)
        saved = next(e for _, e in made if isinstance(e, Saved))
        prefill_s = time.perf_counter() - t
        # 2. the answer alone
        alone: list[tuple[float, Event]] = []
        _run(port, _job("alone", short_ids, 0, a.answer, Plan((), (), 0, False, "off", None,
                                                               None)), alone)
        # 3. the answer beside the restore
        beside: list[tuple[float, Event]] = []
        answer = threading.Thread(target=_run, args=(port, _job(
            "beside", short_ids, 0, a.answer, Plan((), (), 0, False, "off", None, None)),
            beside))
        answer.start()
        while sum(isinstance(e, Token) for _, e in beside) < 8:
            time.sleep(0.005)
        restored: list[tuple[float, Event]] = []
        arrived = time.perf_counter()
        restore = Restore(n_state, bytes.fromhex(saved.key), saved.file, saved.size_bytes)
        _run(port, _job("restore", long_ids, 1, 1, Plan((restore,), (), n_state, False, "hit",
                                                         None, None)), restored)
        answer.join()
        start_t, start = next((t, e) for t, e in restored if isinstance(e, Start))
        assert isinstance(start, Start) and start.restored == n_state, start
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        log.close()
    during = _gaps(beside, arrived, start_t)
    base = statistics.median(_gaps(alone))
    mean_during = statistics.fmean(during) if during else float("nan")
    done = next(e for _, e in beside if isinstance(e, Done))
    result = {
        "model": model.name, "threads": a.threads or "default", "state_tokens": n_state,
        "state_bytes": saved.size_bytes,
        "prefill_s": round(prefill_s, 1), "restore_s": round(start_t - arrived, 3),
        "answer_tokens": done.n_gen, "token_s_alone_median": round(base, 5),
        "tokens_during_restore": len(during),
        "token_s_during_restore_mean": round(mean_during, 5),
        "token_s_during_restore_max": round(max(during, default=float("nan")), 5),
        "ratio_mean": round(mean_during / base, 3) if during else None,
    }
    print("| state | restore s | tokens during it | s/token alone | s/token during (mean) "
          "| ratio | longest gap s |\n|---|---:|---:|---:|---:|---:|---:|")
    print(f"| {saved.size_bytes / 2**30:.2f} GiB ({n_state} tokens) | {result['restore_s']} | "
          f"{len(during)} | {base:.4f} | {mean_during:.4f} | {result['ratio_mean']} | "
          f"{result['token_s_during_restore_max']} |")
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "slot_share.json").write_text(json.dumps(result, indent=1))
    for f in (tmp / "cache").rglob("*.state"):
        os.unlink(f)
    return result


if __name__ == "__main__":
    main()
