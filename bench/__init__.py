"""Measuring prefixgate: trace replay with arms and a peer, a policy simulator, synthetic traces,
and the proxy's own overhead.

    bench.trace      load JSONL traces (Anthropic Messages or OpenAI chat rows) as OpenAI bodies
    bench.prompts    the proxy's own parse -> normalize -> render -> tokenize path, off-server
    bench.oracle     the fewest fresh prefill tokens any prefix cache could achieve on a trace
    bench.simulate   `prefixgate simulate`: the real policies on token ids, no model
    bench.replay     `make bench`: real proxies (and llama-cpp-python's server) replaying a trace
    bench.synth      `make synth`: synthetic long agent sessions in the Anthropic trace format
    bench.overhead   `make overhead`: the proxy's cost per request against the worker's
    bench.quick      `make bench-quick`: two quick live and disk reuse ratios on the real model

Results land in bench/results/ as JSON, a markdown table and (replay) a PNG plot.
"""
