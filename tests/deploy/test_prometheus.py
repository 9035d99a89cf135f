"""A real Prometheus (Debian's `prometheus` package) scraping a real prefixgate, with the
deploy/ rules loaded, answers every PromQL expression the dashboard and the rules use.

The expressions are read from deploy/rules.yml and deploy/grafana/dashboards/prefixgate.json,
never copied here. The traffic makes every series they read exist: a cold prompt (a snapshot
saved), a live hit, a disk restore, then a broken cache directory (a snapshot write fails).
An alert's expression is empty while the alert is quiet, so each is also evaluated with its
comparisons as `bool` (0 = quiet, 1 = firing): still empty only when a metric or label it reads
does not exist. The write failure is real, so that alert must fire.

A proxy with --api-key is scraped with the key from Prometheus's credentials file, the one
deploy/prometheus.yml names (docker-compose mounts PROMETHEUS_API_KEY_FILE there).
"""

from __future__ import annotations

import json
import re
import secrets
import shutil
import subprocess
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from tests.conftest import ROOT, Server, free_port, http_get, running

DEPLOY = ROOT / "deploy"
GRAFANA_VARS = {"$__rate_interval": "5m", "$__interval": "15s", "$__range": "1h"}

pytestmark = [pytest.mark.model, pytest.mark.skipif(
    shutil.which("prometheus") is None,
    reason="the prometheus server is not installed: apt-get install -y prometheus (.ci/run does)")]


def with_bool(expr: str) -> str:
    """`a > 0` -> `a > bool 0` for every comparison outside label matchers and strings."""
    out, depth, quote, i = [], 0, "", 0
    while i < len(expr):
        c = expr[i]
        if quote:
            quote = "" if c == quote else quote
        elif c in "\"'`":
            quote = c
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
        elif depth == 0 and c in "=!<>":
            op = expr[i:i + 2] if expr[i:i + 2] in ("==", "!=", ">=", "<=") else c
            if op in ("==", "!=", ">=", "<=", "<", ">"):
                out.append(op + " bool")
                i += len(op)
                continue
        out.append(c)
        i += 1
    return "".join(out)


def expressions() -> dict[str, str]:
    """Every PromQL expression of the rules and the dashboard, by where it comes from."""
    found: dict[str, str] = {}
    rules = yaml.safe_load((DEPLOY / "rules.yml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "record" in rule:
                found[f"rule {rule['record']}"] = rule["expr"]
                found[f"recorded series {rule['record']}"] = rule["record"]
            else:
                found[f"alert {rule['alert']} (bool)"] = with_bool(rule["expr"])
    dashboard = json.loads((DEPLOY / "grafana/dashboards/prefixgate.json").read_text())
    for panel in dashboard["panels"]:
        for t in panel.get("targets", []):
            expr = t["expr"]
            for var, value in GRAFANA_VARS.items():
                expr = expr.replace(var, value)
            assert "$" not in expr, f"unknown Grafana variable in {expr!r}"
            found[f"panel {panel['title']!r} {t['refId']}"] = expr
    return found


class Prometheus:
    def __init__(self, url: str, key_file: Path) -> None:
        self.url = url
        self.key_file = key_file  # the API key it scrapes with

    def api(self, path: str, **params: str) -> Any:
        status, body = http_get(f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}")
        assert status == 200, body
        data = json.loads(body)
        assert data["status"] == "success", data
        return data["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return list(self.api("query", query=expr)["result"])


@pytest.fixture
def prometheus_for(tmp_path: Path) -> Iterator[Any]:
    """Starts Prometheus with deploy/prometheus.yml scraping `target` every second; the API key
    file it names (relative to the config, as compose mounts it) starts as the repository's."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(target: str) -> Prometheus:
        cfg = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
        cfg["global"].update(scrape_interval="1s", evaluation_interval="1s")
        cfg["rule_files"] = [str(DEPLOY / f) for f in cfg["rule_files"]]
        jobs = {job["job_name"]: job for job in cfg["scrape_configs"]}
        jobs["prefixgate"]["static_configs"] = [{"targets": [target]}]
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
        key_path = jobs["prefixgate"]["authorization"]["credentials_file"]
        key_file = tmp_path / key_path
        key_file.parent.mkdir(parents=True, exist_ok=True)
        key_file.write_text((DEPLOY / key_path).read_text())  # empty: no key
        port = free_port()
        log = open(tmp_path / "prometheus.log", "wb")
        procs.append(subprocess.Popen(
            ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT))
        prom = Prometheus(f"http://127.0.0.1:{port}", key_file)
        deadline = time.time() + 60
        while http_get(prom.url + "/-/ready", timeout_s=2)[0] != 200:
            assert procs[0].poll() is None and time.time() < deadline, \
                (tmp_path / "prometheus.log").read_text()
            time.sleep(0.2)
        return prom

    yield start
    for p in procs:
        p.terminate()
        p.wait(20)


def system_prompt(topic: str) -> str:
    """~80 tokens of stable preamble, past --kv-cache-min-tokens: the cold anchor is saved."""
    return " ".join(f"Rule {i}: when asked about {topic}, answer briefly and cite the source."
                    for i in range(1, 5))


def ask(srv: Server, system: str | None, question: str, key: str = "k") -> str:
    messages = [{"role": "user", "content": question}]
    if system:
        messages.insert(0, {"role": "system", "content": system})
    c = openai.OpenAI(base_url=srv.v1, api_key=key, max_retries=0, timeout=180)
    raw = c.chat.completions.with_raw_response.create(model="m", messages=messages,
                                                       temperature=0, max_tokens=4)
    return str(raw.headers["x-prefixgate-cache-source"])


def wait_until(check: Any, what: str, timeout_s: float = 30) -> Any:
    deadline = time.time() + timeout_s
    while True:
        result = check()
        if result:
            return result
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def test_every_dashboard_and_rule_expression_has_data(tmp_path: Path, prometheus_for: Any) -> None:
    exprs = expressions()
    assert len(exprs) > 40
    with running(tmp_path, "--workers", "1", "--kv-cache-min-tokens", "32") as srv:
        prom = prometheus_for(f"127.0.0.1:{srv.port}")
        wait_until(lambda: prom.query('up{job="prefixgate"} == 1'), "the first scrape")
        files = system_prompt("files")
        assert ask(srv, files, "Which rule is first?") == "none"
        wait_until(lambda: srv.get_json("/props")["cache"]["entries"], "the cold snapshot")
        assert ask(srv, files, "Which rule is first?") == "live"
        ask(srv, None, "Unrelated: name a prime number.")  # the live KV is something else now
        assert ask(srv, files, "Which rule is last?") == "disk"

        # the cache directory breaks: state files are gone, and no new one can be written
        kv = srv.cache_dir / "kv"
        kv.rename(srv.cache_dir / "kv.lost")
        kv.write_text("not a directory")
        ask(srv, system_prompt("tests"), "Which rule is first?")  # its snapshot fails

        wait_until(lambda: prom.query("sum(prefixgate_cache_faults_total) > 0")
                   and prom.query('sum(prefixgate_cache_saves_total{outcome="failed"}) > 0'),
                   "the faults to be scraped")

        def empty() -> list[str]:
            return [name for name, e in exprs.items() if not prom.query(e)]

        missing = empty()
        deadline = time.time() + 20  # recording rules catch up within a few evaluations
        while missing and time.time() < deadline:
            time.sleep(1)
            missing = empty()
        assert not missing, "no data for:\n" + "\n".join(f"{m}: {exprs[m]}" for m in missing)
        # time to first token under each request's cache source (the header said which)
        ttft = prom.query("sum by (source) (prefixgate_time_to_first_token_seconds_count)")
        assert {r["metric"]["source"] for r in ttft} == {"cold", "live", "disk"}, ttft

        # one more hit once the counters' series have been scraped: a series first scraped
        # after all its increments has a rate of zero
        assert ask(srv, system_prompt("tests"), "Which rule is first?") == "live"
        wait_until(lambda: (r := prom.query("instance:prefixgate_cache_hit_ratio:rate5m"))
                   and float(r[0]["value"][1]) > 0, "a hit ratio above zero")
        bad = [(r["name"], r.get("lastError")) for g in prom.api("rules")["groups"]
               for r in g["rules"] if r["health"] != "ok"]
        assert not bad, bad
        # the real write failure fires its alert (it has no `for:`)
        wait_until(lambda: any(a["labels"]["alertname"] == "PrefixgateCacheWritesFailing"
                               and a["state"] == "firing" for a in prom.api("alerts")["alerts"]),
                   "PrefixgateCacheWritesFailing to fire")
    # the proxy is gone: the scrape fails, which is what PrefixgateDown watches
    wait_until(lambda: prom.query('up{job="prefixgate"} == 0'), "a failed scrape")


def test_a_server_with_an_api_key_is_scraped_with_it(tmp_path: Path,
                                                     prometheus_for: Any) -> None:
    """Without the key the scrape fails (401: the target is down, PrefixgateDown watches it);
    the key written into the credentials file is read at the next scrape, no restart. The key
    is never in the proxy's log, at debug level."""
    key = "sk-prefixgate-" + secrets.token_hex(12)
    with running(tmp_path, "--workers", "1", "--api-key", key, "--log-level", "debug") as srv:
        assert srv.get("/metrics")[0] == 401
        prom = prometheus_for(f"127.0.0.1:{srv.port}")  # with the repository's empty key
        wait_until(lambda: prom.query('up{job="prefixgate"} == 0'), "a refused scrape")
        target = prom.api("targets")["activeTargets"][0]
        assert "401" in target["lastError"], target

        prom.key_file.write_text(key + "\n")
        wait_until(lambda: prom.query('up{job="prefixgate"} == 1'), "a scrape with the key")
        assert ask(srv, None, "Name a prime number.", key=key) == "none"
        wait_until(lambda: prom.query('prefixgate_time_to_first_token_seconds_count'
                                      '{source="cold"} > 0'), "the request to be scraped")
    assert key not in srv.log()


def test_with_bool_leaves_matchers_alone() -> None:
    assert with_bool('x{a="b",c!="d",e=~"f"} > 0') == 'x{a="b",c!="d",e=~"f"} > bool 0'
    assert with_bool("a < 0.5 * b and c >= 1") == "a < bool 0.5 * b and c >= bool 1"
    assert re.fullmatch(r"up\{job=\"p\"\} == bool 0", with_bool('up{job="p"} == 0'))
