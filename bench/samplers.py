"""llama-server's samplers, answer for answer: prefixgate and llama-server built from the same
llama.cpp answer one prompt with each sampler setting, seeded, and the answers are compared.

    python -m bench.samplers [--llama-server PATH] [--model GGUF] [--n-predict N] [--out DIR]

Writes DIR/samplers-MODEL.json and .md.

Both servers run at once, asked in turn (never together). The prompt is short enough for one
prefill batch in both, so both compute the same logits (`make bench-spec` shows that the
answers part only where the batches do); llama-server is asked with `cache_prompt: false`, so
every request prefills the whole prompt again; prefixgate's later requests hit its cache, whose
restored state is the cold run's. Each setting's request is the same JSON to both servers'
`/completion` (a raw text prompt, which prefixgate prefills in one batch, with no message end
inside it where its batches would part from llama-server's; its tokens, BOS included, are what
llama-server gets). A
setting whose answers differ is a finding: the worker's chain is not llama.cpp's
`common_sampler_init`. Printed as markdown; the JSON and markdown go to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from backend.placement import uses_repack
from bench.replay import free_port, http_get
from bench.spec import post_json
from bench.team import Server

# longer than the penalties' and DRY's windows (64 tokens), which start with the prompt's tail
PROMPT = ("Colours: " + "red, green, blue, " * 8 + "red.\nOnce upon a time, in a small village "
          "by the sea, there lived an old fisherman who")

# (name, the request's fields besides the prompt, n_predict and seed)
SETTINGS: list[tuple[str, dict[str, Any]]] = [
    ("temperature 0.8 (llama.cpp's chain)", {"temperature": 0.8}),
    ("greedy", {"temperature": 0}),
    ("greedy, repetition penalties", {"temperature": 0, "repeat_penalty": 1.3,
                                      "repeat_last_n": 16, "presence_penalty": 0.5,
                                      "frequency_penalty": 0.3}),
    ("Qwen3-Coder's line (Unsloth)", {"temperature": 0.7, "min_p": 0.0, "top_p": 0.8,
                                      "top_k": 20, "repeat_penalty": 1.05}),
    ("Qwen3's presence penalty", {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                  "presence_penalty": 1.5}),
    ("typical 0.8", {"temperature": 1.0, "typical_p": 0.8}),
    ("top-n-sigma 1.0", {"temperature": 1.0, "top_n_sigma": 1.0}),
    ("XTC 0.5 / 0.1", {"temperature": 1.0, "xtc_probability": 0.5, "xtc_threshold": 0.1}),
    ("DRY 0.8, greedy", {"temperature": 0, "dry_multiplier": 0.8, "dry_allowed_length": 2}),
    ("DRY 0.8, own breakers", {"temperature": 0.7, "dry_multiplier": 0.8,
                               "dry_sequence_breakers": [",", "\n"]}),
    ("dynamic temperature 0.5", {"temperature": 0.9, "dynatemp_range": 0.5,
                                 "dynatemp_exponent": 1.5}),
    ("mirostat 1", {"temperature": 0.8, "mirostat": 1, "mirostat_tau": 4.0}),
    ("mirostat 2", {"temperature": 0.8, "mirostat": 2, "mirostat_tau": 4.0,
                    "mirostat_eta": 0.2}),
    ("order: temperature first", {"temperature": 1.2, "samplers": ["temperature", "top_k",
                                                                   "top_p", "min_p"]}),
    ("order as characters: kt", {"temperature": 1.0, "top_k": 5, "samplers": "kt"}),
    ("no temperature stage, temperature 0", {"temperature": 0, "samplers": ["top_k", "min_p"]}),
    ("adaptive-p 0.3", {"temperature": 1.0, "adaptive_target": 0.3,
                        "samplers": ["top_k", "temperature", "adaptive_p"]}),
    ("min_keep 3, top-p 0.1", {"temperature": 1.0, "top_p": 0.1, "min_keep": 3}),
    ("logit bias: ids and text", {"temperature": 0, "logit_bias": [[28, False], ["red", -5.0],
                                                                    [" blue", 3.0]]}),
    ("ignore_eos", {"temperature": 0, "ignore_eos": True}),
    # llama-server's grammar flow: the chain's pick checked, a resample where it breaks it
    ("grammar the answer keeps, temperature 0.8", {"temperature": 0.8,
                                                    "grammar": "root ::= [a-zA-Z ,.'\\n]+"}),
    ("grammar the answer breaks, temperature 0.8", {
        "temperature": 0.8, "grammar": 'root ::= ("red" | "green" | "blue" | ", " | " ")+'}),
    ("grammar the answer breaks, greedy", {
        "temperature": 0, "grammar": 'root ::= ("red" | "green" | "blue" | ", " | " ")+'}),
    # the reasoning budget (policies.reasoning_budget), on raw text as llama-server's
    # /completion takes it: the tags named, the block opened by the generation prompt
    ("reasoning budget 8, greedy", {"temperature": 0, **(BUDGET := {
        "reasoning_budget_tokens": 8, "reasoning_budget_start_tag": "<think>",
        "reasoning_budget_end_tags": ["</think>"], "generation_prompt": "<think>\n",
        "reasoning_budget_message": ""})}),
    ("reasoning budget 8 and a message, temperature 0.8", {
        "temperature": 0.8, **BUDGET, "reasoning_budget_message": " That is enough."}),
    ("reasoning budget 0, greedy", {"temperature": 0, **BUDGET, "reasoning_budget_tokens": 0}),
]


def command(which: str, args: argparse.Namespace, port: int, work: Path) -> list[str]:
    if which == "llama-server":
        repack = [] if uses_repack("auto") else ["--no-repack"]
        # --swa-full: prefixgate's default (a sliding-window model's full-size cache, which
        # reuses exactly anywhere); llama-server's own default computes other bits on Gemma
        return [args.llama_server, "-m", args.model, "-c", str(args.ctx), "-np", "1", "-t",
                str(args.threads), "-ub", str(args.batch), *repack, "--swa-full", "--host",
                "127.0.0.1", "--port", str(port)]
    return [sys.executable, "-m", "proxy.cli", "serve", "--model", args.model, "--host",
            "127.0.0.1", "--port", str(port), "-c", str(args.ctx), "--threads",
            str(args.threads), "--cache-dir", str(work / "cache"), "--disk-prefix-cache", "off"]


def main(argv: list[str] | None = None) -> None:
    from proxy.config import default_model

    p = argparse.ArgumentParser(prog="python -m bench.samplers",
                                description=__doc__.split("\n")[0])
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER", "llama-server"))
    p.add_argument("--model", default="")
    p.add_argument("--n-predict", type=int, default=48)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    args.model = args.model or default_model()
    if not shutil.which(args.llama_server):
        raise SystemExit(f"llama-server not found ({args.llama_server}); `make bench-samplers` "
                         "builds it from the llama-cpp-python sdist, or pass --llama-server")
    work = Path(tempfile.mkdtemp(prefix="bench-samplers-"))
    ports = {w: free_port() for w in ("prefixgate", "llama-server")}
    args.batch = 512
    ours = Server("prefixgate", command("prefixgate", args, ports["prefixgate"], work),
                  work / "prefixgate.log", ports["prefixgate"], sample_rss=False)
    ours.start()
    rows = []
    try:
        props = json.loads(http_get(f"http://127.0.0.1:{ports['prefixgate']}/props")[1])
        args.batch = int(props["ubatch_size"])
        ids = post_json(ports["prefixgate"], "/tokenize", {"content": PROMPT,
                                                           "add_special": True})["tokens"]
        if len(ids) > args.batch:
            raise SystemExit(f"the prompt is {len(ids)} tokens, over one batch ({args.batch})")
        peer = Server("llama-server", command("llama-server", args, ports["llama-server"], work),
                      work / "llama-server.log", ports["llama-server"], sample_rss=False)
        peer.start()
        try:
            for name, fields in SETTINGS:
                body = {"n_predict": args.n_predict, "seed": args.seed, **fields}
                a = post_json(ports["prefixgate"], "/completion", {**body, "prompt": PROMPT})
                b = post_json(ports["llama-server"], "/completion",
                              {**body, "prompt": ids, "cache_prompt": False})
                same = a["content"] == b["content"]
                part = next((i for i, (x, y) in enumerate(zip(a["content"], b["content"],
                                                              strict=False)) if x != y),
                            min(len(a["content"]), len(b["content"])))
                rows.append({"setting": name, "fields": fields, "same": same,
                             "tokens": [a["tokens_predicted"], b["tokens_predicted"]],
                             "parts_at_char": None if same else part,
                             "prefixgate": a["content"], "llama_server": b["content"],
                             "stop_type": [a.get("stop_type"), b.get("stop_type")]})
                print(f"{name}: {'same' if same else f'parts at char {part}'} "
                      f"({len(a['content'])} characters)", flush=True)
        finally:
            peer.stop()
    finally:
        ours.stop()
    md = markdown(rows, args, len(ids))
    print(md)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = "samplers-" + Path(args.model).stem
        (out / f"{name}.json").write_text(json.dumps({"model": args.model, "prompt_tokens":
                                                       len(ids), "seed": args.seed,
                                                       "n_predict": args.n_predict,
                                                       "rows": rows}, indent=1))
        (out / f"{name}.md").write_text(md + "\n")
    shutil.rmtree(work, ignore_errors=True)


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace, n_prompt: int) -> str:
    same = sum(r["same"] for r in rows)
    out = [f"`python -m bench.samplers` on {Path(args.model).name}: a {n_prompt}-token prompt, "
           f"{args.n_predict} tokens, seed {args.seed}, {args.threads} threads. "
           f"{same} of {len(rows)} settings give llama-server's answer.", "",
           "| setting | request fields | answers | tokens | prefixgate's answer (start) |",
           "|---|---|---|---|---|"]
    for r in rows:
        fields = ", ".join(f"{k} {json.dumps(v)}" for k, v in r["fields"].items())
        verdict = "same" if r["same"] else f"part at char {r['parts_at_char']}"
        text = r["prefixgate"][:60].replace("\n", "\\n").replace("|", "\\|")
        out.append(f"| {r['setting']} | {fields.replace('|', '/')} | {verdict} | "
                   f"{r['tokens'][0]} | {text} |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
