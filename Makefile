# Two commands matter: `make run` and `make test`. Both set up .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
FULL := $(VENV)/.installed-analytics
DATA ?= data
PORT ?= 11300

.PHONY: run test lint bench fixtures clean system-packages

# Debian packages the tests use: the real beanstalkd to compare with, Java for Spark.
system-packages:
	@if ! command -v beanstalkd >/dev/null || ! command -v java >/dev/null; then \
	  apt-get update -qq && apt-get install -y -qq beanstalkd openjdk-17-jre-headless; fi

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

# PySpark is big and only the pipeline needs it: `make run` does without.
$(FULL): $(STAMP)
	$(BIN)/pip install -q -e '.[test,analytics]'
	touch $(FULL)

run: $(STAMP)
	$(BIN)/smallstalk serve -l 127.0.0.1 -p $(PORT) --data-dir $(DATA)

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
