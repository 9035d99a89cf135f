"""Credentials in URLs never reach a log line, an error or an HTTP body (issue 46, section 2).

A `--worker-url http://admin:PASSWORD@host:port` whose worker goes away: the 503 that API
clients get and the proxy's log name the worker without its password. A Redis URL with its
password in the query, as redis-py documents it (`?password=...`), is never logged in full on a
shared-tier fault. Every form of a secret in a URL is hidden by `backend.redact`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import openai
import pytest

from backend.redact import redact_url, scrub, url_secrets
from backend.shared import redacted
from tests.conftest import PASSWORD, Redis, free_port, running
from tests.deploy.test_remote_workers import WorkerProcess
from tests.proxy.test_disk_cache import convo

WORKER_PASSWORD = "worker-pw-never-shown"

URLS = [
    # (a URL as given, what may be shown)
    ("redis://:s3cret@h:6379/0", "redis://h:6379/0"),
    ("redis://user:s3cret@h:6379/0", "redis://h:6379/0"),
    ("redis://h:6379/0?password=s3cret", "redis://h:6379/0?password=***"),
    ("rediss://h:6380/0?db=1&password=s3cret&ssl_password=s3cret2",
     "rediss://h:6380/0?db=1&password=***&ssl_password=***"),
    ("redis://h:6379?username=u&Password=s3cret", "redis://h:6379?username=u&Password=***"),
    ("unix://:s3cret@/run/redis.sock?db=0", "unix:///run/redis.sock?db=0"),
    ("http://admin:s3cret@10.0.0.2:9000", "http://10.0.0.2:9000"),
    ("http://s3cret@10.0.0.2:9000/", "http://10.0.0.2:9000/"),  # a token as the user
    ("https://h/?token=s3cret#s3cret", "https://h/?token=***"),
    ("not a url s3cret", "(not a URL)"),
    ("http://[::1:s3cret", "(not a URL)"),
]


@pytest.mark.parametrize(("url", "shown"), URLS)
def test_a_secret_in_a_url_is_never_shown(url: str, shown: str) -> None:
    assert redact_url(url) == redacted(url) == shown
    assert "s3cret" not in redact_url(url)
    if "://" in url and "[" not in url:
        assert "s3cret" not in scrub(f"connecting to {url} failed", url_secrets(url))


@pytest.mark.model
@pytest.mark.skipif(shutil.which("redis-server") is None,
                    reason="needs Debian's redis-server (.ci/run installs it)")
def test_worker_and_redis_passwords_never_reach_a_client_or_the_log(tmp_path: Path) -> None:
    redis = Redis(tmp_path)
    worker = WorkerProcess(tmp_path, free_port(), tmp_path / "cache")
    try:
        worker_url = worker.url.replace("http://", f"http://admin:{WORKER_PASSWORD}@")
        redis_url = f"redis://127.0.0.1:{redis.port}/0?password={PASSWORD}"  # redis-py's form
        with running(tmp_path, "--worker-url", worker_url, "--shared-tier", redis_url,
                     cache_dir=tmp_path / "cache") as srv:
            c = openai.OpenAI(base_url=srv.v1, api_key="k", max_retries=0, timeout=120)

            def ask() -> None:
                c.chat.completions.create(model="m", messages=convo("Name one rule."),
                                          temperature=0, max_tokens=4)
            redis.stop()  # a shared-tier fault on the next request: logged, a miss
            ask()
            assert "shared tier lookup failed" in srv.log()
            worker.kill()  # no worker reachable: a 503 that names the worker
            with pytest.raises(openai.APIStatusError) as exc:
                for _ in range(50):
                    ask()
            assert exc.value.status_code == 503
            body = str(exc.value.body)
            assert "worker 0 at http://127.0.0.1:" in body, body
            assert WORKER_PASSWORD not in body and "admin" not in body, body
            log = srv.log()
        assert "worker 0 at http://127.0.0.1:" in log
        assert WORKER_PASSWORD not in log and PASSWORD not in log, log[-3000:]
    finally:
        worker.stop()
        redis.stop()
