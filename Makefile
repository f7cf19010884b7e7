# Two commands matter: `make run` and `make test`. Both set up .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
FULL := $(VENV)/.installed-analytics
DATA ?= data
PORT ?= 11300
HTTP_PORT ?= 11380

.PHONY: run test lint bench fixtures clean system-packages

# Debian packages the tests use: the real beanstalkd to compare with, Java for
# Spark, Node for the JavaScript clients' own test suites, Chromium for the console.
system-packages:
	@missing=""; \
	command -v beanstalkd >/dev/null || missing="$$missing beanstalkd"; \
	command -v java >/dev/null || missing="$$missing openjdk-17-jre-headless"; \
	command -v npm >/dev/null || missing="$$missing nodejs npm"; \
	command -v chromedriver >/dev/null || missing="$$missing chromium chromium-driver"; \
	if [ -n "$$missing" ]; then apt-get update -qq && apt-get install -y -qq $$missing; fi

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,console]'
	touch $(STAMP)

# PySpark is big and only the pipeline needs it: `make run` does without.
$(FULL): $(STAMP)
	$(BIN)/pip install -q -e '.[test,console,analytics]'
	touch $(FULL)

run: $(STAMP)
	@echo "console: http://127.0.0.1:$(HTTP_PORT)/ (metrics at /metrics)"
	$(BIN)/smallstalk serve -l 127.0.0.1 -p $(PORT) --data-dir $(DATA) --http 127.0.0.1:$(HTTP_PORT)

test: $(FULL) system-packages
	$(BIN)/ruff check smallstalk tests
	$(BIN)/pytest -q

lint: $(STAMP)
	$(BIN)/ruff check smallstalk tests

clean:
	rm -rf $(VENV) build *.egg-info

fixtures: $(STAMP)
	$(BIN)/python tools/make_fixtures.py
	$(BIN)/python tools/worked_example.py

# Benchmarks against the real beanstalkd on loopback (issue 4; see bench/README.md).
# Not tests: nothing here fails on a number. Results go to bench-results/ (git-ignored).
# `make bench` is the full run (~10-15 min), `make bench-quick` reduced counts (~2 min);
# BENCH_ARGS passes more flags, e.g. BENCH_ARGS="--only always/put".
.PHONY: bench-quick bench-packages
bench-packages:
	@if ! command -v beanstalkd >/dev/null; then \
	  apt-get update -qq && apt-get install -y -qq beanstalkd; fi

bench: $(STAMP) bench-packages
	$(BIN)/python bench/run.py $(BENCH_ARGS)

bench-quick: $(STAMP) bench-packages
	$(BIN)/python bench/run.py --quick $(BENCH_ARGS)
