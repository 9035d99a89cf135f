"""Does a batched decode change a slot's output? (issue 20)

    python -m bench.decode_batch [--models smollm2,gemma3,qwen35] [--steps 24] [--slots 3]
        [--flash-attn off,on] [--lengths 300,1200]

For each model, flash attention setting and base length L: a context of `--slots` slots, slot s
holding its own prompt of L + 100 s tokens (prefilled alone, in the cold run's batches). Then
`--steps` greedy decode steps three ways from the same states:
- alone: each slot's token evaluated in a llama_decode of its own (prefixgate's decode steps
  where its start-up check did not prove batching);
- batched: one llama_decode holding one token of every slot (llama-server's continuous
  batching; prefixgate's where its check proved it, `backend.selfcheck.check_decode`);
- padded: alone, plus a padding row in the next slot's sequence (with logits, removed
  after), so that every decode has the shape of a batched one: the alternative measured and
  not taken (it costs every decode alone a row);
- fixed: alone, with a padding row in every other slot's sequence: every decode has one row
  per slot, the shape of the batched one exactly. Where fixed = batched bit for bit, a slot's
  row does not depend on what the other rows hold, and a worker that always decoded in that
  shape could batch (on a GPU a row costs almost nothing; on the H200 neither alone nor
  padded equalled batched, `bench/results/issue20/h200`).
Reported: whether the logits are bit-identical, the largest absolute logit difference, and the
first step where the greedy tokens part, plus the time per step each way.

Why flash attention matters on a CPU: ggml evaluates one query row of one sequence against 512
KV cells or more by splitting the cells among the threads and merging their partial sums
(ggml-cpu/ops.cpp, `use_split_kv_path`), while a batch of several sequences' rows takes the
unsplit path: a slot's decode alone and the same decode beside another slot add in another
order once its KV view reaches 512 cells (llama.cpp pads the view to 256). llama.cpp runs only
consecutive sequence ids as one batch (with one KV stream per sequence), so a padding row must
sit in a neighbouring slot.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np

from backend.engine import Engine
from tests.models import GPU_LAYERS, model_file

ROOT = Path(__file__).resolve().parent.parent


def prompt_ids(eng: Engine, n: int, seed: int) -> list[int]:
    """n seeded token ids of the model's vocabulary, none that ends generation."""
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(1, eng.n_vocab, 2 * n) if int(t) not in eng.eog][:n]


def decode(eng: Engine, tokens: list[tuple[int, int, int]],
           pads: list[tuple[int, int]] | None = None) -> list[np.ndarray]:
    """One llama_decode of (slot, position, token) entries, logits for each. `pads`: (slot,
    position) of padding rows in other slots' sequences, removed after: a
    decode of one slot's row then has the shape of a decode beside other slots' rows."""
    pads = pads or []
    # in the order of their sequence ids: llama.cpp runs only such a run as one batch
    rows = sorted([(*t, True) for t in tokens] + [(*p, tokens[0][2], False) for p in pads])
    b = llama_cpp.llama_batch_init(len(rows), 0, len(eng.seqs))
    try:
        for i, (slot, pos, tok, _) in enumerate(rows):
            # a padding row's logits too: llama.cpp computes the output layer only for the
            # rows that want them, and the shape is all rows
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, 1
            b.seq_id[i][0] = slot
        b.n_tokens = len(rows)
        if llama_cpp.llama_decode(eng.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        out = [np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(eng.ctx, i),
                                     shape=(eng.n_vocab,)).copy()
               for i, row in enumerate(rows) if row[3]]
        for slot, pos in pads:
            if not llama_cpp.llama_memory_seq_rm(eng.mem, slot, pos, -1):
                raise RuntimeError("a padding row could not be removed")
        return out
    finally:
        llama_cpp.llama_batch_free(b)


def run(name: str, slots: int, steps: int, flash_attn: str, length: int) -> dict[str, Any]:
    eng = Engine(model_file(name), (length + 100 * slots + steps + 256) * slots, 2, GPU_LAYERS,
                 flash_attn=flash_attn, n_seq=slots)
    try:
        prompts = [prompt_ids(eng, length + 100 * s, s) for s in range(slots)]
        first, states = [], []
        for s, ids in enumerate(prompts):
            eng.prefill(s, ids)
            first.append(int(np.argmax(eng.last_logits(s))))
            states.append(bytes(eng.snapshot(s)))

        def restore_all() -> None:
            for s, ids in enumerate(prompts):
                eng.restore(s, ids, states[s])

        def walk(mode: str) -> tuple[list[list[np.ndarray]], float]:
            """alone | batched (one call of all slots) | padded (alone, with a padding row in
            the next slot's sequence, or the one before for the last: llama.cpp runs only
            consecutive sequence ids as one batch) | fixed (alone, a padding row in every
            other slot's sequence)."""
            restore_all()
            toks, logits = list(first), [[] for _ in range(slots)]
            live = [len(x) for x in prompts]
            t0 = time.perf_counter()
            for _ in range(steps):
                if mode == "batched":
                    outs = decode(eng, [(s, live[s], toks[s]) for s in range(slots)])
                else:
                    outs = []
                    for s in range(slots):
                        o = s + 1 if s + 1 < slots else s - 1
                        pads = {"padded": [(o, live[o])], "alone": [],
                                "fixed": [(x, live[x]) for x in range(slots) if x != s]}[mode]
                        outs += decode(eng, [(s, live[s], toks[s])], pads)
                        live[s] += 1
                if mode == "batched":
                    live = [n + 1 for n in live]
                for s, out in enumerate(outs):
                    logits[s].append(out)
                    toks[s] = int(np.argmax(out))
            return logits, (time.perf_counter() - t0) / steps

        alone, alone_s = walk("alone")
        batched, batched_s = walk("batched")
        padded_same: bool | None = None  # a recurrent state cannot drop the padding's cell
        fixed_same: bool | None = None
        padded_s = fixed_s = float("nan")
        if eng.memory.kind != "recurrent":
            padded, padded_s = walk("padded")
            padded_same = all(a.tobytes() == b.tobytes() for s in range(slots)
                              for a, b in zip(padded[s], batched[s], strict=True))
            fixed, fixed_s = walk("fixed")
            fixed_same = all(a.tobytes() == b.tobytes() for s in range(slots)
                             for a, b in zip(fixed[s], batched[s], strict=True))
        diff = max(float(np.max(np.abs(a - b))) for s in range(slots)
                   for a, b in zip(alone[s], batched[s], strict=True))
        same = all(a.tobytes() == b.tobytes() for s in range(slots)
                   for a, b in zip(alone[s], batched[s], strict=True))
        parted = [next((i for i, (a, b) in enumerate(zip(alone[s], batched[s], strict=True))
                        if int(np.argmax(a)) != int(np.argmax(b))), None) for s in range(slots)]
        return {"model": name, "file": Path(model_file(name)).name, "flash_attn": flash_attn,
                "compute": eng.compute,
                "prompt_tokens": [len(x) for x in prompts], "slots": slots, "steps": steps,
                "bit_identical": same,
                "max_abs_logit_diff": diff, "greedy_parts_at_step": parted,
                "padded_bit_identical": padded_same, "fixed_bit_identical": fixed_same,
                "alone_ms_per_step": round(alone_s * 1000, 2),
                "padded_ms_per_step": round(padded_s * 1000, 2),
                "fixed_ms_per_step": round(fixed_s * 1000, 2),
                "batched_ms_per_step": round(batched_s * 1000, 2)}
    finally:
        eng.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="bench.decode_batch")
    p.add_argument("--models", default="smollm2,gemma3,qwen35")
    p.add_argument("--slots", type=int, default=3)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--flash-attn", default="off,on")
    p.add_argument("--lengths", default="300,1200", help="base prompt lengths (tokens)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "issue20"))
    args = p.parse_args(argv)
    rows = [run(m, args.slots, args.steps, fa, int(n)) for m in args.models.split(",")
            for fa in args.flash_attn.split(",") for n in args.lengths.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_batch.json").write_text(json.dumps(rows, indent=1))
    lines = ["| model | flash attention | prompts (tokens) | slots | steps | "
             "batched = alone, bit for bit | max abs logit diff | "
             "greedy tokens part at step | padded = batched, bit for bit | "
             "fixed = batched, bit for bit | ms/step alone | ms/step padded | ms/step fixed | "
             "ms/step batched |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} (`{r['file']}`) | {r['flash_attn']} | "
                     f"{', '.join(map(str, r['prompt_tokens']))} | {r['slots']} | {r['steps']} | "
                     f"{r['bit_identical']} | "
                     f"{r['max_abs_logit_diff']:.3g} | {r['greedy_parts_at_step']} | "
                     f"{r['padded_bit_identical']} | {r['fixed_bit_identical']} | "
                     f"{r['alone_ms_per_step']} | {r['padded_ms_per_step']} | "
                     f"{r['fixed_ms_per_step']} | {r['batched_ms_per_step']} |")
    (out / "decode_batch.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
