# Two commands matter: `make run` and `make test`. Both set up .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DATA ?= data
PORT ?= 11300

.PHONY: run test lint bench fixtures clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/smallstalk serve -l 127.0.0.1 -p $(PORT) --data-dir $(DATA)

test: $(STAMP)
	@command -v beanstalkd >/dev/null || (apt-get update -qq && apt-get install -y -qq beanstalkd) || echo "beanstalkd not installed: comparison tests will fail"
	$(BIN)/ruff check smallstalk tests
	$(BIN)/pytest -q

lint: $(STAMP)
	$(BIN)/ruff check smallstalk tests

clean:
	rm -rf $(VENV) build *.egg-info

fixtures: $(STAMP)
	$(BIN)/python tools/make_fixtures.py
