"""The public names, as ``__all__`` lists them, are the ones docs/api.md and the README name.

Reads the files; builds no docs. A direction added to ``optax_gsam/__init__.py`` fails here
until docs/api.md, the README's list and the table of docs/directions.md name it too.
"""

import pathlib
import re

import pytest

import optax_gsam
import optax_gsam.flax

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _read(name):
  return (ROOT / name).read_text(encoding="utf-8")


def _section(text, heading):
  """The lines of ``text`` from the heading ``heading`` to the next heading of its level."""
  level = heading.split(" ")[0]
  start = text.index(heading + "\n")
  end = text.find("\n" + level + " ", start + len(heading))
  return text[start : None if end == -1 else end]


def _documented(text, module="optax_gsam"):
  """The names of ``module`` that the autodoc directives of ``text`` document."""
  pattern = rf"^\.\. auto(?:function|class):: {re.escape(module)}\.(\w+)(?:\(|\s*$)"
  return set(re.findall(pattern, text, flags=re.MULTILINE))


DIRECTIONS = {name for name in optax_gsam.__all__ if name.endswith("_ascent")}


def test_all_is_sorted_unique_and_importable():
  assert list(optax_gsam.__all__) == sorted(set(optax_gsam.__all__))
  for name in optax_gsam.__all__:
    assert getattr(optax_gsam, name) is not None


def test_api_page_documents_exactly_all():
  assert _documented(_read("docs/api.md")) == set(optax_gsam.__all__)


def test_api_page_documents_the_flax_module():
  section = _section(_read("docs/api.md"), "## `optax_gsam.flax`")
  assert _documented(section, "optax_gsam.flax") == set(optax_gsam.flax.__all__)


def _api_directions():
  section = _section(_read("docs/api.md"), "## Ascent directions")
  return set(re.findall(r"^\.\. autofunction:: optax_gsam\.(\w+)\s*$", section, re.MULTILINE))


def _readme_directions():
  bullet = re.search(r"- \*\*Any ascent direction\*\*.*?\n(?=- \*\*)", _read("README.md"), re.S)
  return set(re.findall(r"`(\w+_ascent)`", bullet[0]))


def _guide_directions():
  table = _section(_read("docs/directions.md"), "## The directions")
  rows = [line for line in table.splitlines() if line.startswith("| {func}")]
  return {re.match(r"\| \{func\}`~optax_gsam\.(\w+)`", row)[1] for row in rows}


@pytest.mark.parametrize(
  "names", [_api_directions, _readme_directions, _guide_directions], ids=["api", "readme", "guide"]
)
def test_every_list_of_directions_names_the_public_ones(names):
  assert DIRECTIONS, "no public direction found"
  assert names() == DIRECTIONS
