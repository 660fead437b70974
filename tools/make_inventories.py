"""Writes docs/_inventories/*.inv: the intersphinx inventories of the names the docs link to.

  python tools/make_inventories.py

The docs build has no network, so it cannot download the objects.inv of Python, NumPy, JAX,
optax or Flax. These small local inventories list the names that optax_gsam's signatures and
pages reference, with their URLs on each project's documentation site, so that
``nitpicky = True`` resolves them and a misspelt or vanished name fails the build. They are
written with Sphinx's own inventory writer (``sphinx.util.inventory.InventoryFile.dump``) and
read back with its reader. When a new external name appears in a signature, the docs build fails
with ``reference target not found: <name>``: add the name to ``INVENTORIES`` below, with the
page that documents it upstream, and run this script again.
"""

from __future__ import annotations

import pathlib
import types

from sphinx.util.inventory import InventoryFile

OUT = pathlib.Path(__file__).resolve().parents[1] / "docs" / "_inventories"

# project -> (base URL, {name: (role, page#anchor relative to the base URL)}). A trailing "$"
# in the anchor stands for the name, as in Sphinx's own inventories.
INVENTORIES: dict[str, tuple[str, dict[str, tuple[str, str]]]] = {
  "python": (
    "https://docs.python.org/3/",
    {
      f"collections.abc.{name}": ("class", "library/collections.abc.html#$")
      for name in ("Callable", "Hashable", "Mapping", "Sequence")
    },
  ),
  "jax": (
    "https://docs.jax.dev/en/latest/",
    {
      "jax.Array": ("class", "_autosummary/jax.Array.html#$"),
      "jax.sharding.Mesh": ("class", "jax.sharding.html#$"),
      "jax.sharding.Sharding": ("class", "jax.sharding.html#$"),
    },
  ),
  "optax": (
    "https://optax.readthedocs.io/en/latest/",
    {
      **{
        f"optax.{name}": ("class", "api/transformations.html#$")
        for name in (
          "GradientTransformation",
          "GradientTransformationExtraArgs",
          "OptState",
          "Params",
          "Updates",
        )
      },
      # optax documents its Schedule as optax.schedules.Schedule; ScalarOrSchedule (a float or a
      # Schedule) has no entry of its own upstream, so it links to the schedules page.
      "optax.Schedule": ("class", "api/optimizer_schedules.html#optax.schedules.Schedule"),
      "optax.ScalarOrSchedule": ("class", "api/optimizer_schedules.html"),
    },
  ),
}


class _Domain:
  """The part of a Sphinx domain that ``InventoryFile.dump`` reads."""

  name = "py"

  def __init__(self, entries: dict[str, tuple[str, str]]):
    self._entries = entries

  def get_objects(self):
    for name, (role, target) in sorted(self._entries.items()):
      page, _, anchor = target.partition("#")
      anchor = anchor.replace("$", name)
      yield name, name, role, page, anchor, 1


def write(project: str, base_url: str, entries: dict[str, tuple[str, str]]) -> pathlib.Path:
  """One inventory, written by Sphinx's writer; URIs are relative to ``base_url``."""
  domain = _Domain(entries)
  env = types.SimpleNamespace(
    config=types.SimpleNamespace(project=project, version=""),
    domains=types.SimpleNamespace(sorted=lambda: [domain]),
  )
  builder = types.SimpleNamespace(get_target_uri=lambda docname: docname)
  path = OUT / f"{project}.inv"
  InventoryFile.dump(path, env, builder)
  return path


def check(path: pathlib.Path, base_url: str, entries: dict[str, tuple[str, str]]) -> None:
  """Reads the file back with Sphinx's reader: every name, with its full URL."""
  with path.open("rb") as f:
    inventory = InventoryFile.load(f, base_url, lambda base, uri: base + uri)
  urls = {name: item.uri for objects in inventory.values() for name, item in objects.items()}
  assert set(urls) == set(entries), (path, set(urls) ^ set(entries))
  assert all(url.startswith(base_url) for url in urls.values()), urls


def main() -> None:
  OUT.mkdir(parents=True, exist_ok=True)
  for project, (base_url, entries) in INVENTORIES.items():
    path = write(project, base_url, entries)
    check(path, base_url, entries)
    print(f"{path.relative_to(OUT.parents[1])}: {len(entries)} names")


if __name__ == "__main__":
  main()
