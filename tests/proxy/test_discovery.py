"""What agent clients learn by probing: the served model and its context, and no false claim
to be another server kind (Hermes probes LM Studio, Ollama, llama.cpp and vLLM paths in turn
and trusts the first that answers)."""

from __future__ import annotations

import json

import anthropic

from tests.conftest import N_CTX, Server

MODEL = "SmolLM2-135M-Instruct.Q4_1"


def test_not_lm_studio_ollama_or_vllm(server: Server) -> None:
    for path in ("/api/v1/models", "/api/tags", "/version", "/api/show"):
        status, _ = server.get(path)
        assert status == 404, path


def test_props_report_the_real_context_and_volatile_patterns(server: Server) -> None:
    props = server.get_json("/props")
    assert props["default_generation_settings"]["n_ctx"] == N_CTX
    assert props["n_ctx"] == N_CTX
    assert props["volatile_patterns"] and "billing" in props["volatile_patterns"][0]


def test_model_by_id_in_both_apis_fields(server: Server) -> None:
    for name in (MODEL, "claude-sonnet-4-6"):  # any name is the served model
        body = server.get_json(f"/v1/models/{name}")
        assert body["id"] == MODEL
        assert body["context_length"] == body["max_model_len"] == N_CTX
    info = anthropic.Anthropic(base_url=server.url, api_key="k", max_retries=0).models \
        .retrieve(MODEL)
    assert info.id == MODEL and info.type == "model"


def test_models_list_carries_context_length(server: Server) -> None:
    status, body = server.get("/v1/models")
    assert status == 200
    (m,) = json.loads(body)["data"]
    assert m["id"] == MODEL and m["context_length"] == N_CTX
