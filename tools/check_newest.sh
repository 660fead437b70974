#!/usr/bin/env bash
# The newest releases of every dependency, on each Python that is installed: for every
# interpreter found (python3.11, python3.12, python3.13 on PATH or under pyenv), a fresh virtual
# environment gets the newest versions pip resolves and runs a representative subset.
#
#   tools/check_newest.sh                 # every interpreter found, the subset below
#   PYTHONS="python3.13" tools/check_newest.sh tests/test_x.py
#
# Not part of .ci/run: its result changes with every upstream release, so it is run by hand (and
# before a release; RELEASING.md).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
subset=(tests/test_sharpness.py tests/test_policies.py tests/test_flax.py tests/test_flax_nnx.py
        tests/test_distributed.py)
tests=("${@:-${subset[@]}}")
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

find_python() {  # find_python 3.12 -> the path of a working python3.12, or nothing
  local candidate
  for candidate in "$(command -v "python$1" || true)" \
                   "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/"$1".*/bin/"python$1"; do
    if [[ -x "$candidate" ]] && "$candidate" -c "" 2>/dev/null; then
      echo "$candidate"
      return
    fi
  done
}

pythons=()
if [[ -n "${PYTHONS:-}" ]]; then
  read -ra pythons <<<"$PYTHONS"
else
  for minor in 3.11 3.12 3.13; do
    found="$(find_python "$minor")"
    [[ -z "$found" ]] || pythons+=("$found")
  done
fi
[[ ${#pythons[@]} -gt 0 ]] || { echo "no Python 3.11+ interpreter found" >&2; exit 1; }

status=0
for python in "${pythons[@]}"; do
  venv="$work/venv-$(basename "$python")"
  echo "=== $("$python" --version) ($python)"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip
  "$venv/bin/python" -m pip install --quiet --upgrade "$root[test-core]"
  "$venv/bin/python" -c "
from importlib.metadata import version
print('newest:', ', '.join(f'{n}=={version(n)}' for n in
      ('jax', 'jaxlib', 'optax', 'chex', 'flax', 'numpy')))"
  (cd "$root" && "$venv/bin/python" -m pytest -p no:cacheprovider -q -n 2 "${tests[@]}") ||
    status=1
done
exit "$status"
