"""The documentation site builds without a warning and documents every public name."""

import html
import pathlib
import re
import shutil
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


# The tests that read the built site are meant to run on one pytest-xdist worker (pyproject.toml:
# --dist loadgroup), so that the site is built once, not once a worker. pytest-xdist 3.8 does not
# apply the group under pytest 9.2 (each worker then builds it: seconds, not a wrong result).
SITE = pytest.mark.xdist_group("built_site")


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


@SITE
def test_site_builds_without_warnings(built_site):
  assert (built_site / "index.html").exists()


@SITE
@pytest.mark.parametrize("name", public_names())
def test_api_reference_renders(built_site, name):
  assert f'id="{name}"' in (built_site / "api.html").read_text(), f"{name} is not on api.html"


@SITE
def test_pages_load_nothing_from_the_network(built_site):
  """Scripts, styles and images come from the site itself (MathJax included): it works offline."""
  remote = re.compile(r"<(?:script|link|img)\b[^>]*\b(?:src|href)=\"(?:https?:)?//[^\"]*\"[^>]*>")
  for page in built_site.rglob("*.html"):
    assert not remote.findall(page.read_text()), f"{page.name} loads a remote resource"
  assert (built_site / "_static" / "mathjax" / "tex-chtml.js").exists()
  concepts = (built_site / "concepts.html").read_text()
  assert 'src="_static/mathjax/tex-chtml.js"' in concepts
  # \text{minimize\_fp} needs the textmacros extension, which the offline bundle must hold.
  assert '"textmacros"' in concepts
  assert (built_site / "_static/mathjax/input/tex/extensions/textmacros.js").exists()


@SITE
def test_signatures_show_only_public_names(built_site):
  text = (built_site / "api.html").read_text()
  signatures = [
    html.unescape(re.sub(r"<[^>]+>", "", dt))
    for dt in re.findall(r'<dt class="sig sig-object py".*?</dt>', text, re.S)
  ]
  assert len(signatures) > 40
  private = re.compile(r"_src|\bpert\.|jaxlib|TypeAliasForwardRef|ArrayTree")
  leaks = [s.strip() for s in signatures if private.search(s)]
  assert not leaks, f"private names in signatures: {leaks}"
  gsam = next(s for s in signatures if s.strip().startswith("optax_gsam.gsam("))
  assert "adaptive: optax_gsam.typing.Adaptive = None" in gsam


def test_nitpick_fails_on_a_broken_optax_or_jax_reference(tmp_path):
  """The docs' own configuration, on a page with one good and two misspelt external names."""
  source = tmp_path / "docs"
  shutil.copytree(DOCS / "_inventories", source / "_inventories")
  shutil.copy(DOCS / "conf.py", source / "conf.py")
  (source / "index.md").write_text(
    "# Page\n\n{class}`optax.Schedule`, {class}`optax.Shedule` and {class}`jax.Aray`.\n"
  )
  command = [sys.executable, "-m", "sphinx", "-q", "-b", "html", str(source), str(tmp_path / "out")]
  result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
  warnings = [line for line in result.stderr.splitlines() if "WARNING" in line]
  assert len(warnings) == 2, result.stderr
  assert "optax.Shedule" in warnings[0] and "jax.Aray" in warnings[1]
