"""llama-server's `--api-prefix /llama`: every endpoint below the prefix (both SDKs, the llama
endpoints, the status page and its links), nothing outside it, and the API's own error shapes
below it."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import anthropic
import openai
import pytest

from proxy.cli import serve_config
from tests.conftest import http_get, running


@pytest.mark.model
def test_every_endpoint_is_below_the_prefix(tmp_path: Path) -> None:
    with running(tmp_path, "--api-prefix", "/llama", "--disk-prefix-cache", "off") as srv:
        assert srv.url.endswith("/llama") and srv.get_json("/health")["status"] == "ok"
        root = srv.url.removesuffix("/llama")
        assert http_get(root + "/health")[0] == 404, "nothing outside the prefix"
        oa = openai.OpenAI(base_url=srv.v1, api_key="k", max_retries=0, timeout=120)
        r = oa.chat.completions.create(model="m", max_tokens=3, temperature=0,
                                       messages=[{"role": "user", "content": "hi"}])
        assert r.choices[0].message.content is not None
        an = anthropic.Anthropic(base_url=srv.url, api_key="k", max_retries=0, timeout=120)
        assert an.messages.create(model="m", max_tokens=3, messages=[
            {"role": "user", "content": "hi"}]).content
        with pytest.raises(anthropic.BadRequestError) as e:  # Anthropic's shape below it too
            an.messages.create(model="m", max_tokens=3, messages=[])
        assert e.value.body["type"] == "error"  # type: ignore[index]
        assert srv.get_json("/props")["default_generation_settings"]["n_ctx"] > 0
        status, body = srv.get("/tokenize?x=1")
        assert status in (404, 405) and json.loads(body)["error"]  # an API error, not HTML
        page = srv.get("/")[1]
        assert 'href="/llama/health"' in page and 'href="/llama/metrics"' in page
        # a web page's preflight below the prefix (proxy/cors.py: localhost's pages by default)
        pre = urllib.request.Request(srv.v1 + "/chat/completions", method="OPTIONS", headers={
            "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"})
        with urllib.request.urlopen(pre, timeout=30) as resp:
            assert resp.status == 200
            assert resp.headers["Access-Control-Allow-Origin"] == "http://localhost:3000"


@pytest.mark.parametrize("prefix", ["llama", "/llama/", "/a//b", "/{x}"])
def test_a_prefix_that_is_not_a_path_is_one_line(prefix: str) -> None:
    with pytest.raises(SystemExit) as e:
        serve_config(["-m", "m.gguf", "--api-prefix", prefix], environ={})
    assert "--api-prefix" in str(e.value) and "\n" not in str(e.value)
    assert serve_config(["-m", "m.gguf"], environ={"LLAMA_ARG_API_PREFIX": "/v"}).api_prefix \
        == "/v"
