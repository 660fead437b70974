#!/usr/bin/env bash
# The declared version floors work: a fresh virtual environment with every dependency at exactly
# its floor (tools/floors.txt) runs a representative subset of the suite.
#
#   tools/check_floors.sh                 # the subset below
#   tools/check_floors.sh tests/test_x.py # other tests
#
# PYTHON picks the interpreter (default python3; the floors need 3.11, requires-python's floor).
# FLOORS_VENV keeps the environment at that path (default: a temporary one, removed at exit).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
venv="${FLOORS_VENV:-$(mktemp -d)/venv}"
[[ -n "${FLOORS_VENV:-}" ]] || trap 'rm -rf "$(dirname "$venv")"' EXIT
subset=(tests/test_sharpness.py tests/test_policies.py tests/test_flax.py tests/test_flax_nnx.py
        tests/test_distributed.py tests/test_sharded.py)
tests=("${@:-${subset[@]}}")

rm -rf "$venv"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
# The test tools (pytest, hypothesis) are not floored: the package's dependencies and chex are.
"$venv/bin/python" -m pip install --quiet -c "$root/tools/floors.txt" "$root[test-core]"
"$venv/bin/python" - "$root/tools/floors.txt" <<'PY'
import sys
from importlib.metadata import version
pins = [line.split("==") for line in open(sys.argv[1]) if "==" in line and not line.startswith("#")]
wrong = [f"{name}=={version(name)} (floor {pin.strip()})" for name, pin in pins
         if version(name) != pin.strip()]
assert not wrong, f"not at the floors: {wrong}"
print("floors:", ", ".join(f"{name}=={pin.strip()}" for name, pin in pins))
PY
# From the checkout (its conftest.py sets up the 8 CPU devices); the root goes first on sys.path,
# so the code tested is the checkout's, on the floors' dependencies.
cd "$root"
"$venv/bin/python" -m pytest -p no:cacheprovider -q -n 2 "${tests[@]}"
