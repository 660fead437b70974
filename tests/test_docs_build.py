"""The documentation site builds without a warning and documents every public name."""

import pathlib
import re
import subprocess
import sys

import pytest

import optax_gsam
import optax_gsam.big_vision
import optax_gsam.flax
import optax_gsam.launch
import optax_gsam.typing

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PUBLIC_MODULES = {
  "optax_gsam": optax_gsam,
  "optax_gsam.flax": optax_gsam.flax,
  "optax_gsam.big_vision": optax_gsam.big_vision,
  "optax_gsam.launch": optax_gsam.launch,
  "optax_gsam.typing": optax_gsam.typing,
}


def public_names() -> list[str]:
  return [
    f"{prefix}.{name}" for prefix, module in PUBLIC_MODULES.items() for name in module.__all__
  ]


def test_api_page_names_every_public_name():
  text = (DOCS / "api.md").read_text()
  documented = set(re.findall(r"^\.\. auto(?:function|class):: ([\w.]+)", text, re.M))
  modules = set(re.findall(r"^\.\. automodule:: ([\w.]+)\n\s+:members:", text, re.M))
  missing = [
    name
    for name in public_names()
    if name not in documented and name.rsplit(".", 1)[0] not in modules - {"optax_gsam"}
  ]
  assert not missing, f"docs/api.md does not document {missing}"
  assert all(n.startswith("optax_gsam.") for n in documented)


def test_every_page_is_in_a_toctree():
  index = (DOCS / "index.md").read_text()
  listed = set(re.findall(r"^([\w/]+)$", index, re.M))
  pages = {p.relative_to(DOCS).with_suffix("").as_posix() for p in DOCS.glob("*.md")}
  assert pages - {"index"} <= listed, (
    f"pages missing from the toctree: {pages - listed - {'index'}}"
  )


@pytest.fixture(scope="module")
def built_site(tmp_path_factory) -> pathlib.Path:
  out = tmp_path_factory.mktemp("site")
  command = [
    sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
    "-d", str(out / "doctrees"), str(DOCS), str(out / "html"),
  ]  # fmt: skip
  result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, f"sphinx-build failed:\n{result.stdout}\n{result.stderr}"
  return out / "html"


def test_site_builds_without_warnings(built_site):
  assert (built_site / "index.html").exists()


@pytest.mark.parametrize("name", public_names())
def test_api_reference_renders(built_site, name):
  assert f'id="{name}"' in (built_site / "api.html").read_text(), f"{name} is not on api.html"
