"""The house's rules, read from the source: imports run one way, and modules stay small.

``optax_gsam/_src/`` is one folder per concern, on floors. A module imports from its own
folder or from a lower floor, never from a higher one nor from another folder on its floor,
and no chain of imports comes back to where it started.
"""

import ast
import pathlib
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "optax_gsam"
SOURCE = PACKAGE / "_src"
BENCHMARKS = PACKAGE.parent / "benchmarks"

FLOORS = {
  "core": 0,
  "calls": 1,
  "directions": 1,
  "parallel": 1,
  "gradient_cache": 1,
  "policies": 2,
  "microbatches": 2,
  "fine_tuning": 2,
  "measures": 2,
  "trajectory": 2,
  "step": 3,
  "transforms": 4,
}
LONGEST_MODULE = 600  # lines


def _module_name(path):
  return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")


def _imports(path):
  """The optax_gsam modules that ``path`` imports, wherever in the file (functions too)."""
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("optax_gsam"):
      for alias in node.names:  # `from optax_gsam._src.step import step` imports a module
        candidate = f"{node.module}.{alias.name}"
        names.add(candidate if _path_of(candidate) else node.module)
    elif isinstance(node, ast.Import):
      names.update(a.name for a in node.names if a.name.startswith("optax_gsam"))
  return names


def _path_of(module):
  relative = pathlib.Path(*module.split(".")[1:])
  for candidate in (PACKAGE / relative.with_suffix(".py"), PACKAGE / relative / "__init__.py"):
    if candidate.is_file():
      return candidate
  return None


def _folder(module):
  parts = module.split(".")
  return parts[2] if len(parts) > 3 and parts[1] == "_src" else None


def _graph():
  modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
  return {
    name: {m for m in _imports(path) if m in modules and m != name}
    for name, path in modules.items()
  }


def test_every_folder_of_the_source_has_a_floor():
  folders = {p.name for p in SOURCE.iterdir() if p.is_dir() and p.name != "__pycache__"}
  assert folders == set(FLOORS)
  assert sorted(p.name for p in SOURCE.glob("*.py")) == ["__init__.py"], (
    "a module outside the folders"
  )


def test_no_module_imports_a_higher_floor_or_a_neighbouring_folder():
  wrong = []
  for name, imported in _graph().items():
    folder = _folder(name)
    if folder is None:
      continue
    for other in imported:
      other_folder = _folder(other)
      if other_folder is None:
        assert other == "optax_gsam.typing", f"{name} imports the public {other}"
      elif other_folder != folder and FLOORS[other_folder] >= FLOORS[folder]:
        wrong.append(
          f"{name} (floor {FLOORS[folder]}) imports {other} (floor {FLOORS[other_folder]})"
        )
  assert not wrong, "\n".join(wrong)


def test_no_import_circle():
  graph = _graph()
  done, path = set(), []

  def visit(name):
    if name in path:
      pytest.fail("import circle: " + " -> ".join([*path[path.index(name) :], name]))
    if name in done:
      return
    path.append(name)
    for other in sorted(graph[name]):
      visit(other)
    path.pop()
    done.add(name)

  for name in sorted(graph):
    visit(name)


def test_the_checks_see_a_circle_and_a_higher_floor(monkeypatch):
  graph = {
    "optax_gsam._src.core.a": {"optax_gsam._src.step.b"},
    "optax_gsam._src.step.b": {"optax_gsam._src.core.a"},
  }
  monkeypatch.setattr(sys.modules[__name__], "_graph", lambda: graph)
  with pytest.raises(AssertionError, match="floor 0"):
    test_no_module_imports_a_higher_floor_or_a_neighbouring_folder()
  with pytest.raises(pytest.fail.Exception, match="import circle"):
    test_no_import_circle()


@pytest.mark.parametrize(
  "path",
  sorted([*PACKAGE.rglob("*.py"), *BENCHMARKS.rglob("*.py")]),
  ids=lambda p: str(p.relative_to(PACKAGE.parent)),
)
def test_no_module_is_longer_than_600_lines(path):
  assert len(path.read_text().splitlines()) <= LONGEST_MODULE
