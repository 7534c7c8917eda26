# Ferry: everything a fresh machine needs is installed by these targets, into a cache outside the repo.
SHELL := /bin/bash
FERRY_CACHE ?= $(HOME)/.cache/ferry
VENV ?= $(FERRY_CACHE)/venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# Test files run on this many workers, each with its own local cluster; most of a test's time is waiting.
PYTEST_WORKERS ?= 2
export FERRY_CACHE
# uv (make dist, tests/e2e/test_dists.py): one cache, so that venvs hardlink their packages from it.
export UV_CACHE_DIR ?= $(FERRY_CACHE)/uv
export UCX_NET_DEVICES := lo

.PHONY: help sysdeps deps venv bins images crds proto lint fmt test test-unit e2e-pods demo bench dist dist-cache clean

help:
	@echo "make demo   - start a local cluster + S3 + operator and walk through the weight lifecycle"
	@echo "make test   - install everything needed and run the whole test suite (unit, cluster, e2e)"
	@echo "make e2e-pods - the chart as real pods on 2 local kubelet nodes (tests/pods)"
	@echo "make bench  - run the benchmarks under bench/ (JSON + markdown into bench/results/)"
	@echo "make crds   - regenerate crds/*.yaml from the pydantic models"
	@echo "make lint   - ruff check + format check"
	@echo "make dist   - build the wheels (ferry-weights, ferry-client) into $$FERRY_CACHE/dist"

# Debian packages (containerd, runc, CNI plugins, debootstrap, ...): installed when run as root, else the one command.
sysdeps:
	@bash hack/install-system-deps.sh

deps: sysdeps venv bins

venv: sysdeps $(VENV)/.ferry-installed

$(VENV)/.ferry-installed: pyproject.toml
	bash hack/setup-venv.sh "$(VENV)"
	@touch $@

bins:
	bash hack/build-bins.sh all

crds: venv
	$(PY) -m ferry.api.crdgen crds
	bash hack/sync-chart-crds.sh

proto: venv
	bash hack/gen-proto.sh "$(PY)"

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(FERRY_CACHE)/bin/helm lint --strict charts/ferry charts/ferry-consumer

fmt: venv
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# The suite runs in a loopback-only network namespace: NIXL/UCX and every server we start see only `lo`. The dev
# images' Debian rootfs needs the network, so it is built (or found cached) before.
test: deps images dist-cache
	$(VENV)/bin/pip install -q --no-deps -e .
	$(MAKE) --no-print-directory lint
	bash hack/netns.sh $(VENV)/bin/pytest -m "unit or cluster or e2e or pods" -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The daemonless dev images (cached under $(FERRY_CACHE)/images) that tests/pods imports into its kubelet nodes.
images: venv
	$(PY) -m ferry_dev.localimages

e2e-pods: deps images
	$(VENV)/bin/pip install -q --no-deps -e .
	bash hack/netns.sh $(VENV)/bin/pytest -m pods tests/pods $(PYTEST_ARGS)

test-unit: venv
	$(VENV)/bin/pytest -m unit $(PYTEST_ARGS)

demo: deps
	$(VENV)/bin/pip install -q --no-deps -e .
	$(PY) -m ferry_dev.demo $(DEMO_ARGS)

# The bench extra: the purpose-built S3 clients bench_s3 compares against (not installed by `make test`).
bench: deps
	$(VENV)/bin/pip install -q -e ".[bench]"
	bash hack/netns.sh $(PY) -m bench.run_all

# The server's distribution (ferry-weights, the repo root) and the engine's (ferry-client, dist/client).
DIST ?= $(FERRY_CACHE)/dist
dist: venv
	rm -rf "$(DIST)"
	$(VENV)/bin/uv build --quiet --wheel --out-dir "$(DIST)" dist/client
	$(VENV)/bin/uv build --quiet --wheel --out-dir "$(DIST)" .

# What tests/e2e/test_dists.py installs offline (it runs in the loopback-only namespace): the build backends and
# ferry-client's dependencies for each supported Python, into uv's cache (seconds once cached).
DIST_PYTHONS ?= 3.11 3.12 3.13
dist-cache: dist
	for v in $(DIST_PYTHONS); do \
	  py=$$(python$$v -c 'import sys; print(sys.executable)' 2>/dev/null || ls "$(HOME)"/.pyenv/versions/$$v.*/bin/python$$v | tail -1); \
	  [ -n "$$py" ] || { echo "Python $$v is not on this machine" >&2; exit 1; }; \
	  rm -rf "$(FERRY_CACHE)/dist-venv" && UV_PYTHON_DOWNLOADS=never $(VENV)/bin/uv venv -q --python "$$py" "$(FERRY_CACHE)/dist-venv" && \
	  $(VENV)/bin/uv pip install -q --python "$(FERRY_CACHE)/dist-venv/bin/python" "$(DIST)"/ferry_client-*.whl \
	  || exit 1; \
	done
	rm -rf "$(FERRY_CACHE)/dist-venv"

clean:
	rm -rf bench/results .pytest_cache .ruff_cache
