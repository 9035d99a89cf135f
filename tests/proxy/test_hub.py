"""`-hf user/model[:quant]` offline (issue 21): a Hugging Face cache laid out here as
huggingface_hub writes it (refs/main naming a snapshot that holds the files), HF_HUB_OFFLINE=1,
and the real default model behind the snapshot's file. The quant picks the file as llama-server
does; a repository not in the cache, or without that quant, is one line, not a traceback."""

from __future__ import annotations

import contextlib
import http.server
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from proxy.cli import serve_config
from proxy.hub import parts, pick, split_tag
from tests.conftest import ROOT, running
from tests.models import model_file, write_split

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "pg-test/SmolLM2-135M-Instruct-GGUF"


def hub_cache(tmp: Path, files: dict[str, Path | None], name: str = REPO) -> Path:
    """A Hugging Face cache holding the repository `name`'s snapshot COMMIT with `files` (a
    link to a real file, or an empty one)."""
    cache = tmp / "hub"
    repo = cache / ("models--" + name.replace("/", "--"))
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


# llama.cpp's common/download.cpp (find_best_model), case by case; files in the repository's order
@pytest.mark.parametrize(("files", "quant", "expected"), [
    (["a-Q8_0.gguf", "a-Q4_K_M.gguf", "a-F16.gguf"], "", "a-Q4_K_M.gguf"),  # no tag: Q4_K_M,
    (["a-F16.gguf", "a-Q8_0.gguf"], "", "a-Q8_0.gguf"),  # then Q8_0,
    (["a-F16.gguf", "a-BF16.gguf"], "", "a-F16.gguf"),  # then the first model file
    (["b-Q4_K_M.gguf", "a-Q4_K_M.gguf"], "", "b-Q4_K_M.gguf"),  # the repository's order
    (["a-Q8_0.gguf", "a-q4_k_m.gguf"], "q8_0", "a-Q8_0.gguf"),  # case-insensitive
    (["a-Q4_K_M.gguf", "a-Q4_K_S.gguf", "a-Q4_K.gguf"], "Q4_K", "a-Q4_K.gguf"),  # then . or -
    (["x-UD-Q4_K_XL.gguf", "x-Q4_K_XL.gguf"], "UD-Q4_K_XL", "x-UD-Q4_K_XL.gguf"),
    (["mmproj-a-Q8_0.gguf", "a-Q8_0.gguf", "README.md"], "Q8_0", "a-Q8_0.gguf"),  # no projector,
    (["a-Q8_0.imatrix.gguf", "a-Q8_0.gguf"], "", "a-Q8_0.gguf"),  # importance matrix,
    (["mtp-a-Q8_0.gguf", "eagle3-a.gguf", "a-Q8_0.gguf"], "Q8_0", "a-Q8_0.gguf"),  # draft head
    (["Q4_K_M/a-Q4_K_M-00002-of-00002.gguf", "Q4_K_M/a-Q4_K_M-00001-of-00002.gguf"], "",
     "Q4_K_M/a-Q4_K_M-00001-of-00002.gguf"),  # a split model: its first part
    (["Q4_K_M-GGUF/model.gguf"], "Q4_K_M", "Q4_K_M-GGUF/model.gguf"),  # the path, not the name
])
def test_the_quant_picks_the_file(files: list[str], quant: str, expected: str) -> None:
    assert pick(files, quant) == expected


@pytest.mark.parametrize(("files", "quant", "said"), [
    (["a-Q4_K_M.gguf"], "Q4_K", "no GGUF file of quant Q4_K in it (there are: a-Q4_K_M.gguf)"),
    (["a-Q8_0.gguf"], "Q4_K_M", "no GGUF file of quant Q4_K_M"),  # a tag never falls back
    (["mmproj-a.gguf", "README.md"], "", "it holds no GGUF model file"),
    (["README.md"], "Q8_0", "it holds no GGUF model file"),
])
def test_a_tag_that_finds_nothing_says_what_there_is(files: list[str], quant: str,
                                                     said: str) -> None:
    with pytest.raises(ValueError) as e:
        pick(files, quant)
    assert str(e.value).startswith(said)


def test_a_split_model_is_every_part_of_it() -> None:
    files = ["Q8_0/a-Q8_0-00003-of-00003.gguf", "Q8_0/a-Q8_0-00001-of-00003.gguf",
             "Q8_0/a-Q8_0-00002-of-00003.gguf", "Q4_K_M/a-Q4_K_M-00001-of-00002.gguf",
             "a-Q8_0-00001-of-00002.gguf", "mmproj-F16.gguf"]
    assert parts(files, pick(files, "Q8_0")) == [
        "Q8_0/a-Q8_0-00001-of-00003.gguf", "Q8_0/a-Q8_0-00002-of-00003.gguf",
        "Q8_0/a-Q8_0-00003-of-00003.gguf"]
    assert parts(files, "mmproj-F16.gguf") == ["mmproj-F16.gguf"]
    with pytest.raises(ValueError, match="part of 2 files, and 1 of them"):
        parts(files, "Q4_K_M/a-Q4_K_M-00001-of-00002.gguf")
    assert split_tag("unsloth/Qwen3-GGUF:UD-Q4_K_XL") == ("unsloth/Qwen3-GGUF", "UD-Q4_K_XL")
    assert split_tag("u/m") == ("u/m", "")


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


def test_hf_of_a_split_model_takes_every_part(tmp_path: Path) -> None:
    names = [f"m-Q4_K_M-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    cache = hub_cache(tmp_path, {**{n: None for n in names}, "m-Q8_0.gguf": None})
    snap = cache / ("models--" + REPO.replace("/", "--")) / "snapshots" / COMMIT
    with pytest.MonkeyPatch.context() as mp:
        import huggingface_hub.constants as hf  # read from the environment once, at import

        mp.setattr(hf, "HF_HUB_CACHE", str(cache))
        mp.setattr(hf, "HF_HUB_OFFLINE", True)
        assert serve_config(["-hf", REPO]).model_path == str(snap / names[0])
        (snap / names[2]).unlink()  # a part missing from the cache: said, not loaded half
        with pytest.raises(SystemExit) as e:
            serve_config(["-hf", REPO])
        assert "is part of 3 files, and 2 of them are in the repository" in str(e.value)


@pytest.mark.model
def test_a_split_model_loads_through_the_worker_from_the_cache(tmp_path: Path) -> None:
    """A real split of the default model (written as llama.cpp's gguf-split lays one out),
    in the Hugging Face cache: -hf picks its first part, llama.cpp loads the rest from beside
    it in the worker, and it answers."""
    real = Path(model_file("smollm2"))
    split = write_split(real, tmp_path / "split" / "SmolLM2-Q4_1-00001-of-00003.gguf", 3)
    cache = hub_cache(tmp_path, {p.name: p for p in split})
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    with running(tmp_path, "-hf", REPO + ":Q4_1", "--disk-prefix-cache", "off",
                 env=env) as srv:
        assert srv.get_json("/props")["model_path"].endswith(split[0].name)
        c = openai.OpenAI(base_url=srv.v1, api_key="k", max_retries=0, timeout=120)
        r = c.chat.completions.create(model="m", max_tokens=3, temperature=0,
                                      messages=[{"role": "user", "content": "hi"}])
        assert r.choices[0].message.content is not None


DRAFT = "pg-test/SmolLM2-draft-GGUF"
TOKEN = "hf_s3cretT0ken0123456789"


@contextlib.contextmanager
def hub_at(answer: int = 401) -> Iterator[list[tuple[str, str, str]]]:
    """A listener where the hub would be, on loopback (the real hub cannot be reached from the
    tests): it records each request (method, path, its Authorization header) and answers the
    hub's probe with 200, anything else with `answer`."""
    seen: list[tuple[str, str, str]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            seen.append((self.command, self.path, self.headers.get("Authorization", "")))
            code = 200 if self.path == "/" else answer
            body = b"" if code == 200 else b'{"error": "Invalid credentials in Authorization"}'
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        do_GET = do_HEAD = _answer

        def log_message(self, *_: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        import huggingface_hub.constants as hf  # read from the environment once, at import

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(hf, "ENDPOINT", f"http://127.0.0.1:{srv.server_address[1]}")
            mp.setattr(hf, "HF_HUB_OFFLINE", False)
            yield seen
    finally:
        srv.shutdown()
        srv.server_close()


def test_the_draft_model_comes_from_its_own_repository(tmp_path: Path) -> None:
    """llama-server's -hfd (and its other spellings, and its variable): the draft model's GGUF
    picked by its quant as -hf picks the model's; with it, -md names the file in that
    repository; --offline takes both from the cache and asks the hub nothing."""
    cache = hub_cache(tmp_path, {"m-Q4_K_M.gguf": None})
    hub_cache(tmp_path, {"d-Q4_K_M.gguf": None, "d-Q8_0.gguf": None, "sub/d-F16.gguf": None},
              DRAFT)
    snap = cache / ("models--" + DRAFT.replace("/", "--")) / "snapshots" / COMMIT
    import huggingface_hub.constants as hf

    with hub_at() as seen, pytest.MonkeyPatch.context() as mp:
        mp.setattr(hf, "HF_HUB_CACHE", str(cache))
        for argv, env, file in [
                (["-hf", REPO, "-hfd", DRAFT, "--offline"], {}, "d-Q4_K_M.gguf"),
                (["-hf", REPO, "--hf-repo-draft", DRAFT + ":q8_0", "--offline"], {},
                 "d-Q8_0.gguf"),
                (["-hf", REPO, "-hfrd", DRAFT, "-md", "sub/d-F16.gguf", "--offline"], {},
                 "sub/d-F16.gguf"),
                (["-hf", REPO, "--spec-draft-hf", DRAFT + ":Q8_0"], {"LLAMA_ARG_OFFLINE": "1"},
                 "d-Q8_0.gguf"),
                (["-hf", REPO], {"LLAMA_ARG_SPEC_DRAFT_HF_REPO": DRAFT,
                                 "PREFIXGATE_OFFLINE": "true"}, "d-Q4_K_M.gguf")]:
            cfg = serve_config(argv, environ=env)
            assert cfg.spec_draft_model == str(snap / file), argv
            assert "draft-simple" in cfg.spec_type, "a draft model means draft-simple"
        assert seen == [], "offline, the hub is asked nothing"
        with pytest.raises(SystemExit) as e:
            serve_config(["-hf", REPO, "-hfd", DRAFT + ":IQ2_XS", "--offline"], environ={})
        assert str(e.value).startswith(f"prefixgate: -hfd {DRAFT}:IQ2_XS: no GGUF file of quant")
        # an absolute draft path is a file here and wins (what a worker is given)
        assert serve_config(["-hf", REPO, "-hfd", DRAFT, "-md", "/models/d.gguf", "--offline"],
                            environ={}).spec_draft_model == "/models/d.gguf"


def test_the_hub_token_reaches_the_hub_and_nothing_else(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    """llama-server's -hft, and its variable HF_TOKEN: sent to the hub as its bearer token;
    the start says what the hub answered (not "unreachable"), and shows no token."""
    import huggingface_hub.constants as hf

    cache = hub_cache(tmp_path, {"m-Q4_K_M.gguf": None})
    with hub_at(401) as seen, pytest.MonkeyPatch.context() as mp:
        mp.setattr(hf, "HF_HUB_CACHE", str(cache))
        for argv, env in [(["-hf", "pg-test/gated-GGUF", "-hft", TOKEN], {}),
                          (["-hf", "pg-test/gated-GGUF"], {"HF_TOKEN": TOKEN}),
                          (["-hf", REPO, "-hfd", "pg-test/gated-GGUF", "--hf-token", TOKEN],
                           {})]:
            seen.clear()
            with pytest.raises(SystemExit) as e:
                serve_config(argv, environ=env)
            assert "pg-test/gated-GGUF" in str(e.value) and TOKEN not in str(e.value)
            assert "the hub refused it" in str(e.value) and "401" in str(e.value), e
            asked = [(m, a) for m, path, a in seen if path != "/"]
            assert asked and all(a == f"Bearer {TOKEN}" for _, a in asked), seen
        assert TOKEN not in capsys.readouterr().err
        with pytest.raises(SystemExit) as e:  # an invalid value of it is not shown either
            serve_config(["--offline=maybe", "-hft", TOKEN], environ={})
        assert TOKEN not in str(e.value)


def test_offline_asks_the_hub_nothing(tmp_path: Path) -> None:
    """Without --offline the hub is probed first; with it, never (as HF_HUB_OFFLINE=1)."""
    import huggingface_hub.constants as hf

    cache = hub_cache(tmp_path, {"m-Q4_K_M.gguf": None})
    with hub_at(404) as seen, pytest.MonkeyPatch.context() as mp:
        mp.setattr(hf, "HF_HUB_CACHE", str(cache))
        serve_config(["-hf", REPO, "--offline"], environ={})
        assert seen == []
        with contextlib.suppress(SystemExit):
            serve_config(["-hf", REPO], environ={})
        assert seen[:1] == [("HEAD", "/", "")], seen
