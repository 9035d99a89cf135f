"""policies.costs: the fits recover the cost models they are fed, and `pays` / `decide`
restore only what is faster than prefilling it (issue 21's "restore only when it pays")."""

from __future__ import annotations

import pytest

from policies.costs import Costs, Fit, pays
from policies.decide import Facts, Hit, Stored, WorkerFacts, decide
from policies.plan import CacheKnobs
from policies.scope import parse_scope


def gpu_like() -> Costs:
    """Prefill 20,000 tokens/s plus attention (1e-9 s per token per position); a disk read at
    1 GB/s after 20 ms; RAM at 20 GB/s after 1 ms."""
    c = Costs()
    for start, end in [(0, 1024), (0, 4096), (2048, 8192), (0, 16384), (8192, 32768)]:
        m, s = end - start, (start + end - 1) * (end - start) / 2
        c = c.add_prefill(start, end, m / 20_000 + 1e-9 * s)
    for nbytes in (5e6, 80e6, 400e6, 40e6):
        c = c.add_restore("disk", int(nbytes), 0.020 + nbytes / 1e9)
        c = c.add_restore("ram", int(nbytes), 0.001 + nbytes / 20e9)
    return c


def test_the_fits_recover_the_costs_they_were_fed() -> None:
    c = gpu_like()
    a, b = c.prefill.solve()
    # (within 1%: the small ridge on the second coefficient)
    assert a == pytest.approx(1 / 20_000, rel=1e-2) and b == pytest.approx(1e-9, rel=1e-2)
    assert c.restore_s(100_000_000, "disk") == pytest.approx(0.120, rel=1e-2)
    assert c.restore_s(100_000_000, "ram") == pytest.approx(0.006, rel=1e-2)
    assert c.prefill_s(0, 4096) == pytest.approx(4096 / 20_000 + 1e-9 * 4095 * 4096 / 2,
                                                 rel=1e-2)
    summary = c.summary()
    assert summary["samples"] == {"prefill": 5, "disk": 4, "ram": 4, "shared": 0, "decode": 0}
    assert summary["disk_restore"]["bytes_per_s"] == pytest.approx(1e9, rel=1e-2)
    assert set(summary["prefill_tokens_per_s"]) == {"1024", "4096", "16384", "32768"}
    assert Costs.from_wire(c.to_wire()) == c


def test_a_decode_step_is_the_mean_of_the_recent_ones_and_an_older_worker_has_none() -> None:
    c = Costs().add_decode(0.02).add_decode(0.02).add_decode(0.0)  # no time: no sample
    assert c.decode.n == 2 and c.decode_step_s() == pytest.approx(0.02)
    assert c.summary()["decode_step_s"] == 0.02
    assert Costs.from_wire(c.to_wire()) == c
    older = {k: v for k, v in c.to_wire().items() if k != "decode"}
    assert Costs.from_wire(older).decode.n == 0


def test_one_shape_of_sample_is_all_rate_no_fixed_cost() -> None:
    """Restores of one size cannot tell a fixed cost from a rate: the rate explains them, so
    a state twice the size is estimated at twice the time."""
    c = Costs().add_restore("disk", 1000, 0.5).add_restore("disk", 1000, 0.5)
    assert c.restore_s(2000, "disk") == pytest.approx(1.0, rel=1e-2)
    f = Fit().add(100, 0, 1.0)  # a prefill from 0 of one token: positions sum to 0
    assert f.solve() == (pytest.approx(0.01), 0.0)


@pytest.mark.parametrize(("keep", "n", "nbytes", "source", "expected"), [
    (0, 32768, 1_000_000_000, "disk", True),  # 1.0 s of reading beats 2.2 s of prefill
    (0, 32768, 3_000_000_000, "disk", False),  # 3.0 s does not
    (0, 1024, 60_000_000, "disk", False),  # 80 ms to read vs 52 ms to prefill: prefill
    (0, 1024, 60_000_000, "ram", True),  # 4 ms from RAM
    (16000, 16384, 1_500_000_000, "disk", False),  # 384 tokens left to gain: prefill them
])
def test_pays_compares_the_estimates(keep: int, n: int, nbytes: int, source: str,
                                     expected: bool) -> None:
    c = gpu_like()
    assert pays(c, keep, n, nbytes, source) is expected  # type: ignore[arg-type]
    faster = c.restore_s(nbytes, source) < c.prefill_s(keep, n)  # type: ignore[arg-type]
    assert faster is expected


def test_unmeasured_costs_always_pay() -> None:
    assert pays(None, 0, 64, 10**12, "disk")
    assert pays(Costs().add_prefill(0, 64, 1.0), 0, 64, 10**12, "disk")  # no restore yet


def test_decide_offers_only_the_entries_that_pay() -> None:
    ids = tuple(range(2048))
    facts = Facts(ids, (), parse_scope("full"))
    stored = Stored((Hit(1024, b"k1", "f1", 60_000_000), Hit(512, b"k2", "f2", 30_000_000)),
                    frozenset({512, 1024}))
    knobs = CacheKnobs()
    fresh = decide(facts, stored, WorkerFacts(0, True), [], knobs)
    assert [r.n_tokens for r in fresh.restore] == [1024, 512] and fresh.restore_skipped is None
    gpu = decide(facts, stored, WorkerFacts(0, True, costs=gpu_like()), [], knobs)
    assert gpu.restore == () and gpu.lookup != "miss"  # found, and prefilled
    assert gpu.restore_skipped is not None and gpu.restore_skipped.startswith("1024 tokens:")
    slow_prefill = Costs().add_prefill(0, 2048, 60.0).add_restore("disk", 60_000_000, 0.06)
    cpu = decide(facts, stored, WorkerFacts(0, True, costs=slow_prefill), [], knobs)
    assert [r.n_tokens for r in cpu.restore] == [1024, 512] and cpu.restore_skipped is None
