"""The release metadata agrees with itself: floors, links, licence, typing marker, release checks."""

import ast
import importlib.util
import pathlib
import re
import sys
import tomllib

import pytest
from packaging.version import Version

import optax_gsam

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
REPO_URL = "https://github.com/optax-gsam/optax_gsam"


def _load_tool(name: str):
  """Imports ``tools/<name>.py`` (the folder is not a package)."""
  spec = importlib.util.spec_from_file_location(f"_tools_{name}", ROOT / "tools" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module


def test_floors_file_pins_every_dependency_at_its_declared_floor():
  declared = {}
  # chex is a test dependency, pinned too: the floor subset asserts with it.
  test_core = PYPROJECT["project"]["optional-dependencies"]["test-core"]
  chex = [r.split("#")[0].strip() for r in test_core if r.startswith("chex")]
  for requirement in PYPROJECT["project"]["dependencies"] + chex:
    name, floor = re.fullmatch(r"([\w.-]+)>=([\w.]+)", requirement).groups()
    declared[name.lower()] = Version(floor)
  lines = (ROOT / "tools" / "floors.txt").read_text().splitlines()
  pins = (line.split("==") for line in lines if line and not line.startswith("#"))
  assert {name: Version(pin) for name, pin in pins} == declared


def test_python_floor_matches_the_oldest_classifier():
  floor = re.fullmatch(r">=3\.(\d+)", PYPROJECT["project"]["requires-python"]).group(1)
  minors = [
    int(c.rsplit(".", 1)[1])
    for c in PYPROJECT["project"]["classifiers"]
    if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)
  ]
  assert min(minors) == int(floor)


def test_licence_and_typing_marker_ship():
  assert PYPROJECT["project"]["license"] == "Apache-2.0"
  for pattern in PYPROJECT["project"]["license-files"]:
    assert list(ROOT.glob(pattern)), f"license-files names {pattern}, which does not exist"
  assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]
  assert (ROOT / "optax_gsam" / "py.typed").exists()
  assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["optax_gsam"]


def test_readme_links_into_the_repository_name_existing_files():
  text = (ROOT / "README.md").read_text()
  links = re.findall(rf"\]\({re.escape(REPO_URL)}/(?:blob|tree)/main/([^)#\s]+)", text)
  assert len(links) >= 10, "the README should link to the docs pages"
  missing = [path for path in links if not (ROOT / path).exists()]
  assert not missing, f"README links to files that do not exist: {missing}"
  # No bare checkout paths left where a reader on a package index needs a link.
  assert not re.search(r"(?<![/\[`(])docs/\w+\.md", text.split("## Layout")[0])


def test_project_urls_point_at_the_repository():
  urls = PYPROJECT["project"]["urls"]
  assert {"Homepage", "Documentation", "Source", "Issues", "Changelog"} <= set(urls)
  assert all(url.startswith(REPO_URL) for url in urls.values())


def test_release_version_checks():
  release = _load_tool("release")
  assert release.package_version() == optax_gsam.__version__
  release.check_tag(f"v{optax_gsam.__version__}", optax_gsam.__version__)
  release.check_tag(optax_gsam.__version__, optax_gsam.__version__)
  with pytest.raises(release.ReleaseError, match="does not match"):
    release.check_tag("v99.0.0", optax_gsam.__version__)
  release.check_changelog(optax_gsam.__version__)
  with pytest.raises(release.ReleaseError, match=re.escape("no '## 99.0.0' section")):
    release.check_changelog("99.0.0")


def test_changelog_starts_with_unreleased_then_versions():
  headings = re.findall(r"^## (.+)$", (ROOT / "CHANGELOG.md").read_text(), re.M)
  assert headings[0] == "Unreleased"
  assert "0.1.0" in headings


def test_committed_inventories_are_what_the_tool_writes(tmp_path, monkeypatch):
  pytest.importorskip("sphinx")
  tool = _load_tool("make_inventories")
  monkeypatch.setattr(tool, "OUT", tmp_path)
  for project, (base_url, entries) in tool.INVENTORIES.items():
    written = tool.write(project, base_url, entries)
    tool.check(written, base_url, entries)
    committed = ROOT / "docs" / "_inventories" / f"{project}.inv"
    assert committed.read_bytes() == written.read_bytes(), (
      f"{committed} is stale: run python tools/make_inventories.py"
    )


def code_lines(function: ast.AST, source_lines: list[str]) -> int:
  """Non-blank, non-comment lines of a function, its docstring excluded (nested ones count)."""
  body = function.body
  if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
    docstring = range(body[0].lineno, body[0].end_lineno + 1)
  else:
    docstring = range(0)
  lines = range(function.lineno, function.end_lineno + 1)
  return sum(
    1
    for n in lines
    if n not in docstring
    and source_lines[n - 1].strip()
    and not source_lines[n - 1].strip().startswith("#")
  )


def test_no_function_in_the_package_exceeds_60_lines_of_code():
  package = pathlib.Path(optax_gsam.__file__).parent
  too_long = []
  for path in sorted(package.rglob("*.py")):
    source = path.read_text()
    tree, lines = ast.parse(source), source.splitlines()
    for node in ast.walk(tree):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        n = code_lines(node, lines)
        if n > 60:
          too_long.append(f"{path.relative_to(package)}:{node.name} ({n})")
  assert not too_long, too_long


def test_every_test_file_the_tools_and_ci_name_exists():
  named = {
    name
    for script in [*sorted((ROOT / "tools").glob("*.sh")), ROOT / ".ci" / "run"]
    for line in script.read_text().splitlines()
    if not line.lstrip().startswith("#")  # usage examples in comments name placeholders
    for name in re.findall(r"tests/\w+\.py", line)
  }
  assert named, "the tools name no test files: the pattern is stale"
  assert sorted(n for n in named if not (ROOT / n).exists()) == []
