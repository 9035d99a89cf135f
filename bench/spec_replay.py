"""The stop rule replayed on the answers a `make bench-spec` run recorded (issue 47): tokens a
step under the rule and with every draft verified, on the same tokens.

    python -m bench.spec_replay RESULT.json [RESULT.json ...] [--costs RESULT.json]
        [--tree DIR] [--out FILE.md]

Why: a verify computes other bits than one-token steps, so the greedy answer depends on which
drafts were verified, and two stop rules measured side by side each run on their own answer
(on the patch workload, ngram-mod's answers under two rules were 1.25x and 1.36x copyable with
the same rule). Replayed on the same answers, the rules compare on the same tokens: the answer
is generated as recorded, a slot's drafts and its stop rule run as the worker's core runs them
(`backend.worker.drafts.SlotDrafts`), a verify of r rows costs the `VerifyCost` that run
measured at start (`ratio(r)` steps) and a plain step one. What it leaves out: the Python the
drafts cost each step (measured apart), and that a rule's own answer may copy more or less.

Every distinct answer of the files' rows (prefixgate's and llama-server's, any arm) is replayed
under each n-gram type the files measured a cost for, its prompt rendered as bench.spec renders
it. `--costs`: the verify costs of another run instead (a GPU's: what the same answers would
gain where a verify costs about one step). `--tree`: replay another checkout's rule (a worktree
of an older commit), imported from there.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any


def drive(prompt: list[int], answer: list[int], spec: Any, left: int | None = None,
          n_ctx: int = 1 << 20) -> tuple[Any, list[tuple[int, int, int]]]:
    """`answer` generated after `prompt` as the worker's core steps a slot: each step verifies
    the draft proposed beside the waiting token, or is one plain step. (the slot's
    `SlotDrafts`, per verify: tokens generated before it, drafts verified, accepted); `left`:
    the tokens the answer may still generate at every step (None: what is left of `answer`)."""
    import numpy as np

    from backend.worker.drafts import SlotDrafts
    from policies.speculate import accepted

    d = SlotDrafts.start(spec, np.asarray(prompt, dtype=np.intc))
    g, verifies = 0, []
    while g < len(answer) - 1:
        live = np.asarray(prompt + answer[:g], dtype=np.intc)
        draft = d.propose(live, answer[g], g + 1, len(answer) - g - 1 if left is None else left,
                          n_ctx)
        if draft:
            m = accepted(draft, answer[g + 1: g + 1 + len(draft)])
            verifies.append((g + 1, len(draft), m))
            d.verified(len(draft), m, g + 2 + m)
            g += m + 1
        else:
            g += 1
    return d, verifies


def replay(prompt: list[int], answer: list[int], spec: Any) -> tuple[float, int, int]:
    """(tokens a step over plain decode, drafted, accepted) of `answer` after `prompt`: a
    verify of r rows costs `spec.cost.ratio(r)` steps, a plain step one."""
    _, verifies = drive(prompt, answer, spec)
    plain = len(answer) - 1 - sum(m + 1 for _, _, m in verifies)
    steps = plain + sum(spec.cost.ratio(1 + k) for _, k, _ in verifies)
    return ((len(answer) - 1) / steps if steps else 1.0, sum(k for _, k, _ in verifies),
            sum(m for _, _, m in verifies))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+")
    p.add_argument("--costs", default="", help="a result whose verify costs to replay with")
    p.add_argument("--tree", default="", help="a checkout whose rule to replay")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    if args.tree:
        sys.path.insert(0, str(Path(args.tree).resolve()))
    from backend.worker.drafts import Speculation
    from bench.prompts import load_builder, render
    from bench.spec import workloads
    from policies.speculate import SpecConfig, VerifyCost

    builder = load_builder()
    prompts = {name: list(render(builder, {"messages": msgs}).ids)
               for name, msgs in workloads().items()}
    costs: dict[str, VerifyCost] = {}
    answers: dict[tuple[str, str], list[int]] = {}
    for path in ([args.costs] if args.costs else []) + args.results:
        data = json.loads(Path(path).read_text())
        for r in data["rows"]:
            server, _, rest = r["arm"].partition(":")
            kind = rest.partition(":")[0]
            if server == "prefixgate" and kind.startswith("ngram") and r.get("cost_at_start") \
                    and (path == args.costs or not args.costs):
                costs.setdefault(kind, VerifyCost.from_wire(r["cost_at_start"]))
            if r.get("content") and r["workload"] in prompts and path != args.costs:
                ids = list(builder.tok.encode(r["content"]))
                if r["tokens"] < data.get("n_predict", 256) and builder.tok.eos_id is not None:
                    ids.append(builder.tok.eos_id)  # it ended at the end of generation
                answers.setdefault((r["workload"], r["content"]), ids)
    lines = [f"Replayed with the rule of {args.tree or 'this checkout'} on "
             f"{', '.join(args.results)}: tokens a step over plain decode (a verify of r rows "
             f"at the start cost {args.costs or 'those runs'} measured).", "",
             "| answer | tokens | type | stop rule | drafted / accepted | every draft | "
             "drafted / accepted |", "|---|---:|---|---:|---:|---:|---:|"]
    means: dict[str, list[tuple[float, float]]] = {}
    for i, ((work, _), ids) in enumerate(sorted(answers.items())):
        for kind, cost in sorted(costs.items()):
            rule = replay(prompts[work], ids, Speculation(SpecConfig((kind,)), cost, 512, True,
                                                          ""))
            every = replay(prompts[work], ids, Speculation(SpecConfig((kind,), always=True),
                                                           cost, 512, True, ""))
            means.setdefault(kind, []).append((rule[0], every[0]))
            lines.append(f"| {work} #{i} | {len(ids)} | {kind} | {rule[0]:.2f}x | "
                         f"{rule[1]} / {rule[2]} | {every[0]:.2f}x | {every[1]} / {every[2]} |")
    lines.append("")
    for kind, pairs in sorted(means.items()):
        def gm(v: list[float]) -> float:
            return math.exp(sum(map(math.log, v)) / len(v))
        rule, every = [a for a, _ in pairs], [b for _, b in pairs]
        lines.append(f"- {kind}, {len(pairs)} answers: the stop rule {gm(rule):.3f}x plain "
                     f"(geometric mean; least {min(rule):.2f}x), every draft {gm(every):.3f}x "
                     f"(least {min(every):.2f}x); the rule over every draft, least "
                     f"{min(a / b for a, b in pairs):.2f}x")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
