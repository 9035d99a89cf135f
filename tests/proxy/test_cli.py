"""The command line: flags, PREFIXGATE_* variables, and a taken port."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys

from backend import placement
from proxy.config import Config, add_arguments, from_args
from tests.conftest import ROOT


def parse(argv: list[str], env: dict[str, str]) -> Config:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return from_args(p.parse_args(argv), env)


def test_flags_and_environment() -> None:
    # defaults
    cfg = parse([], {})
    assert (cfg.port, cfg.workers, cfg.n_ctx, cfg.disk_prefix_cache) == (8080, 1, 65536, "auto:30")
    # as llama-server: every layer on the GPU where the build can offload, none on a CPU build
    offload = bool(placement.offload_devices())
    assert (cfg.n_gpu_layers, cfg.batch) == ((-1, 512) if offload else (0, 128))
    # every flag has a PREFIXGATE_* variable
    cfg = parse([], {"PREFIXGATE_PORT": "9001", "PREFIXGATE_WORKERS": "3",
                     "PREFIXGATE_N_CTX": "8192", "PREFIXGATE_THREADS": "4",
                     "PREFIXGATE_N_GPU_LAYERS": "-1", "PREFIXGATE_MODEL": "/m.gguf",
                     "PREFIXGATE_TENANT_ISOLATION": "true", "PREFIXGATE_HOST": "0.0.0.0"})
    assert (cfg.port, cfg.workers, cfg.n_ctx, cfg.threads, cfg.n_gpu_layers, cfg.model,
            cfg.tenant_isolation, cfg.host) == (9001, 3, 8192, 4, -1, "/m.gguf", True, "0.0.0.0")
    # a flag wins over its variable
    cfg = parse(["--port", "9002", "--no-tenant-isolation"],
                {"PREFIXGATE_PORT": "9001", "PREFIXGATE_TENANT_ISOLATION": "1"})
    assert (cfg.port, cfg.tenant_isolation) == (9002, False)


def test_a_taken_port_fails_at_once_with_a_clear_message() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "proxy.cli", "serve", "--port", str(port)],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert f"port {port} on 127.0.0.1 is already in use" in r.stderr
    assert "Traceback" not in r.stderr
    assert "llama_context" not in r.stderr, "it fails before any worker loads the model"


def test_kv_settings_flags_and_variables() -> None:
    cfg = parse([], {})
    assert (cfg.flash_attn, cfg.cache_type_k, cfg.cache_type_v, cfg.swa_full) == \
        ("auto", "f16", "f16", True)
    cfg = parse(["--flash-attn", "auto", "--cache-type-k", "q8_0", "--no-swa-full"],
                {"PREFIXGATE_CACHE_TYPE_V": "Q8_0", "PREFIXGATE_FLASH_ATTN": "on"})
    assert (cfg.flash_attn, cfg.cache_type_k, cfg.cache_type_v, cfg.swa_full) == \
        ("auto", "q8_0", "q8_0", False)
    # the old boolean spellings of flash attention still work
    assert parse([], {"PREFIXGATE_FLASH_ATTN": "true"}).flash_attn == "on"
    assert parse([], {"PREFIXGATE_FLASH_ATTN": "false"}).flash_attn == "off"


def test_bad_settings_and_a_missing_model_are_said_without_a_traceback(tmp_path) -> None:
    not_gguf = tmp_path / "notes.txt"
    not_gguf.write_text("hello")
    for argv, said in (
        (["--flash-attn", "maybe"], "invalid value for --flash-attn: 'maybe' (one of on, off, "
                                    "auto)"),
        (["--cache-type-k", "q3"], "invalid value for --cache-type-k: 'q3'"),
        (["--model", str(tmp_path / "missing.gguf")], "cannot read the model"),
        (["--model", str(not_gguf)], "is not a GGUF model file"),
    ):
        r = subprocess.run([sys.executable, "-m", "proxy.cli", "serve", "--port", "0", *argv],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and said in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_chat_template_file_replaces_the_models(tmp_path) -> None:
    from proxy.chat import ChatRequest
    from proxy.config import default_model
    from proxy.prompt import PromptBuilder

    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}<<{{ m.role }}>>{{ m.content }}\n{% endfor %}"
                   "{% if add_generation_prompt %}<<assistant>>{% endif %}")
    builder = PromptBuilder.load(default_model(), template_file=str(tpl))
    rendered, _ = builder.render(ChatRequest("openai", ({"role": "user", "content": "hi"},)))
    assert rendered.text == "<<user>>hi\n<<assistant>>"
    assert rendered.ids == tuple(builder.tok.encode(rendered.text))


def test_a_chat_template_given_inline_replaces_the_models() -> None:
    """llama-server's --chat-template: the template's source itself, or chatml."""
    from proxy.chat import ChatRequest
    from proxy.config import default_model
    from proxy.prompt import PromptBuilder

    hi = ChatRequest("openai", ({"role": "user", "content": "hi"},))
    inline = PromptBuilder.load(default_model(), template="{% for m in messages %}[{{ m.role }}]"
                                "{{ m.content }}{% endfor %}{% if add_generation_prompt %}[a]"
                                "{% endif %}")
    assert inline.render(hi)[0].text == "[user]hi[a]"
    chatml = PromptBuilder.load(default_model(), template="chatml")
    assert chatml.render(hi)[0].text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_a_chat_template_that_cannot_be_used_is_said_in_one_line(tmp_path) -> None:
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }")
    for path, said in ((bad, "line 1: unexpected '}'"), (tmp_path / "gone.jinja", "No such file")):
        r = subprocess.run([sys.executable, "-m", "proxy.cli", "serve", "--port", "0",
                            "--chat-template-file", str(path)],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and "cannot be used" in r.stderr and said in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "proxy.cli", "serve", "--port", "0",
                        "--chat-template", bad.read_text()],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "the chat template in --chat-template cannot be used: line 1: unexpected '}'" in \
        r.stderr and r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
