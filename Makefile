# Two commands matter: `make run` and `make test`. Both set up .venv first.
# `make test-fast` runs tests/unit and tests/inproc only (no processes; under a minute).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
FULL := $(VENV)/.installed-analytics
DATA ?= data
PORT ?= 11300
HTTP_PORT ?= 11380

.PHONY: run test test-fast lint bench fixtures clean system-packages fuse-packages mutation \
	dist wheelhouse compiled pure

# Debian packages the tests use: the real beanstalkd to compare with, Java for
# Spark, zip for the package the Spark cluster test ships, Node for the
# JavaScript clients' own test suites, Chromium for the console, podman, runc,
# mmdebstrap and podman-compose for the container image and the compose
# cluster, etcd and HAProxy for failover (README: "What make test installs").
# The host is left as it was: while apt installs, a policy-rc.d forbids
# starting services, so Debian's beanstalkd.service and beanstalkd.socket
# (127.0.0.1:11300, `make run`'s address) do not start; under systemd they
# are also disabled. Only packages that were missing are touched.
# NEEDS picks the commands (`make bench` needs only beanstalkd).
NEEDS ?= beanstalkd java npm chromium podman etcd haproxy zip
system-packages:
	@missing=""; needs=" $(NEEDS) "; \
	case "$$needs" in *" beanstalkd "*) \
	  command -v beanstalkd >/dev/null || missing="$$missing beanstalkd";; esac; \
	case "$$needs" in *" java "*) \
	  command -v java >/dev/null || missing="$$missing openjdk-17-jre-headless";; esac; \
	case "$$needs" in *" npm "*) \
	  command -v npm >/dev/null || missing="$$missing nodejs npm";; esac; \
	case "$$needs" in *" chromium "*) \
	  command -v chromedriver >/dev/null || missing="$$missing chromium chromium-driver";; esac; \
	case "$$needs" in *" podman "*) \
	  for c in podman runc mmdebstrap podman-compose; do \
	    command -v $$c >/dev/null || missing="$$missing $$c"; done;; esac; \
	case "$$needs" in *" etcd "*) \
	  command -v etcd >/dev/null || missing="$$missing etcd-server";; esac; \
	case "$$needs" in *" haproxy "*) \
	  command -v haproxy >/dev/null || missing="$$missing haproxy";; esac; \
	case "$$needs" in *" zip "*) \
	  command -v zip >/dev/null || missing="$$missing zip";; esac; \
	[ -z "$$missing" ] && exit 0; \
	policy=""; \
	if [ ! -e /usr/sbin/policy-rc.d ]; then \
	  printf '#!/bin/sh\n# make test: install without starting services\nexit 101\n' \
	    > /usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && policy=1; \
	fi; \
	apt-get update -qq && apt-get install -y -qq $$missing; rc=$$?; \
	[ -n "$$policy" ] && rm -f /usr/sbin/policy-rc.d; \
	case "$$missing" in *beanstalkd*) \
	  if [ -d /run/systemd/system ]; then \
	    systemctl disable --now beanstalkd.socket beanstalkd.service; \
	  fi;; \
	esac; \
	exit $$rc

# FUSE for the power-cut tests (tests/support/powercutfs.py): fuse3 has
# fusermount3; libfuse3-dev and pkg-config build pyfuse3 (in the test extra).
# zlib1g-dev: zlib's header, for the compiled build's frame header
# (smallstalk/storage/framehead.pyx), which make test builds.
fuse-packages:
	@missing=""; \
	command -v fusermount3 >/dev/null || missing="$$missing fuse3"; \
	command -v pkg-config >/dev/null || missing="$$missing pkg-config"; \
	dpkg -s libfuse3-dev >/dev/null 2>&1 || missing="$$missing libfuse3-dev"; \
	dpkg -s zlib1g-dev >/dev/null 2>&1 || missing="$$missing zlib1g-dev"; \
	if [ -n "$$missing" ]; then apt-get update -qq && apt-get install -y -qq $$missing; fi

$(STAMP): pyproject.toml | fuse-packages
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,console,ha]'
	touch $(STAMP)

# PySpark is big and only the pipeline needs it: `make run` does without.
$(FULL): $(STAMP)
	$(BIN)/pip install -q -e '.[test,console,ha,analytics]'
	touch $(FULL)

run: $(STAMP)
	@echo "console: http://127.0.0.1:$(HTTP_PORT)/ (metrics at /metrics)"
	$(BIN)/smallstalk serve -l 127.0.0.1 -p $(PORT) --data-dir $(DATA) --http 127.0.0.1:$(HTTP_PORT)

# The suite against the pure-Python modules (the reference), then the in-process
# tests again against the compiled build (tools/compile.py, into build/compiled):
# --import-mode=append lets PYTHONPATH's copy win over the checkout. The
# slowest tests are listed at the end of the first run: the whole must stay
# under 20 minutes on two cores.
COMPILED_COPY := build/compiled
test: $(FULL) system-packages
	$(BIN)/ruff check smallstalk tests
	$(BIN)/pytest -q --durations=25
	$(BIN)/python tools/compile.py --quiet --quick --out $(COMPILED_COPY)
	PYTHONPATH=$(COMPILED_COPY) SMALLSTALK_BUILD=compiled \
	  $(BIN)/pytest -q -p no:cacheprovider --import-mode=append tests/unit tests/inproc

test-fast: $(STAMP)
	$(BIN)/ruff check smallstalk tests
	$(BIN)/pytest -q tests/unit tests/inproc

# Mutation testing (mutmut) of the storage layer and the state machine; not in
# `make test`: all of it takes hours on 2 cores. MUTANTS narrows the run, e.g.
# `make mutation MUTANTS='smallstalk.storage.aof*'`. mutmut maps mutants to the
# in-process tests only (tests/unit, tests/inproc): a missing fsync survives
# there and is killed by tests/procs/test_powercut.py (see README, Durability).
mutation: $(STAMP)
	$(BIN)/pip install -q -e '.[test,mutation]'
	$(BIN)/mutmut run $(MUTANTS)
	$(BIN)/mutmut results

# A release (docs/OPERATIONS.md, Releasing): the sdist and the wheel in dist/, and the
# image IMAGE:VERSION (and IMAGE:latest) in podman's storage, VERSION being
# smallstalk.__version__. The image installs the wheels of wheelhouse/, resolved
# here: pip in the build reads no package index (apt still reads Debian's mirror).
PODMAN ?= podman
IMAGE ?= localhost/smallstalk
# Build steps need few descriptors; some hosts refuse a container the host's limits.
IMAGE_BUILD_FLAGS ?= --ulimit nofile=1024:1024 --ulimit nproc=1000:1000
wheelhouse: $(STAMP)
	$(BIN)/pip wheel -q --wheel-dir wheelhouse '.[console,ha]' 'setuptools>=77'
	rm -f wheelhouse/smallstalk-*.whl  # the image builds its own from the sources

dist: $(STAMP) wheelhouse
	@version=$$($(BIN)/python -c 'import smallstalk; print(smallstalk.__version__)'); \
	set -e; rm -rf dist; \
	$(BIN)/python -m build --outdir dist .; \
	ls dist/smallstalk-$$version.tar.gz dist/smallstalk-$$version-py3-none-any.whl; \
	$(PODMAN) build --format docker $(IMAGE_BUILD_FLAGS) -t $(IMAGE):$$version \
	  -t $(IMAGE):latest -f Containerfile .; \
	echo "dist/: sdist and wheel $$version; image $(IMAGE):$$version"

# The optional compiled build (docs/PERFORMANCE.md, "The compiled build"): Cython
# over the modules tools/compile.py names, beside the sources, which Python imports
# first; `make pure` goes back to the reference. Needs a C compiler.
compiled: $(STAMP)
	$(BIN)/python tools/compile.py --inplace

pure:
	rm -f smallstalk/*/*.so

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
	@$(MAKE) --no-print-directory system-packages NEEDS=beanstalkd

bench: $(STAMP) bench-packages
	$(BIN)/python bench/run.py $(BENCH_ARGS)

bench-quick: $(STAMP) bench-packages
	$(BIN)/python bench/run.py --quick $(BENCH_ARGS)
