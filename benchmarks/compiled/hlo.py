"""What the TPU or GPU compiler reports for one compiled step: memory, cost, collectives and size.

Pure functions of a compiled program (``memory_analysis()``, ``cost_analysis()``) or of its HLO
text; ``tpu_compile.py`` builds the programs.
"""

from __future__ import annotations

import collections
import os
import re
from typing import Any

import numpy as np

HBM_BYTES = 16 * 2**30  # per TPU v3 core
ELEMENT_BYTES = {
  "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2,
  "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
}  # fmt: skip
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


def _shape_bytes(shape_text: str) -> int:
  total = 0
  for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", shape_text):
    if dtype in ELEMENT_BYTES:
      total += ELEMENT_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
  return total


# The start of an instruction's line in HLO text: ``[ROOT] [%]name = ``.
_HEAD = r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*"
_ANY_INSTRUCTION = re.compile(_HEAD, re.M)
_INSTRUCTION = re.compile(_HEAD + r"(.+?)\s+(" + "|".join(COLLECTIVES) + r")(-start)?\(", re.M)


def _top_level(shape_text: str) -> list[str]:
  """The elements of a tuple shape (the shape itself if it is not a tuple)."""
  text = shape_text.strip()
  if not text.startswith("("):
    return [text]
  parts, depth, current = [], 0, ""
  for ch in text[1:-1]:
    depth += {"(": 1, ")": -1, "{": 1, "}": -1}.get(ch, 0)
    if ch == "," and depth == 0:
      parts.append(current)
      current = ""
    else:
      current += ch
  return [*parts, current]


def collectives(hlo_text: str) -> dict[str, dict[str, int]]:
  """Collective ops in compiled HLO text, by kind: count and bytes of their results.

  An async op counts at its ``-start``. Except for all-reduce, whose result is
  its reduced operands, a ``-start`` returns ``(operands, results, ...)``, and
  only the results count. Both branches of a conditional are counted.
  """
  found: dict[str, dict[str, int]] = {}
  for shape, kind, start in _INSTRUCTION.findall(hlo_text):
    parts = _top_level(shape)
    nbytes = _shape_bytes(parts[1] if start and kind != "all-reduce" else shape)
    entry = found.setdefault(kind, {"count": 0, "bytes": 0})
    entry["count"] += 1
    entry["bytes"] += nbytes
  return found


_ALL_REDUCE = re.compile(_HEAD + r"(.+?)\s+all-reduce(?:-start)?\((.*)$", re.M)


def all_reduce_origins(hlo_text: str) -> dict[str, int]:
  """All-reduces by what they reduce, over which replica groups, and the JAX operation that
  asked for them (``op_name``): "scalars over [4,2]<=[8]: jit(step)/reduce_sum" -> count."""
  counts: collections.Counter[str] = collections.Counter()
  for shape, rest in _ALL_REDUCE.findall(hlo_text):
    scalars = all(not dims for dims in re.findall(r"\[([\d,]*)\]", shape))
    groups = re.search(r"replica_groups=(\{\{.*?\}\}|\S+?)(?:,\s|\s|$)", rest)
    operation = re.search(r'op_name="([^"]*)"', rest)
    key = (
      f"{'scalars' if scalars else 'arrays'} over {groups[1] if groups else '?'}: "
      f"{operation[1] if operation else '?'}"
    )
    counts[key] += 1
  return dict(counts.most_common())


_CONDITIONAL = re.compile(_HEAD + r"(.+?)\s+conditional\(", re.M)


def conditionals(hlo_text: str) -> list[dict[str, int]]:
  """Each ``conditional`` in compiled HLO: the bytes of its result tuple.

  (Its operands are printed by name only, so their bytes are not read here.)
  """
  return [{"result_bytes": _shape_bytes(shape)} for shape in _CONDITIONAL.findall(hlo_text)]


_KERNEL = re.compile(_HEAD + r".+?\s+(?:fusion|custom-call)\(.*$", re.M)
_FRAME = re.compile(r"stack_frame_id=(\d+)")


def program_size(hlo_text: str) -> dict[str, int]:
  """The optimized program's size, deterministic where its compile seconds are not: every
  computation's instructions (fused ones', reducers' and parameters included), and its kernels,
  the fusions and library calls (a GPU compiler emits and compiles each on its own; a fusion
  nested in another counts too, and unfused kernels such as collectives and sorts do not)."""
  return {
    "instructions": len(_ANY_INSTRUCTION.findall(hlo_text)),
    "kernels": len(_KERNEL.findall(hlo_text)),
  }


def _frame_functions(hlo_text: str) -> dict[int, str]:
  """Each stack frame's ``file:function``, from the tables that end the HLO text (the frame's
  own location: the innermost recorded one of the operation that names it)."""
  tables: dict[str, dict[int, str]] = {}
  section = None
  for line in hlo_text.splitlines():
    if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
      section = tables.setdefault(line, {})
    elif section is not None and (found := re.match(r"^(\d+) (.*)$", line)):
      section[int(found[1])] = found[2].strip('"')
    else:
      section = None

  def field(text: str, name: str) -> int:
    found = re.search(name + r"=(\d+)", text)
    return int(found[1]) if found else 0

  files, functions = tables.get("FileNames", {}), tables.get("FunctionNames", {})
  locations = {
    i: f"{files.get(field(text, 'file_name_id'), '?')}:"
    f"{functions.get(field(text, 'function_name_id'), '?')}"
    for i, text in tables.get("FileLocations", {}).items()
  }
  return {
    i: locations.get(field(text, "file_location_id"), "?")
    for i, text in tables.get("StackFrames", {}).items()
  }


def kernels_by_origin(hlo_text: str, package_dir: str | None = None) -> dict[str, int]:
  """Kernels of the optimized program by the package function whose own code traced each.

  The function is the innermost frame JAX recorded for the kernel's operation (jax's own frames
  are left out): a package module and function under ``package_dir`` (default: the installed
  optax_gsam's folder), relative to it. A kernel of the user's model counts as "other", even when
  the package calls the model; "unrecorded" are those whose operation carries no frame. An
  executable loaded from JAX's persistent compilation cache carries the frames of the process
  that compiled it, which may be another checkout's (this folder's ``__init__`` puts source
  locations in the cache's key for the scripts; a test compiles with the cache off).
  """
  if package_dir is None:
    import optax_gsam  # here, not above: the compile scripts set jax's environment before it loads

    package_dir = os.path.dirname(os.path.abspath(optax_gsam.__file__))
  prefix = package_dir.rstrip(os.sep) + os.sep
  functions = _frame_functions(hlo_text)
  counts: collections.Counter[str] = collections.Counter()
  for line in _KERNEL.findall(hlo_text):
    frame = _FRAME.search(line)
    where = functions.get(int(frame[1])) if frame else None
    if where is None:
      origin = "unrecorded"
    elif where.startswith(prefix):
      origin = where[len(prefix) :]
    else:
      origin = "other"
    counts[origin] += 1
  return dict(counts.most_common())


def analyse(compiled) -> dict[str, Any]:
  """The per-device figures the compiler (TPU or GPU) gives for one compiled step."""
  memory = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list | tuple) else cost
  cost = cost or {}  # the GPU compiler gives no cost analysis without a device
  fields = ("argument", "output", "alias", "temp", "generated_code")
  row = {f"{f}_bytes": int(getattr(memory, f"{f}_size_in_bytes")) for f in fields}
  row["peak_bytes"] = (
    row["argument_bytes"]
    + row["output_bytes"]
    - row["alias_bytes"]
    + row["temp_bytes"]
    + row["generated_code_bytes"]
  )
  row["fits_16GiB"] = row["peak_bytes"] <= HBM_BYTES
  row["flops"] = float(cost.get("flops", float("nan")))
  row["bytes_accessed"] = float(cost.get("bytes accessed", float("nan")))
  row["optimal_seconds"] = float(cost.get("optimal_seconds", float("nan")))
  hlo = compiled.as_text()
  row["collectives"] = collectives(hlo)
  row["conditionals"] = conditionals(hlo)
  row.update(program_size(hlo))
  row["kernels_by_origin"] = kernels_by_origin(hlo)
  row["all_reduce_origins"] = all_reduce_origins(hlo)
  return row


def data_peak(row: dict[str, Any]) -> int:
  """argument + output - alias + temp: a row's peak without the program's generated code, which
  a two-pass step doubles whatever data it holds (the memory table's measure)."""
  return row["peak_bytes"] - row["generated_code_bytes"]


def out_of_memory(error: Exception) -> dict[str, Any] | None:
  """The TPU compiler's refusal of a program too large for HBM, or None for other errors."""
  text = str(error)
  if "RESOURCE_EXHAUSTED" not in text and "Ran out of memory" not in text:
    return None
  used = re.search(r"\(([\d.]+)([KMGT])\) exceeds available HBM \(([\d.]+)([KMGT])\)", text)
  scale = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
  found = {"error": text.strip().splitlines()[0][:300]}
  if used:
    found["used_bytes"] = int(float(used[1]) * scale[used[2]])
    found["hbm_limit_bytes"] = int(float(used[3]) * scale[used[4]])
  return found
