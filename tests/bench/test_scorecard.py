"""`make simulate-all`: every trace of a directory simulated, and the promises checked."""

from __future__ import annotations

import json
from pathlib import Path

from bench.interleaved import Knobs, generate
from bench.scorecard import main


def test_every_trace_of_a_directory(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    traces = tmp_path / "traces"
    traces.mkdir()
    for name, k in (("two", Knobs(sessions=2, turns=3, changed=1, system_tokens=300,
                                  tail_tokens=20)),
                    ("one", Knobs(sessions=1, turns=3, changed=0, system_tokens=300,
                                  tail_tokens=20))):
        (traces / f"{name}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in generate(k)))
    main(["--out", str(tmp_path / "out"), "--policies", "auto:2,auto:30", "--slots", "2",
          str(traces)])
    rows = json.loads((tmp_path / "out" / "summary.json").read_text())
    # per trace (in name order) and auto policy; full is simulated too, as the reference
    assert [(r["trace"], r["policy"]) for r in rows] == [
        ("one.jsonl", "auto:2"), ("one.jsonl", "auto:30"), ("two.jsonl", "auto:2"),
        ("two.jsonl", "auto:30")]
    assert all(r["holds"] for r in rows), rows
    table = json.loads((tmp_path / "out" / "simulate-two.json").read_text())
    assert {(r["policy"], r["mode"]) for r in table["results"]} == {
        (p, m) for p in ("auto:2", "auto:30", "full") for m in ("restart", "live", "live:2")}
    assert "Held: 4 of 4" in capsys.readouterr().out
