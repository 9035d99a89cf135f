"""`make simulate-all`: `prefixgate simulate` on every trace, with the cache's promises checked.

    python -m bench.scorecard --out DIR [TRACE_OR_DIR ...]

Each trace (a JSONL file, or every `*.jsonl` in a directory; by default `bench/traces/` and the
shared traces in `../shared/traces/`) is simulated under `auto:2,auto:8,auto:30,full,1000`,
with a restart before every request, live on a worker of one slot, and live on a worker of
`--slots` slots (4: sessions taking turns keep their own live KV), as `prefixgate simulate`
does (`simulate-<trace>.md` and `.json` in DIR). `summary.md` and `summary.json` then put every
`auto:N` beside `full` and the oracle, and check the promises of issue 46 on each trace:

- **oracle**: `auto:N` with a restart before every request prefills at most `ORACLE_RATIO`
  (1.05) times the fresh tokens of the oracle at the batches' edges (`bench.oracle` with the
  workers' batching: what any exact cache here can reach; the plain oracle, which may reuse a
  prefix at any token, is shown beside it);
- **full**: `auto:N` prefills at most `FULL_RATIO` (1.02) times what `full` does, live and
  with restarts;
- **restart**: a restart before every request costs `auto:N` at most `RESTART_RATIO` (1.05)
  times the fresh tokens of staying live (the better of one slot and `--slots`).

Beside them, the snapshot tokens each policy writes with a restart per request (`full`'s too):
what the fresh tokens cost in disk writes.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from bench.simulate import DEFAULT_POLICIES, report, write_report
from policies.plan import CacheKnobs
from proxy.config import Config

ORACLE_RATIO = 1.05
FULL_RATIO = 1.02
RESTART_RATIO = 1.05
DEFAULT_TRACES = ("bench/traces", "../shared/traces")
DEFAULT_SLOTS = 4


def trace_files(paths: Iterable[str]) -> list[Path]:
    out: list[Path] = []
    for p in map(Path, paths):
        out.extend(sorted(p.glob("*.jsonl")) if p.is_dir() else [p] if p.exists() else [])
    return out


def check(data: dict[str, Any], slots: int = DEFAULT_SLOTS) -> list[dict[str, Any]]:
    """Per `auto:N` policy of one trace's results (modes restart, live and live:`slots`):
    the ratios and whether each promise holds."""
    by = {(r["policy"], r["mode"]): r for r in data["results"]}
    out = []
    for policy in sorted({p for p, _ in by if p.startswith("auto:")},
                         key=lambda p: int(p.split(":")[1])):
        restart, one = by[(policy, "restart")], by[(policy, "live")]
        live = min(one, by[(policy, f"live:{slots}")], key=lambda r: r["fresh_tokens"])
        full_r, full_l = by[("full", "restart")], by[("full", "live")]
        batch = max(restart["batch_oracle_fresh_tokens"], 1)
        row = {
            "trace": data["trace"], "policy": policy,
            "restart_fresh_tokens": restart["fresh_tokens"],
            "live_fresh_tokens": one["fresh_tokens"],
            "slots_fresh_tokens": by[(policy, f"live:{slots}")]["fresh_tokens"],
            "batch_oracle_fresh_tokens": restart["batch_oracle_fresh_tokens"],
            "restart_over_batch_oracle": restart["fresh_tokens"] / batch,
            "restart_over_oracle": restart["fresh_over_oracle"],
            "restart_over_full": restart["fresh_tokens"] / max(full_r["fresh_tokens"], 1),
            "live_over_full": one["fresh_tokens"] / max(full_l["fresh_tokens"], 1),
            "restart_over_live": restart["fresh_tokens"] / max(live["fresh_tokens"], 1),
            "snapshot_tokens": restart["snapshot_tokens"],  # what it writes: its cost
            "full_snapshot_tokens": full_r["snapshot_tokens"],
        }
        row["holds"] = (row["restart_over_batch_oracle"] <= ORACLE_RATIO
                        and max(row["restart_over_full"], row["live_over_full"]) <= FULL_RATIO
                        and row["restart_over_live"] <= RESTART_RATIO)
        out.append(row)
    return out


SUMMARY_COLUMNS = (
    ("trace", "trace", "{}"), ("policy", "policy", "{}"),
    ("restart_fresh_tokens", "fresh, restart", "{}"), ("live_fresh_tokens", "fresh, live", "{}"),
    ("slots_fresh_tokens", "fresh, live on slots", "{}"),
    ("batch_oracle_fresh_tokens", "batch oracle", "{}"),
    ("restart_over_batch_oracle", "restart x batch oracle", "{:.3f}"),
    ("restart_over_oracle", "restart x oracle", "{:.3f}"),
    ("restart_over_full", "restart x full", "{:.3f}"), ("live_over_full", "live x full", "{:.3f}"),
    ("restart_over_live", "restart x live", "{:.3f}"),
    ("snapshot_tokens", "snapshot tokens", "{}"), ("full_snapshot_tokens", "full's", "{}"),
    ("holds", "holds", "{}"),
)


def summary_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(h for _, h, _ in SUMMARY_COLUMNS) + " |",
             "|" + "|".join("---" if k in ("trace", "policy", "holds") else "---:"
                            for k, _, _ in SUMMARY_COLUMNS) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(
            ("yes" if r[k] else "**no**") if k == "holds" else f.format(r[k])
            for k, _, f in SUMMARY_COLUMNS) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    d = Config()
    p = argparse.ArgumentParser(prog="python -m bench.scorecard",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="*", default=list(DEFAULT_TRACES),
                   help="JSONL traces or directories of them (default: bench/traces and "
                   "../shared/traces)")
    p.add_argument("--out", required=True, help="directory for the tables and summary")
    p.add_argument("--policies", default=DEFAULT_POLICIES)
    p.add_argument("--ubatch-size", type=int, default=d.batch)
    p.add_argument("--slots", type=int, default=DEFAULT_SLOTS,
                   help=f"slots of the second live worker (default {DEFAULT_SLOTS})")
    p.add_argument("--note", default="", help="a line for summary.md")
    a = p.parse_args(argv)
    files = trace_files(a.traces)
    if not files:
        raise SystemExit(f"no traces in {' '.join(a.traces)}")
    policies = [s.strip() for s in a.policies.split(",") if s.strip()]
    if "full" not in policies:
        policies.append("full")
    knobs = CacheKnobs(d.kv_cache_min_tokens, d.kv_cache_cold_max_tokens,
                       d.kv_cache_continued_interval_tokens)
    rows = []
    for f in files:
        head, table, data = report(str(f), policies, ("restart", "live", f"live:{a.slots}"),
                                   knobs, a.ubatch_size)
        write_report(a.out, str(f), head, table, data)
        rows.extend(check(data, a.slots))
        print(f"{f.name}: {len(data['results'])} rows", file=sys.stderr)
    held = sum(r["holds"] for r in rows)
    text = ("# `auto:N` against `full` and the oracle, every trace\n\n"
            + (f"{a.note}\n\n" if a.note else "")
            + f"Promises (issue 46): restart x batch oracle <= {ORACLE_RATIO}, restart and live "
            f"x full <= {FULL_RATIO}, restart x live (the better of one slot and {a.slots}) <= "
            f"{RESTART_RATIO}. Batch "
            f"{a.ubatch_size}; knobs: min {knobs.min_tokens}, cold max "
            f"{knobs.cold_max_tokens}, continued interval {knobs.continued_interval_tokens} "
            f"tokens. Held: {held} of {len(rows)}. Per trace: `simulate-<trace>.md`.\n\n"
            + summary_table(rows) + "\n")
    out = Path(a.out)
    (out / "summary.md").write_text(text)
    (out / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(text)


if __name__ == "__main__":
    main()
