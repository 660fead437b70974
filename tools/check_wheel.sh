#!/usr/bin/env bash
# What users install is what is tested: builds the sdist, builds the wheel from that sdist, checks
# both with `twine check --strict`, installs the wheel alone into a fresh virtual environment and
# runs tests from the sdist against the installed package, outside any checkout (so `import
# optax_gsam` can only find the installed copy).
#
#   tools/check_wheel.sh                 # the subset below, and the package's doctests
#   tools/check_wheel.sh tests/test_x.py # other tests (paths inside the sdist's tests/)
#
# Needs `build` and `twine` (pip install -e ".[release]"). PYTHON picks the interpreter (default
# python3); WHEEL_CHECK_DIR keeps the work folder (default: a temporary one, removed at exit).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
work="${WHEEL_CHECK_DIR:-$(mktemp -d)}"
[[ -n "${WHEEL_CHECK_DIR:-}" ]] || trap 'rm -rf "$work"' EXIT
subset=(tests/test_sharpness.py tests/test_policies.py tests/test_flax.py tests/test_flax_nnx.py
        tests/test_distributed.py tests/test_user_functions.py tests/test_gradient_cache.py)
tests=("${@:-${subset[@]}}")

rm -rf "$work/dist" "$work/venv" "$work/sdist" "$work/run"
mkdir -p "$work"
"$python" -m build --outdir "$work/dist" "$root" >"$work/build.log" 2>&1 ||
  { cat "$work/build.log"; exit 1; }
"$python" -m twine check --strict "$work"/dist/*
sdist=("$work"/dist/optax_gsam-*.tar.gz)
wheel=("$work"/dist/optax_gsam-*.whl)
echo "built: $(basename "${sdist[0]}") $(basename "${wheel[0]}")"

# The wheel holds the package and its metadata only, with py.typed and the licence.
"$python" - "${wheel[0]}" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
outside = [n for n in names if not n.startswith(("optax_gsam/", "optax_gsam-"))]
assert not outside, f"the wheel holds files outside the package: {outside}"
assert "optax_gsam/py.typed" in names, "the wheel lacks optax_gsam/py.typed"
assert any(n.endswith("licenses/LICENSE") for n in names), "the wheel lacks LICENSE"
PY

# Tests come from the sdist: this also checks that it ships everything they need.
mkdir -p "$work/sdist" "$work/run"
tar -xzf "${sdist[0]}" -C "$work/sdist" --strip-components=1
cp -r "$work/sdist/tests" "$work/sdist/conftest.py" "$work/sdist/pyproject.toml" "$work/run/"

"$python" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install --quiet --upgrade pip
"$work/venv/bin/python" -m pip install --quiet "${wheel[0]}[test-core]"
cd "$work/run"
"$work/venv/bin/python" - "$work/venv" <<'PY'
import pathlib, sys
import optax_gsam
where = pathlib.Path(optax_gsam.__file__).resolve()
assert where.is_relative_to(pathlib.Path(sys.argv[1]).resolve()), f"imported {where}"
print(f"optax_gsam {optax_gsam.__version__} from {where.parent}")
PY
# The README's train step, run by the installed package alone.
"$work/venv/bin/python" - "$work/sdist/README.md" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
block = re.search(r"^## A train step\n.*?^```python\n(.*?)^```", text, re.S | re.M).group(1)
exec(compile(block, "README.md: A train step", "exec"), {"__name__": "readme"})
PY
# --pyargs collects the doctests of the installed package (pyproject's addopts has
# --doctest-modules); conftest.py sets up the 8 CPU devices first.
"$work/venv/bin/python" -m pytest -p no:cacheprovider -q -n 2 "${tests[@]}" --pyargs optax_gsam
