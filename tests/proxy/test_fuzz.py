"""Generated hostile requests against a real prefixgate (issue 14): bench/fuzz.py's hypothesis
strategies for both APIs' bodies, raw bytes and headers, in a short deterministic run for CI
(`make fuzz` is the 10,000-request campaign). One worker, tenant isolation on. Every answer is
below 500, an error is JSON in its API's own shape, a stream ends properly; afterwards the worker
is the one that started and greedy answers on both APIs are what they were before the run.
A failing case is shrunk by hypothesis against the same server and printed with its exact bytes.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings

from bench import fuzz
from tests.conftest import Server

pytestmark = pytest.mark.model

RUN = settings(max_examples=200, derandomize=True, deadline=None, database=None,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                      HealthCheck.large_base_example])


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, list[str]]]:
    """The server, and its greedy answers to fuzz.REFERENCE before any generated request."""
    with fuzz.serving(tmp_path_factory.mktemp("fuzz")) as srv:
        yield srv, fuzz.reference(srv.port)


@RUN
@given(case=fuzz.cases())
def test_generated_requests(fuzzed: tuple[Server, list[str]], case: fuzz.Case) -> None:
    out = fuzz.send(fuzzed[0].port, case)
    found = fuzz.problems(case, out)
    assert not found, f"{found}\n{case.describe()}\n-> {out.describe()}"


def test_the_worker_survived_and_answers_as_before(fuzzed: tuple[Server, list[str]]) -> None:
    srv, before = fuzzed
    assert fuzz.worker_problems(srv) == [], srv.log()[-3000:]
    assert fuzz.reference(srv.port) == before
