# Every target sets itself up: the first use creates .venv and installs kvprop into it.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvprop-installed
FUZZ_SECONDS ?= 180
FUZZ_ARGS ?=
PROFILE ?= ci

.PHONY: all setup test test-fast fuzz repro bench bench-quick benchmarks lint docs clean vllm-env test-vllm vllm-matrix findings \
	sglang-env test-sglang sglang-matrix

all: test

$(STAMP): setup.cfg pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "installing kvprop and its dependencies into $(VENV) (torch is the CPU build, see constraints.txt): a few minutes, a line per package"
	@$(BIN)/python -m pip install --progress-bar off --disable-pip-version-check -c constraints.txt -e '.[test,redis,lint,ray]' 2>&1 \
		| grep --line-buffered -E "^(Collecting|Installing|Successfully|ERROR|error)" || true
	@$(BIN)/python -c "import kvprop, torch, hypothesis; print('kvprop', kvprop.__version__, '| torch', torch.__version__, '| hypothesis', hypothesis.__version__)"
	@touch $@

setup: $(STAMP)

# The suite runs on every core (pytest-xdist), one test file per worker at a time, so a
# file's module fixtures run once; TEST_WORKERS=0 runs it in this process alone.
TEST_WORKERS ?= auto

# Lint: ruff's checks and its formatter, and mypy over the whole package (its settings in pyproject.toml).
LINT = $(BIN)/ruff check kvprop tests bench examples && $(BIN)/ruff format --check --quiet kvprop tests bench examples \
	&& $(BIN)/mypy

test: $(STAMP)
	$(LINT)
	KVPROP_PROFILE=$(PROFILE) $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

# The unit tests of each layer, in well under two minutes: the tier to run while editing.
# `make test` runs these and the end-to-end tests (the command line, targets in worker
# processes, searches from scratch) that CI runs.
FAST_TESTS := $(addprefix tests/test_,block_pool coordinator managers mamba checkpoints partial_hits eagle \
	speculative retention reference_scenarios engine events full_report same_step_copy incremental kinds \
	regressions bad_input trace profiles layers protocol custom_target max_num_seqs design_facts bench_doc process_words)
FAST_TESTS := $(addsuffix .py,$(FAST_TESTS))

test-fast: $(STAMP)
	KVPROP_PROFILE=$(PROFILE) $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(FAST_TESTS)

fuzz: $(STAMP)
	$(BIN)/kvprop fuzz --seconds $(FUZZ_SECONDS) $(FUZZ_ARGS)

repro: $(STAMP)
	@status=0; found=0; \
	for f in counterexamples/*.json; do \
		[ -e "$$f" ] || { echo "no traces under counterexamples/"; break; }; \
		found=1; $(BIN)/kvprop replay "$$f" || status=1; \
	done; exit $$status

bench: $(STAMP)
	$(BIN)/kvprop bench

bench-quick: $(STAMP)
	$(BIN)/kvprop bench --quick

# docs/benchmarks.md, generated: the tables of the short runs (the full ones take far longer),
# headed by the command, the date and the machine that measured them; docs/campaign-costs.md:
# a campaign as Ray tasks against the process pool, and the cost model's figures.
benchmarks: $(STAMP)
	$(BIN)/kvprop bench --quick --markdown docs/benchmarks.md
	$(BIN)/kvprop bench --markdown docs/campaign-costs.md ray

lint: $(STAMP)
	$(LINT)

# The blocks of docs/design.md the code knows (kinds, invariants, variants, targets, module
# layout), rewritten from the registries; tests/test_design_facts.py fails while one is stale.
docs: $(STAMP)
	$(BIN)/kvprop facts --write

# vLLM's own allocator as a target: a separate CPU-only environment per release, any
# release from 0.22 on (scripts/vllm-env.sh: torch 2.13.0+cpu, vLLM and its import
# closure with --no-deps, the closure found by importing until nothing is missing).
VLLM_VERSION ?= 0.24.0
VLLM_VERSIONS ?= 0.23.0 0.24.0 0.34.0

vllm-env:
	bash scripts/vllm-env.sh $(VLLM_VERSION)

# VLLM_ENVS: where each release's environment is, as a prefix of its folder (CI keeps them in a
# cache outside the checkout). There the vLLM tests never skip: without vLLM they fail.
VLLM_ENVS ?= .venv-vllm-

test-vllm:
	@set -e; for v in $(VLLM_VERSIONS); do \
		bash scripts/vllm-env.sh $$v $(VLLM_ENVS)$$v; \
		echo "== vLLM $$v"; \
		VLLM_LOGGING_LEVEL=ERROR PYTHONWARNINGS=ignore KVPROP_PROFILE=$(PROFILE) KVPROP_REQUIRE_VLLM=1 \
			$(VLLM_ENVS)$$v/bin/python -m pytest -m vllm tests/test_vllm_target.py tests/test_vllm_scheduler.py tests/test_vllm_pipeline.py tests/test_vllm_router.py tests/test_vllm_findings.py tests/test_vllm_specs.py tests/test_vllm_tier.py; \
	done

# SGLang's own scheduler and KV cache as a target: a separate CPU-only environment per
# release, 0.5.18 to 0.5.23 (scripts/sglang-env.sh VERSION [DIR]: torch 2.13.0+cpu, SGLang and
# its import closure with --no-deps, triton and torchvision import shims).
SGLANG_VERSION ?= 0.5.23
SGLANG_VERSIONS ?= 0.5.18 0.5.23

sglang-env:
	bash scripts/sglang-env.sh $(SGLANG_VERSION)

# SGLANG_ENVS: where each release's environment is, as a prefix of its folder. There the SGLang
# tests never skip: without SGLang they fail.
SGLANG_ENVS ?= .venv-sglang-

test-sglang:
	@set -e; for v in $(SGLANG_VERSIONS); do \
		bash scripts/sglang-env.sh $$v $(SGLANG_ENVS)$$v; \
		echo "== SGLang $$v"; \
		PYTHONWARNINGS=ignore KVPROP_PROFILE=$(PROFILE) KVPROP_REQUIRE_SGLANG=1 \
			$(SGLANG_ENVS)$$v/bin/python -m pytest -m sglang tests/test_sglang_scheduler.py tests/test_sglang_target.py tests/test_sglang_findings.py; \
	done

# Per release: build, the vLLM tests, a fixed walk budget (300 runs, seed 0); one table row
# each. E.g. make vllm-matrix VLLM_VERSIONS="0.22.1 0.23.0 0.24.0 0.25.1 0.30.0 0.33.0"
vllm-matrix:
	PROFILE=$(PROFILE) bash scripts/matrix.sh vllm $(VLLM_VERSIONS)

# The same per SGLang release (no agreement column: kvprop has no model of SGLang to agree with).
# E.g. make sglang-matrix SGLANG_VERSIONS="0.5.18 0.5.19 0.5.20 0.5.21 0.5.22 0.5.23"
sglang-matrix:
	PROFILE=$(PROFILE) bash scripts/matrix.sh sglang $(SGLANG_VERSIONS)

# Every finding's reproducer (findings/*/repro.py, findings/sglang/*/repro.py) on each release
# its finding.json names: exit 1 where the bug is recorded, 0 where it is fixed; builds the
# environments it needs first.
findings: $(STAMP)
	@set -e; for v in $$($(BIN)/kvprop findings --releases); do bash scripts/vllm-env.sh $$v $(VLLM_ENVS)$$v; done
	$(BIN)/kvprop findings --envs $(VLLM_ENVS)
	@set -e; for v in $$($(BIN)/kvprop findings findings/sglang --releases); do bash scripts/sglang-env.sh $$v $(SGLANG_ENVS)$$v; done
	$(BIN)/kvprop findings findings/sglang --envs $(SGLANG_ENVS)

clean:
	rm -rf $(VENV) .venv-vllm-* .venv-sglang-* .hypothesis *.egg-info
