"""What reuse costs on one worker, measured as it runs, and whether a restore pays.

    Costs.prefill_s(start, end)      seconds to prefill positions start..end-1
    Costs.restore_s(nbytes, source)  seconds to restore a state of nbytes from "disk", "ram" or
                                     "shared"
    pays(costs, keep, n, nbytes, source) -> bool

Model:

- Prefill: each token at position p costs ``a + b*p`` seconds (the weights, then attention over
  the p tokens before it), so a prefill from ``start`` to ``end`` costs ``a*m + b*S`` with
  ``m = end - start`` tokens and ``S`` the sum of their positions. Fitted by least squares over
  the worker's recent prefills (time in llama_decode only, never waits on other slots), older
  samples decaying by ``DECAY`` per new one; ``b`` is held at 0 or above (a tiny ridge keeps it
  defined while every sample had the same shape).
- Restore: ``s0 + nbytes / rate`` per source (disk: read, verify, load; RAM: load; shared: pull
  from the shared tier, verify, load), fitted the
  same way over that source's restores; with one size seen only the rate is fitted (s0 = 0).
- Decode: the seconds of a decode step (every slot's token in it, as the steps run), the
  samples' decayed mean: what one more generated token costs a short request's slot
  (policies/preempt.py).
- A restore *pays* when its estimate is below the estimate of prefilling the tokens it would
  save (``keep`` to ``n``): then it is done, otherwise those tokens are prefilled. Until both
  sides have been measured (a fresh worker) it pays: a restore is how its cost is learnt, and
  it was the rule before there were estimates.

Pure: no clock, no I/O. The worker feeds samples and reports `to_wire()`; the proxy's `decide`
reads it back with `from_wire`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

Source = Literal["disk", "ram", "shared"]
DECAY = 0.9  # weight of the older samples after each new one (about the last 10 count)
RIDGE = 1e-3  # on the second coefficient: while every sample had one shape, the first explains
# them (per token for prefill, per byte for restores)


@dataclass(frozen=True, slots=True)
class Fit:
    """Decayed least squares of t = x1*c1 + x2*c2 (c2 lightly held towards 0): the sums of
    the normal equations."""

    s11: float = 0.0
    s12: float = 0.0
    s22: float = 0.0
    s1t: float = 0.0
    s2t: float = 0.0
    n: int = 0

    def add(self, x1: float, x2: float, t: float) -> Fit:
        d = DECAY
        return Fit(d * self.s11 + x1 * x1, d * self.s12 + x1 * x2, d * self.s22 + x2 * x2,
                   d * self.s1t + x1 * t, d * self.s2t + x2 * t, self.n + 1)

    def solve(self) -> tuple[float, float]:
        """(c1, c2), both at least 0: where c2 would go negative, c2 = 0 and c1 alone."""
        if self.n == 0 or self.s11 <= 0:
            return 0.0, 0.0
        s22 = self.s22 * (1 + RIDGE)
        det = self.s11 * s22 - self.s12 * self.s12
        if det > 0:
            c1 = (self.s1t * s22 - self.s2t * self.s12) / det
            c2 = (self.s2t * self.s11 - self.s1t * self.s12) / det
            if c1 >= 0 and c2 >= 0:
                return c1, c2
        return max(self.s1t / self.s11, 0.0), 0.0

    def to_wire(self) -> list[float]:
        return [self.s11, self.s12, self.s22, self.s1t, self.s2t, self.n]

    @classmethod
    def from_wire(cls, v: Any) -> Fit:
        if not isinstance(v, list) or len(v) != 6 or not all(
                isinstance(x, int | float) and not isinstance(x, bool) for x in v):
            raise ValueError(f"malformed fit {v!r}")
        s11, s12, s22, s1t, s2t = (float(x) for x in v[:5])
        return cls(s11, s12, s22, s1t, s2t, int(v[5]))


def _positions(start: int, end: int) -> float:
    """The sum of the positions start..end-1."""
    return (start + end - 1) * (end - start) / 2


@dataclass(frozen=True, slots=True)
class Costs:
    prefill: Fit = field(default_factory=Fit)  # t = a*tokens + b*sum(positions)
    disk: Fit = field(default_factory=Fit)  # t = (1/rate)*bytes + s0
    ram: Fit = field(default_factory=Fit)
    shared: Fit = field(default_factory=Fit)  # a pull from the shared tier, read and loaded
    decode: Fit = field(default_factory=Fit)  # t = step_s * 1: a decode step's seconds

    def add_prefill(self, start: int, end: int, seconds: float) -> Costs:
        if end <= start or seconds <= 0:
            return self
        return replace(self, prefill=self.prefill.add(end - start, _positions(start, end),
                                                      seconds))

    def add_restore(self, source: Source, nbytes: int, seconds: float) -> Costs:
        if nbytes <= 0 or seconds <= 0:
            return self
        return replace(self, **{source: self.fit(source).add(float(nbytes), 1.0, seconds)})

    def add_decode(self, seconds: float) -> Costs:
        return replace(self, decode=self.decode.add(1.0, 0.0, seconds)) if seconds > 0 else self

    def decode_step_s(self) -> float:
        return self.decode.solve()[0]

    def fit(self, source: Source) -> Fit:
        return {"disk": self.disk, "ram": self.ram, "shared": self.shared}[source]

    def known(self, source: Source) -> bool:
        return self.prefill.n > 0 and self.fit(source).n > 0

    def prefill_s(self, start: int, end: int) -> float:
        a, b = self.prefill.solve()
        return a * max(end - start, 0) + b * _positions(start, end) if end > start else 0.0

    def restore_s(self, nbytes: int, source: Source) -> float:
        per_byte, s0 = self.fit(source).solve()
        return s0 + per_byte * nbytes

    def to_wire(self) -> dict[str, Any]:
        return {"prefill": self.prefill.to_wire(), "disk": self.disk.to_wire(),
                "ram": self.ram.to_wire(), "shared": self.shared.to_wire(),
                "decode": self.decode.to_wire()}

    @classmethod
    def from_wire(cls, d: Any) -> Costs:
        if not isinstance(d, dict):
            raise ValueError(f"malformed costs {d!r}")
        return cls(Fit.from_wire(d["prefill"]), Fit.from_wire(d["disk"]),
                   Fit.from_wire(d["ram"]), Fit.from_wire(d["shared"]),
                   Fit.from_wire(d["decode"]) if "decode" in d else Fit())  # an older worker

    def summary(self, lengths: tuple[int, ...] = (1024, 4096, 16384, 32768)) -> dict[str, Any]:
        """What /props shows: prefill tokens/s of a whole prompt of each length, and each
        source's restore rate and fixed cost."""
        out: dict[str, Any] = {"samples": {"prefill": self.prefill.n, "disk": self.disk.n,
                                           "ram": self.ram.n, "shared": self.shared.n,
                                           "decode": self.decode.n}}
        if self.decode.n:
            out["decode_step_s"] = round(self.decode_step_s(), 4)
        if self.prefill.n:
            out["prefill_tokens_per_s"] = {str(n): round(n / s, 1) for n in lengths
                                           if (s := self.prefill_s(0, n)) > 0}
        for source in ("disk", "ram", "shared"):
            fit = self.fit(source)
            if fit.n:
                per_byte, s0 = fit.solve()
                out[f"{source}_restore"] = {
                    "bytes_per_s": round(1 / per_byte) if per_byte > 0 else None,
                    "fixed_s": round(s0, 4)}
        return out


def pays(costs: Costs | None, keep: int, n: int, nbytes: int, source: Source) -> bool:
    """Whether restoring a state of `nbytes` holding `n` tokens beats prefilling the tokens
    from `keep` (what is reused anyway) to `n`; true until both have been measured."""
    if costs is None or not costs.known(source):
        return True
    return costs.restore_s(nbytes, source) < costs.prefill_s(keep, n)
