"""bench.spec_share's table: medians of the rounds per arm, and where the streaming session
ended before the newcomer did (its longest gap then means nothing)."""

from __future__ import annotations

from bench.spec_share import markdown


def _row(arm: str, gap: float, chunks: int, early: bool = False) -> dict[str, object]:
    return {"arm": arm, "a_gap_before_s": 0.02, "a_longest_gap_during_b_s": gap,
            "a_chunks_during_b": chunks, "a_ended_before_b": early, "b_s": 18.0,
            "b_prompt": 2195}


def test_the_table_takes_each_arms_median_and_says_where_the_stream_ended_first() -> None:
    rows = [_row("prefixgate", 1.6, 400), _row("base", 6.0, 190),
            _row("llama-server", 10.8, 24, early=True), _row("prefixgate", 1.8, 420),
            _row("base", 5.8, 200), _row("llama-server", 11.0, 20)]
    lines = markdown(rows, "cmd").splitlines()
    assert "2 round(s)" in lines[0]
    body = {line.split(" | ")[0].lstrip("| "): line for line in lines if line.startswith("| ")}
    assert "**1.70**" in body["prefixgate"] and "| 410 |" in body["prefixgate"]
    assert "**5.90**" in body["base"] and "ended first" not in body["base"]
    assert "**10.90**" in body["llama-server"] and "(a ended first in 1)" in body["llama-server"]
