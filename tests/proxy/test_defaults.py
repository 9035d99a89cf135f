"""The product's own llama.cpp settings, which the rest of the suite overrides (tests/__init__.py:
batches of 64, no flash attention): a server at the defaults (512 with GPU layers; on a CPU 128
or 512 as the worker measures once and remembers, issue 41; `-fa auto`, llama-server's, on
here) runs batches of that size, says how it chose it, proves exact reuse at start, reuses a
follow-up turn up to the end of its last shared message, and answers it as a cold run does."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from policies.prefix import CPU_BATCH, GPU_BATCH, default_batch
from tests.conftest import Server, running
from tests.proxy.test_openai import SYSTEM, chat

pytestmark = pytest.mark.model

DEFAULTS = {"PREFIXGATE_UBATCH_SIZE": "0", "PREFIXGATE_FLASH_ATTN": "auto"}  # 0: the default
GPU_LAYERS = int(os.environ.get("PREFIXGATE_N_GPU_LAYERS", "0"))


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    tmp: Path = tmp_path_factory.mktemp("defaults")
    with running(tmp / "a", "--workers", "1", env=DEFAULTS) as srv, \
            running(tmp / "cold", "--workers", "1", "--disk-prefix-cache", "off",
                    env=DEFAULTS) as cold:
        yield srv, cold


def test_the_defaults_reuse_a_follow_up_exactly(servers: tuple[Server, Server]) -> None:
    srv, cold_srv = servers
    props = srv.get_json("/props")
    batch = props["ubatch_size"]
    if GPU_LAYERS == 0:  # measured on this CPU, or remembered from an earlier start
        assert batch in (CPU_BATCH, GPU_BATCH)
        assert re.fullmatch(rf"prefill batch {batch} on this CPU \(\d+ tokens into a prompt a "
                            r"token prefills [\d.]+x as fast in batches of 512 as of 128, "
                            r"(measured at start in [\d.]+ s|remembered); -ub sets it\)",
                            props["ubatch_note"]), props["ubatch_note"]
        assert props["ubatch_note"] in srv.log()  # the ready line says it
        assert cold_srv.get_json("/props")["ubatch_size"] == batch  # the same machine's measure
    else:
        assert (batch, props["ubatch_note"]) == (default_batch(GPU_LAYERS), "")
    proven = re.search(r"exact reuse proven .*batch (\d+)\)", srv.log())
    assert proven is not None and proven.group(1) == str(batch), srv.log()[-2000:]
    first = [{"role": "system", "content": SYSTEM * 7},
             {"role": "user", "content": "Explain what a reverse proxy does. " + SYSTEM}]
    r1, _ = chat(srv, first, max_tokens=24)
    assert r1.usage.prompt_tokens > batch  # past the first batch
    second = [*first, {"role": "assistant", "content": r1.choices[0].message.content},
              {"role": "user", "content": "And why would it cache state on disk?"}]
    r2, h2 = chat(srv, second, max_tokens=24)
    # up to the end of the first prompt's last message (a batch ends there: it holds more
    # than an eighth of a batch, policies.prefix.Batching): only the generation prompt's 5 tokens
    # are evaluated again
    assert r2.usage.prompt_tokens_details.cached_tokens == r1.usage.prompt_tokens - 5
    assert h2["x-prefixgate-cache-source"] == "live"
    cold, _ = chat(cold_srv, second, max_tokens=24)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0, "the reference must be cold"
    assert r2.choices[0].message.content == cold.choices[0].message.content
