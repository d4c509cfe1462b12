#!/usr/bin/env bash
# constraints.txt anew (`make lock`): pyproject.toml's dependencies with the test extra, resolved from
# nothing in a throwaway virtual environment, every installed distribution pinned. Run it after changing
# a dependency in pyproject.toml, then `make setup` (which installs under the lock) and the tests.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
venv=$(mktemp -d)
trap 'rm -rf "$venv"' EXIT
"$PY" -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
# The CPU build of torch first, as scripts/setup.sh does (an unpinned torch pulls a CUDA build).
"$venv/bin/pip" install -q "torch==2.13.0"
"$venv/bin/pip" install -q -e ".[test]"
{
  echo "# The resolved stack (pip constraints): scripts/setup.sh and docker/Dockerfile install under it, so two"
  echo "# checkouts of one commit compute with the same packages. Written by \`make lock\` (scripts/lock.sh) from"
  echo "# pyproject.toml on $(date -u +%F), Python $("$venv/bin/python" -c 'import platform; print(platform.python_version())'); do not edit by hand."
  # Local version labels dropped: torch==2.13.0 admits the CPU build here and the CUDA build on a GPU worker.
  "$venv/bin/pip" freeze --exclude-editable | sed 's/+[^ ]*$//'
} > constraints.txt.tmp
mv constraints.txt.tmp constraints.txt
echo "constraints.txt: $(grep -c '==' constraints.txt) pins"
