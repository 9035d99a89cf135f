"""bench.spec_return's table: medians of the rounds per arm, where the draft model's prompt
came from, and each arm's returning answer against prefixgate's."""

from __future__ import annotations

from bench.spec_return import file_text, markdown


def _row(arm: str, a2: float, text: str, draft: dict[str, int] | None = None) -> dict[str, object]:
    return {"arm": arm, "a1": {"s": 10.0, "prompt": 2200, "text": "x"},
            "b": {"s": 20.0, "prompt": 3300, "text": "y"},
            "a2": {"s": a2, "prompt": 2282, "text": text}, "draft_prompt": draft}


def test_the_table_takes_each_arms_median_and_compares_the_answers() -> None:
    counts = {"kept": 0, "restored": 2195, "copied": 0, "prefilled": 5612}
    rows = [_row("prefixgate", 2.0, "same", counts), _row("base", 7.0, "same", None),
            _row("llama-server", 1.5, "other"), _row("prefixgate", 2.2, "same", counts),
            _row("base", 8.0, "same", None), _row("llama-server", 1.7, "other")]
    lines = markdown(rows, "cmd").splitlines()
    assert "2 round(s)" in lines[0]
    body = {line.split(" | ")[0].lstrip("| "): line for line in lines if line.startswith("| ")}
    assert "**2.10**" in body["prefixgate"] and "0 / 2195 / 0 / 5612" in body["prefixgate"]
    assert "**7.50**" in body["base"] and body["base"].endswith("| same |")
    assert "**1.60**" in body["llama-server"] and body["llama-server"].endswith("| differs |")


def test_the_file_has_the_lines_asked() -> None:
    assert len(file_text(180).splitlines()) == 180


def test_after_a_restart_the_table_reads_the_third_turn_as_the_return() -> None:
    def row(arm: str, a3: float, text: str) -> dict[str, object]:
        return {"arm": arm, "a1": {"s": 10.0, "prompt": 2200, "text": "x"},
                "a2": {"s": 2.0, "prompt": 2300, "text": "y"}, "b": {"s": 4.0},
                "a3": {"s": a3, "prompt": 2400, "text": text}, "draft_prompt": None}

    lines = markdown([row("prefixgate", 2.0, "same"), row("llama-server", 9.0, "other")],
                     "cmd").splitlines()
    assert "restart (up again)" in lines[2] and "**a3 (the return)**" in lines[2]
    assert lines[3].count("|") == lines[2].count("|")
    body = {line.split(" | ")[0].lstrip("| "): line for line in lines[4:]}
    assert body["prefixgate"].startswith("| prefixgate | 10.00 | 2.00 | 4.00 | **2.00** | 2400")
    assert body["llama-server"].endswith("| differs |")
