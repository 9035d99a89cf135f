"""Prometheus metrics, `prefixgate_` prefix, base units. One registry per app (tests run several).

What they mean:
- prompt tokens = cached tokens (live + disk) + prefilled tokens, per request.
- hit ratio = rate(prefixgate_cached_tokens_total) / rate(prefixgate_prompt_tokens_total).
- lookups: hit (the disk entry covers the whole reusable prefix), partial (a shorter entry was
  used), miss (nothing on disk); live-only reuse is counted under cached_tokens{source="live"}.
- speculative decoding by source (the drafter: ngram-simple, ngram-mod, ...): tokens drafted
  and verified, tokens accepted, verify steps; acceptance = accepted / drafted.
- time to first token by source: the request's cache source (as in its log line), "cold" where
  nothing was reused (the log's source=none).

Beside them, the last RECENT_LINES request log lines, for the status page.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from policies.plan import REASON_RANK
from proxy.chat import MEDIA_KINDS

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


RECENT_LINES = 50  # request log lines kept for the status page


class Metrics:
    def __init__(self) -> None:
        # the last requests' log lines, (unix time, line), newest last (proxy/status.py)
        self.recent_lines: deque[tuple[float, str]] = deque(maxlen=RECENT_LINES)
        r = self.registry = CollectorRegistry()
        self.requests = Counter("prefixgate_requests_total", "Requests by API and outcome",
                                ["api", "outcome"], registry=r)
        self.prompt_tokens = Counter("prefixgate_prompt_tokens_total",
                                     "Prompt tokens of served requests", registry=r)
        self.cached_tokens = Counter("prefixgate_cached_tokens_total",
                                     "Prompt tokens not prefilled, by source", ["source"],
                                     registry=r)
        self.prefilled_tokens = Counter("prefixgate_prefilled_tokens_total",
                                        "Prompt tokens prefilled by a worker", registry=r)
        self.generated_tokens = Counter("prefixgate_generated_tokens_total",
                                        "Tokens generated", registry=r)
        self.lookups = Counter("prefixgate_cache_lookups_total",
                               "Disk cache lookups by result", ["result"], registry=r)
        self.saves = Counter("prefixgate_cache_saves_total", "Snapshots by reason and outcome",
                             ["reason", "outcome"], registry=r)
        for reason in REASON_RANK:  # exported at 0, so the first failure already shows as a rate
            self.saves.labels(reason, "failed")
        self.faults = Counter("prefixgate_cache_faults_total",
                              "Cache faults degraded to a miss, by kind", ["kind"], registry=r)
        self.evictions = Counter("prefixgate_cache_evictions_total", "Entries evicted",
                                 registry=r)
        self.evicted_bytes = Counter("prefixgate_cache_evicted_bytes_total",
                                     "Bytes of evicted state files", registry=r)
        self.shared_lookups = Counter(
            "prefixgate_shared_lookups_total",
            "Shared tier lookups of prompts the local tier did not cover: hit, miss, error, "
            "skipped (the tier failed moments ago: not asked)", ["result"], registry=r)
        # every series from the start (zero until used): dashboards show 0, not "no data"
        for result in ("hit", "miss", "error", "skipped"):
            self.shared_lookups.labels(result)
        for source in ("live", "ram", "disk", "shared"):
            self.cached_tokens.labels(source)
        self.shared = Gauge("prefixgate_shared_worker", "What each worker did with the shared "
                            "tier since it started (backend.shared.STATS: published_bytes, "
                            "publish_failures, pulls, ..., publish_queued now)",
                            ["worker", "stat"], registry=r)
        self.media_placeholders = Counter(
            "prefixgate_media_placeholders_total",
            "Media blocks (image, audio, file, document) a text-only model got as a text "
            "placeholder, by kind", ["kind"], registry=r)
        for kind in MEDIA_KINDS:
            self.media_placeholders.labels(kind)
        self.preemptions = Counter(
            "prefixgate_preemptions_total",
            "Runs stopped while prefilling for a short request that found no idle slot; each "
            "ran again from its prefix in the RAM tier (policies.preempt)", registry=r)
        self.parks = Counter(
            "prefixgate_parks_total",
            "Short requests run nested on a slot whose generating run was parked in host RAM "
            "meanwhile (policies.preempt rule 4)", registry=r)
        self.restores_skipped = Counter(
            "prefixgate_restores_skipped_total",
            "Stored entries not restored because the worker prefills them faster", registry=r)
        self.restore_seconds = Histogram("prefixgate_restore_seconds",
                                         "Time to restore a state file into a worker",
                                         buckets=_LATENCY, registry=r)
        self.save_seconds = Histogram("prefixgate_save_seconds",
                                      "Time to write a state file (off the hot path)",
                                      buckets=_LATENCY, registry=r)
        self.ttft_seconds = Histogram("prefixgate_time_to_first_token_seconds",
                                      "Request arrival to first token, by API and cache source "
                                      "(live, ram, disk, cold)", ["api", "source"],
                                      buckets=_LATENCY, registry=r)
        self.prefill_seconds = Histogram("prefixgate_prefill_seconds",
                                         "Worker prefill time per request",
                                         buckets=_LATENCY, registry=r)
        self.cache_bytes = Gauge("prefixgate_cache_bytes", "Bytes of state files on disk",
                                 registry=r)
        self.cache_budget_bytes = Gauge("prefixgate_cache_budget_bytes",
                                        "The --cache-max-bytes budget", registry=r)
        self.cache_entries = Gauge("prefixgate_cache_entries", "Entries in the index",
                                   registry=r)
        self.workers_up = Gauge("prefixgate_worker_up", "1 when the worker is ready",
                                ["worker"], registry=r)
        self.workers_busy = Gauge("prefixgate_worker_busy", "1 while the worker runs a request",
                                  ["worker"], registry=r)
        self.workers_exact = Gauge(
            "prefixgate_worker_exact",
            "1 when the worker's start-up self-check proved exact reuse (0: it reuses nothing)",
            ["worker"], registry=r)
        self.decode_independent = Gauge(
            "prefixgate_decode_independent",
            "1 when a slot's answer is its own whatever other slots generate at the same time "
            "(--deterministic); shape: how decode steps of several slots run (batched, fixed, "
            "apart)", ["worker", "shape"], registry=r)
        self.draft_tokens = Counter("prefixgate_draft_tokens_total",
                                    "Draft tokens verified (speculative decoding), by source",
                                    ["source"], registry=r)
        self.draft_accepted = Counter("prefixgate_draft_accepted_tokens_total",
                                      "Draft tokens the model accepted, by source", ["source"],
                                      registry=r)
        self.draft_verifies = Counter("prefixgate_draft_verifies_total",
                                      "Verify steps of drafts, by source", ["source"],
                                      registry=r)
        self.queue_depth = Gauge("prefixgate_queue_depth", "Requests waiting for a worker",
                                 registry=r)
        self.slots_busy = Gauge("prefixgate_slots_busy", "Slots running a request, per worker",
                                ["worker"], registry=r)
        self.ram_bytes = Gauge("prefixgate_cache_ram_bytes",
                               "Bytes of live states kept in the workers' RAM tier",
                               ["worker"], registry=r)
        self.ram_budget_bytes = Gauge("prefixgate_cache_ram_budget_bytes",
                                      "The --cache-ram budget per worker (-1: no limit)",
                                      ["worker"], registry=r)
        self.ram_entries = Gauge("prefixgate_cache_ram_entries",
                                 "States in the workers' RAM tier", ["worker"], registry=r)

    def count_drafts(self, draft: dict[str, Any]) -> None:
        """A request's drafts, per source (a `Done`'s `draft`)."""
        for source, n in draft.items():
            self.draft_tokens.labels(source).inc(int(n.get("drafted", 0)))
            self.draft_accepted.labels(source).inc(int(n.get("accepted", 0)))
            self.draft_verifies.labels(source).inc(int(n.get("verifies", 0)))
