"""Every python block in README.md and docs/*.md runs, in order, per file."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(page: pathlib.Path) -> list[str]:
  return BLOCK.findall(page.read_text())


# The pages whose examples take over 10 s on two cores: they run apart (-m long_examples), under
# each instruction set CI checks, so the README's suite stays inside its time on two cores.
LONG_PAGES = frozenset(
  {
    "docs/directions.md",
    "docs/equinox.md",
    "docs/flax.md",
    "docs/gradient_cache.md",
    "docs/haiku.md",
    "docs/large_batches.md",
    "docs/sharded.md",
    "docs/sharpness.md",
  }
)


def _marked(page: pathlib.Path):
  """A page's parameter, marked ``float16`` where its examples compute in float16 (conftest.py)
  and ``long_examples`` where they are among the slowest."""
  marks = []
  if any("float16" in block for block in python_blocks(page)):
    marks.append(pytest.mark.float16)
  if str(page.relative_to(ROOT)) in LONG_PAGES:
    marks.append(pytest.mark.long_examples)
  return pytest.param(page, marks=marks)


@pytest.mark.parametrize(
  "page", [_marked(p) for p in PAGES if python_blocks(p)], ids=lambda p: str(p.relative_to(ROOT))
)
def test_page_examples_run(page, capsys):
  namespace = {"__name__": f"docs_{page.stem}"}
  for block in python_blocks(page):
    exec(compile(block, str(page), "exec"), namespace)


def test_the_long_pages_exist():
  """A renamed page must not drop out of every run."""
  assert all((ROOT / page).is_file() for page in LONG_PAGES)


def test_every_test_named_in_the_docs_exists():
  """Each `file::test` that a page cites is a test function defined in that file."""
  named = [
    (page, module, test)
    for page in [*PAGES, ROOT / "benchmarks" / "README.md"]
    for module, test in re.findall(r"`(test_\w+\.py)::(test_\w+)`", page.read_text())
  ]
  assert sum(page.name == "guarantees.md" for page, _, _ in named) > 20
  for page, module, test in named:
    source = (ROOT / "tests" / module).read_text()
    assert re.search(rf"^def {test}\(", source, re.M), f"{page.name} cites {module}::{test}"
