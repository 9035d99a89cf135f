"""`-hf user/model[:quant]` offline (issue 21): a Hugging Face cache laid out here as
huggingface_hub writes it (refs/main naming a snapshot that holds the files), HF_HUB_OFFLINE=1,
and the real default model behind the snapshot's file. The quant picks the file as llama-server
does; a repository not in the cache, or without that quant, is one line, not a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import openai
import pytest

from proxy.cli import serve_config
from proxy.hub import pick
from tests.conftest import ROOT, running
from tests.models import model_file

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "pg-test/SmolLM2-135M-Instruct-GGUF"


def hub_cache(tmp: Path, files: dict[str, Path | None]) -> Path:
    """A Hugging Face cache holding REPO's snapshot COMMIT with `files` (a link to a real file,
    or an empty one)."""
    cache = tmp / "hub"
    repo = cache / ("models--" + REPO.replace("/", "--"))
    snap = repo / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    for name, target in files.items():
        (snap / name).parent.mkdir(parents=True, exist_ok=True)
        if target is None:
            (snap / name).write_bytes(b"GGUF")
        else:
            (snap / name).symlink_to(target)
    return cache


@pytest.mark.parametrize(("files", "quant", "expected"), [
    (["a-Q8_0.gguf", "a-Q4_K_M.gguf", "a-F16.gguf"], "", "a-Q4_K_M.gguf"),  # the default quant
    (["a-Q8_0.gguf", "a-F16.gguf"], "", "a-F16.gguf"),  # else the first
    (["a-Q8_0.gguf", "a-q4_k_m.gguf"], "q8_0", "a-Q8_0.gguf"),  # case-insensitive
    (["mmproj-a-Q8_0.gguf", "a-Q8_0.gguf", "README.md"], "Q8_0", "a-Q8_0.gguf"),
    (["Q4_K_M/a-Q4_K_M-00002-of-00002.gguf", "Q4_K_M/a-Q4_K_M-00001-of-00002.gguf"], "",
     "Q4_K_M/a-Q4_K_M-00001-of-00002.gguf"),  # a split model: its first part
])
def test_the_quant_picks_the_file(files: list[str], quant: str, expected: str) -> None:
    assert pick(files, quant) == expected


def test_hf_resolves_from_the_cache_offline(tmp_path: Path) -> None:
    cache = hub_cache(tmp_path, {"m-Q4_K_M.gguf": None, "m-Q8_0.gguf": None})
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        snap = cache / ("models--" + REPO.replace("/", "--")) / "snapshots" / COMMIT
        assert serve_config(["-hf", REPO]).model_path == str(snap / "m-Q4_K_M.gguf")
        assert serve_config(["-hf", REPO + ":q8_0"]).model_path == str(snap / "m-Q8_0.gguf")
        assert serve_config(["-hfr", REPO, "-hff", "m-Q8_0.gguf"]).model_path == \
            str(snap / "m-Q8_0.gguf")
        assert serve_config([], {**env, "LLAMA_ARG_HF_REPO": REPO}).model_path == \
            str(snap / "m-Q4_K_M.gguf")
        for argv, said in [(["-hf", REPO + ":IQ2_XS"], "no GGUF file of quant IQ2_XS"),
                           (["-hf", "pg-test/not-cached"], "not in the Hugging Face cache"),
                           (["-hf", "no-slash"], "user/model[:quant]")]:
            with pytest.raises(SystemExit) as e:
                serve_config(argv)
            assert str(e.value).startswith("prefixgate: -hf ") and said in str(e.value), e


@pytest.mark.model
def test_serve_dash_hf_offline_serves_the_cached_model(tmp_path: Path) -> None:
    real = Path(model_file("smollm2"))
    cache = hub_cache(tmp_path, {real.name: real})
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    with running(tmp_path, "-hf", REPO + ":Q4_1", "--disk-prefix-cache", "off",
                 env=env) as srv:
        props = srv.get_json("/props")
        assert props["model_path"].endswith(f"snapshots/{COMMIT}/{real.name}")
        c = openai.OpenAI(base_url=srv.v1, api_key="k", max_retries=0, timeout=120)
        r = c.chat.completions.create(model="m", max_tokens=3, temperature=0,
                                      messages=[{"role": "user", "content": "hi"}])
        assert r.choices[0].message.content is not None
    missing = subprocess.run([sys.executable, "-m", "proxy.cli", "serve", "-hf", REPO + ":Q2_K",
                              "--port", "0"], cwd=ROOT, capture_output=True, text=True,
                             timeout=60, env={**env, "PATH": "/usr/bin:/bin"})
    assert missing.returncode != 0 and "Traceback" not in missing.stderr
    assert "no GGUF file of quant Q2_K" in missing.stderr
