"""OpenAI's Responses API (Codex CLI's) through the official `openai` SDK against the real
server: the same answer as a chat completion of the same messages (one preparation, cache and
run), the cache reused on the next request, the Responses event sequence streamed (checked by
the SDK's own stream accumulator too), a forced function call non-streamed and streamed, a
second turn carrying the call and its output, errors in OpenAI's shape. The parser's tables
are in test_parse.py."""

from __future__ import annotations

import json

import openai
import pytest

from tests.conftest import Server

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object",
                          "properties": {"city": {"type": "string", "maxLength": 24}},
                          "required": ["city"], "additionalProperties": False}}
INSTRUCTIONS = "You are a helpful assistant. Answer in one short sentence."


def client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.v1, api_key="k", max_retries=0, timeout=600)


def test_the_answer_of_a_chat_completion_and_the_cache(server: Server) -> None:
    c = client(server)
    question = "Name a colour of the sky, and explain why it has that colour."
    r = c.responses.create(model="m", instructions=INSTRUCTIONS, input=question,
                           max_output_tokens=12, temperature=0)
    chat = c.chat.completions.create(
        model="m", max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": INSTRUCTIONS},
                  {"role": "user", "content": question}])
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == chat.choices[0].message.content
    assert [item.type for item in r.output] == ["message"]
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length"
                        else "completed")
    assert r.usage is not None and r.usage.input_tokens == chat.usage.prompt_tokens  # type: ignore[union-attr]
    assert r.usage.output_tokens == chat.usage.completion_tokens  # type: ignore[union-attr]
    # the chat completion reused what the response prefilled: one cache for both APIs
    assert chat.usage.prompt_tokens_details.cached_tokens > 0  # type: ignore[union-attr]


def test_the_streamed_event_sequence(server: Server) -> None:
    c = client(server)
    kw = {"model": "m", "instructions": INSTRUCTIONS, "input": "Say hello to the team.",
          "max_output_tokens": 10, "temperature": 0}
    whole = c.responses.create(**kw)  # type: ignore[call-overload]
    events = list(c.responses.create(stream=True, **kw))  # type: ignore[call-overload]
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = types.count("response.output_text.delta")
    assert deltas >= 1 and types == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * deltas,
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        f"response.{whole.status}"]
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == whole.output_text == events[-1].response.output_text
    # the SDK's own accumulator takes the sequence (it raises on an event out of place) and
    # builds the same text (an incomplete response has no final one: it was cut)
    with c.responses.stream(**kw) as stream:  # type: ignore[arg-type]
        helped = list(stream)
    snapshots = [e.snapshot for e in helped if e.type == "response.output_text.delta"]
    assert helped[-1].type == f"response.{whole.status}" and snapshots[-1] == whole.output_text


def test_a_forced_function_call_and_its_output(server: Server) -> None:
    c = client(server)
    kw = {"model": "m", "instructions": "Use the tools.", "input": "Weather in Paris?",
          "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
          "max_output_tokens": 40, "temperature": 0}
    r = c.responses.create(**kw)  # type: ignore[call-overload]
    calls = [item for item in r.output if item.type == "function_call"]
    assert [call.name for call in calls] == ["get_weather"]
    args = json.loads(calls[0].arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str)
    assert calls[0].call_id.startswith("call_") and calls[0].status == "completed"
    # streamed: the arguments as deltas that join to the call's, then done
    events = list(c.responses.create(stream=True, **kw))  # type: ignore[call-overload]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas and len(done) == 1 and "".join(deltas) == done[0].arguments
    assert json.loads(done[0].arguments) == args
    with c.responses.stream(**kw) as stream:  # type: ignore[arg-type]
        final = stream.get_final_response()
    assert [i.arguments for i in final.output if i.type == "function_call"] == [
        calls[0].arguments]
    # the next turn carries the call and its output, as Codex sends them
    turn = c.responses.create(
        model="m", instructions="Use the tools.", max_output_tokens=8, temperature=0,
        tools=[WEATHER],  # type: ignore[list-item]
        input=[{"role": "user", "content": "Weather in Paris?"},
               {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
                "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "Sunny, 21 C."}])
    assert turn.status in ("completed", "incomplete") and turn.output


def test_a_call_of_a_namespace_tool_names_its_namespace(server: Server) -> None:
    """Codex sends its sub-agent tools inside one `namespace` tool: the model can call them,
    and the call comes back as Codex reads it, named within its namespace."""
    c = client(server)
    agents = {"type": "namespace", "name": "multi_agent_v1",
              "description": "Tools for spawning and managing sub-agents.",
              "tools": [{**WEATHER, "name": "spawn_agent",
                         "description": "Start a sub-agent on a task."}]}
    body = {"model": "m", "input": "Spawn an agent for Paris.", "max_output_tokens": 40,
            "temperature": 0, "tools": [WEATHER, agents],
            "tool_choice": {"type": "function", "name": "spawn_agent"}}
    r = c.post("/responses", body=body, cast_to=object)
    calls = [item for item in r["output"] if item["type"] == "function_call"]  # type: ignore[index]
    assert [(i["namespace"], i["name"]) for i in calls] == [("multi_agent_v1", "spawn_agent")]
    events = [json.loads(line[6:]) for line in c.post(
        "/responses", body={**body, "stream": True}, cast_to=str).splitlines()
        if line.startswith("data: ")]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(i["namespace"], i["name"]) for i in done] == [("multi_agent_v1", "spawn_agent")]


def test_errors_in_openai_shape(server: Server) -> None:
    c = client(server)
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="m", input="Hi", previous_response_id="resp_1")
    assert e.value.body["param"] == "previous_response_id"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="m", input=[{"type": "item_reference", "id": "x"}])  # type: ignore[list-item]
    assert "item_reference" in e.value.message
