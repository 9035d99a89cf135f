"""The suite's llama.cpp settings, for every test and every server and worker it starts (they
inherit the environment): batches of 64 tokens and no flash attention unless the environment
says otherwise. The product's defaults differ (on a CPU batches of 128 with flash attention
auto, policies.prefix.default_batch); a test's prompts are sized in batches, so at 64 they
prefill half the tokens, and the batch rule is the same at any size.
`tests/proxy/test_defaults.py` runs a server at the product's defaults. A few tests name
64-token edges in their numbers (tests/backend/test_memory.py's save points): at another size
they fail on those numbers, not on exactness."""

import os

os.environ.setdefault("PREFIXGATE_UBATCH_SIZE", "64")
os.environ.setdefault("PREFIXGATE_FLASH_ATTN", "off")
