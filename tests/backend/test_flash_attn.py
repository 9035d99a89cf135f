"""`--flash-attn auto` as a worker resolves it (`backend.context.resolve_flash_attn`): off on a
CPU with several slots under `--deterministic on`, where decode steps then batch exactly;
llama.cpp's choice elsewhere (with `auto` and `off` a deep prompt prefills up to 2x faster with
it on, and answers may depend on other sessions anyway)."""

from __future__ import annotations

import pytest

from backend.context import Memory, resolve_flash_attn

PLAIN, WINDOW, RECURRENT = Memory("plain"), Memory("window", 512, True), Memory("recurrent")


@pytest.mark.parametrize(("given", "cpu_only", "slots", "type_v", "memory", "want"), [
    ("auto", True, 3, "f16", PLAIN, "off"),  # several CPU slots: decode steps may batch
    ("auto", True, 2, "bf16", WINDOW, "off"),
    ("auto", True, 1, "f16", PLAIN, "auto"),  # one slot: nothing to batch
    ("auto", False, 3, "f16", PLAIN, "auto"),  # a GPU: not measured there, llama.cpp decides
    ("auto", True, 3, "q8_0", PLAIN, "auto"),  # a quantized V cache needs flash attention
    ("auto", True, 3, "f16", RECURRENT, "auto"),  # a hybrid's steps differ batched either way
    ("on", True, 3, "f16", PLAIN, "on"),  # said outright: as said
    ("off", False, 1, "f16", PLAIN, "off"),
])
def test_resolve_flash_attn(given: str, cpu_only: bool, slots: int, type_v: str, memory: Memory,
                            want: str) -> None:
    assert resolve_flash_attn(given, cpu_only=cpu_only, n_seq=slots, type_v=type_v,
                              memory=memory, deterministic="on") == want
    # auto and off: llama.cpp's own choice, whatever the slots
    for deterministic in ("auto", "off"):
        assert resolve_flash_attn(given, cpu_only=cpu_only, n_seq=slots, type_v=type_v,
                                  memory=memory, deterministic=deterministic) == given
