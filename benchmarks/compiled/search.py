"""The largest-batch search over compiles and the tables of its probes (tpu_compile.py's).

Pure functions of probe dicts (``compiles``, ``peak_bytes``, ``batch``, ...): no compiler here,
so the search is tested against a fake compiler on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benchmarks.compiled.hlo import HBM_BYTES
from benchmarks.reporting import render_table

GiB = 2**30
MAX_PROBE_BATCH = 2**20  # the search stops growing here, should nothing ever fail


def fits(probe: dict[str, Any]) -> bool:
  """Compiled, within the device's memory: the probe's ``memory_bytes`` (a GPU's, from its
  target description), else a TPU v3 core's HBM."""
  return probe["compiles"] and probe["peak_bytes"] <= probe.get("memory_bytes", HBM_BYTES)


def _line_guess(probes: list[dict], limit: int) -> int | None:
  """Where the line through the two largest compiled probes crosses ``limit``, if it rises."""
  measured = sorted((p for p in probes if p["compiles"]), key=lambda p: p["batch"])[-2:]
  if len(measured) < 2 or measured[1]["peak_bytes"] <= measured[0]["peak_bytes"]:
    return None
  (b0, p0), (b1, p1) = ((p["batch"], p["peak_bytes"]) for p in measured)
  return int(b0 + (limit - p0) * (b1 - b0) / (p1 - p0))


def largest_batch(probe: Callable[[int], dict], start: int, step: int) -> tuple[int, list[dict]]:
  """The largest multiple of ``step`` whose step fits in HBM, by bisection over compiles.

  The bracket [fits, does not fit] is split where the line through the two
  largest compiled probes crosses the limit (peak memory is close to linear in
  the batch), clamped inside the bracket; after a refused compile or a clamped
  guess, at the midpoint. While no upper end is known it first jumps to 4x the
  start, for a long baseline, and never guesses past 4x the largest fitting
  batch (rematerialization flattens the peak near the limit, and the line then
  aims far off). The limit is 16 GiB until the compiler refuses a program: then
  it is the HBM the compiler says is available (15.48 GiB of a v3 core's 16 with
  libtpu 0.0.42). It stops when the bracket is one ``step`` wide, or past
  ``MAX_PROBE_BATCH`` if nothing ever fails.
  """
  probes = [probe(start)]
  lo, hi = (start, None) if fits(probes[0]) else (0, start)
  use_line = True
  while (hi is None and lo < MAX_PROBE_BATCH) or (hi is not None and hi - lo > step):
    memory = probes[0].get("memory_bytes", HBM_BYTES)
    limit = min([memory, *(p["hbm_limit_bytes"] for p in probes if "hbm_limit_bytes" in p)])
    guess = _line_guess(probes, limit) if use_line else None
    if guess is None:
      grow = 4 if len(probes) == 1 else 2
      guess = grow * max(lo, step) if hi is None else (lo + hi) // 2
    if hi is None:  # Once rematerialization flattens the peak, the line can aim far off.
      guess = min(guess, 4 * max(lo, step))
    guess = guess // step * step
    bounded = max(guess, lo + step) if hi is None else min(max(guess, lo + step), hi - step)
    probes.append(probe(bounded))
    lo, hi = (bounded, hi) if fits(probes[-1]) else (lo, bounded)
    learned_limit = probes[-1].get("hbm_limit_bytes", limit) < limit  # aim again, lower
    use_line = (probes[-1]["compiles"] and bounded == guess) or learned_limit
  return lo, probes


def format_max_batch_table(rows: list[dict], step: int) -> str:
  """Largest per-core batch per contender and dtype, with its peak and the ratio to AdamW's."""
  base = {r["dtype"]: r["largest_batch"] for r in rows if r["contender"] == "adamw"}
  cells = [
    ("dtype", "contender", "largest batch", "/ adamw", "peak GiB there", "fails at", "compiles")
  ]
  for r in sorted(rows, key=lambda r: (r["dtype"] != "f32", r["contender"] != "adamw")):
    fitted = {p["batch"]: p for p in r["probes"] if fits(p)}
    refused = [p["batch"] for p in r["probes"] if not fits(p) and p["batch"] > r["largest_batch"]]
    ratio = r["largest_batch"] / base[r["dtype"]] if base.get(r["dtype"]) else None
    at_best = fitted.get(r["largest_batch"])
    cells.append(
      (
        r["dtype"],
        r["contender"],
        str(r["largest_batch"]),
        f"{ratio:.3f}" if ratio is not None else "-",
        f"{at_best['peak_bytes'] / GiB:.3f}" if at_best else "-",
        str(min(refused)) if refused else f"> {r['largest_batch'] + step}",
        str(len(r["probes"])),
      )
    )
  return render_table(cells)


def format_microbatch_table(rows: list[dict]) -> str:
  """The micro-batch probes: peak (or the compiler's refusal) and FLOPs as the compiler counts."""
  cells = [
    ("dtype", "contender", "batch", "micro-batch", "peak GiB", "temp GiB", "fits", "GFLOPs*")
  ]
  for r in sorted(rows, key=lambda r: (r["dtype"] != "f32", r["batch"], r["contender"])):
    peak = r.get("peak_bytes", r.get("used_bytes", 0)) / GiB
    cells.append((
      r["dtype"], r["contender"], str(r["batch"]), str(r["batch"] // r["microbatches"]),
      f"{peak:.3f}" if r["compiles"] else f"refused ({peak:.2f})",
      f"{r['temp_bytes'] / GiB:.3f}" if r["compiles"] else "-",
      "yes" if r["fits"] else "NO",
      f"{r['flops'] / 1e9:.1f}" if r["compiles"] else "-",
    ))  # fmt: skip
  return render_table(cells) + "\n* a scan's body counted once, whatever its trip count"


# Micro-batched transform -> the parameter-sized buffers it may hold over the AdamW scan's peak.
MICROBATCH_ALLOWANCE = {"gsam": 2, "sam": 2, "sam diagnostics=False": 1}


def microbatch_targets(rows: list[dict], baseline: str) -> list[tuple[str, float, bool]]:
  """Each transform's peak over ``baseline``'s at the same dtype, batch and micro-batches.

  In parameter-sized buffers, counted to 1% of one (scalars and index vectors add bytes).
  """
  out = []
  by = {(r["dtype"], r["contender"], r["batch"]): r for r in rows if r["compiles"]}
  for (dtype, name, batch), row in sorted(by.items()):
    method, _, count = name.rpartition(" mb=")
    base = by.get((dtype, f"{baseline} mb={count}", batch))
    if method not in MICROBATCH_ALLOWANCE or base is None:
      continue
    extra = (row["peak_bytes"] - base["peak_bytes"]) / row["param_bytes"]
    allowed = MICROBATCH_ALLOWANCE[method]
    what = f"{dtype} {name} at {batch}: params-sized buffers over {baseline} <= {allowed}"
    out.append((what, extra, extra <= allowed + 0.01))
  return out
