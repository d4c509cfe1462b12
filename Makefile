# The two commands of the README's Quickstart. Both set everything up first and are idempotent.
SHELL := /bin/bash
CORES := $(shell nproc)
export OMP_NUM_THREADS ?= $(CORES)
export HF_HUB_OFFLINE ?= 1
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export DVC_NO_ANALYTICS ?= 1
export MLFLOW_DISABLE_TELEMETRY ?= true
# Prefect's temporary API server gets 20 s to start by default; its first start creates its database,
# and on a busy 2-core machine that took longer (the flow then fails with "Timed out while attempting to
# connect to ephemeral Prefect API server"; seen 2026-11-30).
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 120
export PATH := $(CURDIR)/.venv/bin:$(PATH)
# On a machine without internet, a local copy of ALFWorld's games archive (used only if ALFWORLD_DATA
# does not already hold the games).
LOCAL_ARCHIVE := $(wildcard ../shared/data/alfworld/json_2.1.1_all_splits.tar.xz)
ifneq ($(LOCAL_ARCHIVE),)
export QEVOLVE_ALFWORLD_ARCHIVE ?= $(abspath $(LOCAL_ARCHIVE))
endif

# The standard ScienceWorld and WebShop split files (docs/environments.md), where this checkout has them.
LOCAL_SPLITS := $(wildcard ../shared/data/splits)
ifneq ($(LOCAL_SPLITS),)
export QEVOLVE_SPLITS ?= $(abspath $(LOCAL_SPLITS))
endif
# `make quickstart` runs params.yaml in its own workspace, runs/quickstart/, so the checkout stays as
# committed; `make quickstart PROFILE=textcraft` (or scienceworld, webshop, alfworld, smollm2) runs
# profiles/$(PROFILE).yaml in runs/$(PROFILE)/.
PROFILE ?=

.PHONY: setup lock quickstart test test-slow test-all lint format docs
setup:
	./scripts/setup.sh

# constraints.txt, the pinned stack that setup installs, resolved anew from pyproject.toml (after changing a
# dependency there).
lock:
	./scripts/lock.sh

quickstart: setup
	PYTHONPATH=. .venv/bin/python -m flows.evolve --workspace $(or $(PROFILE),quickstart) $(if $(PROFILE),--profile $(PROFILE))

# The default tier runs on TEST_WORKERS pytest-xdist processes (one per core by default, each with
# OMP_NUM_THREADS = cores / workers, at least 1: more threads than cores makes generation tens of times
# slower). `make test TEST_WORKERS=1` runs it in one process. The slow tier stays in one process: its
# multi-process trainers, Ray and Prefect servers take the cores themselves.
TEST_WORKERS ?= $(CORES)
TEST_THREADS := $(shell echo $$(( $(CORES) / $(TEST_WORKERS) > 0 ? $(CORES) / $(TEST_WORKERS) : 1 )))
test: setup
	OMP_NUM_THREADS=$(TEST_THREADS) PYTHONPATH=. .venv/bin/python -m pytest -n $(TEST_WORKERS) -m "not slow"

test-slow: setup
	PYTHONPATH=. .venv/bin/python -m pytest -m slow

test-all: setup
	PYTHONPATH=. .venv/bin/python -m pytest

# Ruff's formatter and linter (pyproject.toml's [tool.ruff]): `make lint` checks, as CI does; `make format` rewrites.
lint: setup
	.venv/bin/ruff format --check .
	.venv/bin/ruff check .

format: setup
	.venv/bin/ruff format .
	.venv/bin/ruff check --fix .

# The documentation site (mkdocs.yml) into site/, strictly: a broken link or anchor fails it.
docs: setup
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict
