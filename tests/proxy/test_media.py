"""Images reach a text-only model as a text placeholder, through the official SDKs against the
real server: the request answers (no 400), its next turn with the image in the history too,
each request says so in one log line, the metric counts every block, /props shows the mode,
and the prompt holds exactly the placeholder (counted tokens equal those of the same text).
The tables of what each API's parser makes of media are in test_parse.py."""

from __future__ import annotations

import json
import re
import urllib.request

import anthropic
import openai

from proxy.chat import placeholder
from tests.conftest import Server

PNG = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}
LINE = {"openai": "openai: 1 image replaced by a text placeholder: this model reads text only",
        "anthropic": "anthropic: 2 images replaced by a text placeholder: this model reads "
                     "text only"}


def images_counted(srv: Server) -> float:
    metrics = srv.get("/metrics")[1]
    found = re.search(r'^prefixgate_media_placeholders_total\{kind="image"\} (\S+)$', metrics,
                      re.M)
    assert found is not None, "the metric is exported from the start"
    return float(found.group(1))


def test_an_image_over_the_openai_sdk(server: Server) -> None:
    c = openai.OpenAI(base_url=server.v1, api_key="k", max_retries=0, timeout=600)
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]
    counted, said = images_counted(server), server.log().count(LINE["openai"])
    r = c.chat.completions.create(model="m", messages=messages,  # type: ignore[arg-type]
                                  max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert images_counted(server) == counted + 1
    assert server.log().count(LINE["openai"]) == said + 1
    props = server.get_json("/props")
    assert props["media"] == {"mode": "placeholder", "placeholder": placeholder("image")}
    # the prompt holds the placeholder on a line of its own
    req = urllib.request.Request(server.url + "/apply-template",
                                 json.dumps({"messages": messages}).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        prompt = json.loads(resp.read())["prompt"]
    assert f"What is in this picture?\n{placeholder('image')}" in prompt


def test_a_screenshot_and_a_read_png_over_the_anthropic_sdk(server: Server) -> None:
    """A pasted screenshot and Claude Code's Read of a PNG (an image in a tool result): the
    turn answers, and so does the next one with both in its history."""
    c = anthropic.Anthropic(base_url=server.url, api_key="k", max_retries=0, timeout=600)
    tools = [{"name": "Read", "description": "Read a file.",
              "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}}}]
    history = [
        {"role": "user", "content": [{"type": "text", "text": "Here is the bug:"},
                                     {"type": "image", "source": PNG}]},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "Read",
             "input": {"file_path": "shot.png"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "image", "source": PNG}]}]}]
    counted, said = images_counted(server), server.log().count(LINE["anthropic"])
    first = c.messages.create(model="m", max_tokens=4, messages=history,  # type: ignore[arg-type]
                              tools=tools, extra_body={"temperature": 0})  # type: ignore[arg-type]
    assert first.stop_reason in ("end_turn", "max_tokens", "tool_use")
    follow = [*history, {"role": "assistant", "content": "I see."},
              {"role": "user", "content": "Fix it."}]
    second = c.messages.create(model="m", max_tokens=4, messages=follow,  # type: ignore[arg-type]
                               tools=tools, extra_body={"temperature": 0})  # type: ignore[arg-type]
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert images_counted(server) == counted + 4  # two a request
    assert server.log().count(LINE["anthropic"]) == said + 2
    # the placeholder is exactly what the template rendered: the same count as its text
    as_text = [
        {"role": "user", "content": f"Here is the bug:\n\n{placeholder('image')}"},
        history[1],
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": placeholder("image")}]}]
    n = c.messages.count_tokens(model="m", messages=history, tools=tools)  # type: ignore
    assert n.input_tokens == c.messages.count_tokens(
        model="m", messages=as_text, tools=tools).input_tokens  # type: ignore[arg-type]
