"""What is live at a compiled step's peak, read from XLA's dumps (``sharded.py --dump``).

The TPU compiler's ``*after_optimizations-live-range.txt`` ends with a "Stack trace breakdown
for peak usage": every buffer live at the peak, named by the JAX operation (its ``op_name``
path, e.g. ``jit(step)/transpose(jvp(Decoder))/while``) or the argument (``opt_state[1][0].mu
['blocks']['up']['kernel']``) it holds, with its bytes. This module reads that list and groups
it, so that two steps' peaks can be compared buffer by buffer.

    python -m benchmarks.compiled.buffers DUMP/f32-gsam DUMP/f32-adamw [--shard-bytes N] [--top 25]
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import re

_LEAF = re.compile(r"^[\s│├└─]*(.+?) \([\d.]+%, total: ([\d ]+) bytes, current: ([\d ]+) bytes")


def peak_buffers(live_range_text: str) -> list[tuple[str, int]]:
  """``(name, bytes)`` of every buffer live at the peak (the breakdown's nodes with bytes)."""
  _, _, breakdown = live_range_text.partition("Stack trace breakdown for peak usage")
  found = []
  for line in breakdown.splitlines()[1:]:
    match = _LEAF.match(line)
    if match and int(match[3].replace(" ", "")):
      found.append((match[1].strip(), int(match[3].replace(" ", ""))))
  return found


def peak_bytes(live_range_text: str) -> int:
  """The breakdown's total: the heap's bytes at the peak (temporaries and arguments)."""
  found = re.search(r"Stack trace breakdown for peak usage: ([\d ]+) bytes", live_range_text)
  return int(found[1].replace(" ", "")) if found else 0


def label(name: str) -> str:
  """A buffer's group: its argument tree's top level, or its operation without the tuple index."""
  for argument in ("params", "opt_state", "tokens"):
    if name.startswith(argument):
      return argument + ("" if argument == "tokens" else " (argument)")
  positional = re.match(r"args\[\d+\]", name)  # a wrapped step's arguments, by position
  if positional:
    return f"{positional[0]} (argument)"
  if re.fullmatch(r"[A-Za-z_]\w*", name):  # a parameter leaf, named by its key (``kernel``)
    return "params (argument)"
  if name.startswith("copy-start"):
    return "copy-start (argument copies)"
  name = re.sub(r"\{\d+\}$", "", re.sub(r"^jit\(\w+\)/(shard_map/)?", "", name))
  return name


def grouped(buffers: list[tuple[str, int]]) -> dict[str, tuple[int, int]]:
  """``label -> (buffers, bytes)``, largest first."""
  groups: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
  for name, size in buffers:
    entry = groups[label(name)]
    entry[0] += 1
    entry[1] += size
  return dict(sorted(((k, tuple(v)) for k, v in groups.items()), key=lambda kv: -kv[1][1]))


def read(folder: pathlib.Path, module: str = "jit_step") -> str:
  """The live-range dump of the program ``module`` in ``folder`` (the last one XLA numbered, if
  dumped twice: ``module_0007.jit_step...`` after ``module_0000.jit_step...``)."""
  found = sorted(folder.glob(f"module_*.{module}.*after_optimizations-live-range.txt"))
  if not found:
    raise FileNotFoundError(f"no live-range dump of {module} in {folder}")
  return found[-1].read_text()


def request_dumps(folder: str | pathlib.Path) -> None:
  """Asks XLA for its dumps (HLO text, buffer assignment, live ranges) of every program compiled
  from now on, into ``folder``: ``XLA_FLAGS`` is read when the backend starts, so call it before."""
  flags = f"--xla_dump_to={folder} --xla_dump_hlo_as_text"
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flags).strip()


def slug(row: str) -> str:
  """A folder name for a row's dumps (``f32 gsam mb=4`` -> ``f32_gsam_mb4``)."""
  return row.replace(", ", "_").replace(" ", "_").replace("=", "").replace("/", "")


def compare(folders: list[pathlib.Path], shard_bytes: int, top: int) -> str:
  """A table: each group's bytes at each step's peak, in MiB and in parameter shards."""
  tables = [grouped(peak_buffers(read(f))) for f in folders]
  totals = [sum(b for _, b in t.values()) for t in tables]
  keys = sorted(
    {k for t in tables for k in t}, key=lambda k: -max(t.get(k, (0, 0))[1] for t in tables)
  )
  unit = shard_bytes or 1
  lines = ["group | " + " | ".join(f"{f.name} n, MiB, shards" for f in folders)]
  for key in keys[:top]:
    cells = []
    for t in tables:
      n, b = t.get(key, (0, 0))
      cells.append(f"{n}, {b / 2**20:.1f}, {b / unit:.2f}")
    lines.append(f"{key[:110]} | " + " | ".join(cells))
  lines.append(
    "total at the peak | " + " | ".join(f"{b / 2**20:.1f} MiB, {b / unit:.2f}" for b in totals)
  )
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("folders", nargs="+", type=pathlib.Path)
  parser.add_argument("--shard-bytes", type=int, default=0, help="one core's parameter bytes")
  parser.add_argument("--top", type=int, default=25)
  args = parser.parse_args(argv)
  print(compare(args.folders, args.shard_bytes, args.top))


if __name__ == "__main__":
  main()
