"""Every python block in README.md and docs/*.md runs, in order, per file."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(page: pathlib.Path) -> list[str]:
  return BLOCK.findall(page.read_text())


@pytest.mark.parametrize(
  "page", [p for p in PAGES if python_blocks(p)], ids=lambda p: str(p.relative_to(ROOT))
)
def test_page_examples_run(page, capsys):
  namespace = {"__name__": f"docs_{page.stem}"}
  for block in python_blocks(page):
    exec(compile(block, str(page), "exec"), namespace)
