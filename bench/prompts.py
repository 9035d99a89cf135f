"""The proxy's own prompt path, outside a server: parse -> normalize -> render -> tokenize.

`PromptBuilder.render(body)` returns exactly the token ids and safe boundaries the proxy would
compute for an OpenAI chat body: it loads the model's metadata, tokenizer and chat template the way
`proxy.app.lifecycle` does, parses with `proxy.openai_api.parse_chat`, and calls the real
`Gateway.prepare` (the normalizer, `render_prompt`). No worker, no index: `prepare` touches
neither. The oracle, the simulator and the overhead benchmark all read prompts through it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from proxy import openai_api
from proxy.config import Config
from proxy.gateway import Gateway, Prepared
from proxy.gguf import read_metadata
from proxy.metrics import Metrics
from proxy.template import ChatTemplate, Rendered
from proxy.tokenizer import load_tokenizer

# Prompts are rendered whatever their length: the oracle does not refuse a long one.
UNBOUNDED_CTX = 1 << 30


def model_salt(cfg: Config) -> dict[str, Any]:
    """The salt fields `proxy.app.lifecycle` gives the gateway."""
    import llama_cpp

    return {"model_path": cfg.model_path, "n_ctx": cfg.n_ctx, "type_k": "f16", "type_v": "f16",
            "flash_attn": cfg.flash_attn, "lib_version": llama_cpp.__version__}


class PromptBuilder:
    def __init__(self, cfg: Config | None = None, model: str = "") -> None:
        cfg = cfg or Config()
        if model:
            cfg = replace(cfg, model=model)
        self.cfg = replace(cfg, n_ctx=max(cfg.n_ctx, UNBOUNDED_CTX))
        meta = read_metadata(self.cfg.model_path)
        tok = load_tokenizer(self.cfg.model_path, meta)
        # as proxy.app.lifecycle builds it
        template = ChatTemplate(meta.get("tokenizer.chat_template") or "",
                                tok.decode([tok.bos_id]) if tok.bos_id is not None else "",
                                tok.decode([tok.eos_id]) if tok.eos_id is not None else "")
        self.tok = tok
        self.template = template
        self.gateway = Gateway(self.cfg, template, tok, None, None,  # type: ignore[arg-type]
                               Metrics(), model_salt(self.cfg))

    def prepare(self, body: dict[str, Any]) -> Prepared:
        return self.gateway.prepare(openai_api.parse_chat(body, ""))

    def render(self, body: dict[str, Any]) -> Rendered:
        return self.prepare(body).rendered
