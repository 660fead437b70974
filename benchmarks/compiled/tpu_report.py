"""The step table of tpu_compile.py: its rows rendered, and the targets they check.

Pure functions of the rows ``tpu_compile.step_table`` writes (``analyse``'s figures per
dtype and contender): no compiler here.
"""

from __future__ import annotations

from benchmarks.reporting import render_table

GiB = 2**30


def _all_reduce_bytes(row) -> int:
  return row["collectives"].get("all-reduce", {}).get("bytes", 0)


def format_table(rows: list[dict]) -> str:
  header = (
    "dtype", "contender", "peak GiB", "temp GiB", "args GiB", "fits", "GFLOPs", "/ base",
    "GB accessed", "est. ms", "all-reduce (n, MB)", "other collectives",
  )  # fmt: skip
  cells = [header]
  base = {r["dtype"]: r for r in rows if r["contender"] == "adamw"}
  for r in rows:
    b = base.get(r["dtype"])
    others = ", ".join(
      f"{k} {v['count']}x {v['bytes'] / 1e6:.2f}MB"
      for k, v in r["collectives"].items()
      if k != "all-reduce"
    )
    ar = r["collectives"].get("all-reduce", {"count": 0, "bytes": 0})
    cells.append(
      (
        r["dtype"],
        r["contender"],
        f"{r['peak_bytes'] / GiB:.3f}",
        f"{r['temp_bytes'] / GiB:.3f}",
        f"{r['argument_bytes'] / GiB:.3f}",
        "yes" if r["fits_16GiB"] else "NO",
        f"{r['flops'] / 1e9:.1f}",
        f"{r['flops'] / b['flops']:.3f}" if b else "-",
        f"{r['bytes_accessed'] / 1e9:.2f}",
        f"{1e3 * r['optimal_seconds']:.1f}",
        f"{ar['count']}, {ar['bytes'] / 1e6:.3f}",
        others or "-",
      )
    )
  return render_table(cells)


def _ratio(rows, dtype, name, other, key) -> float | None:
  by = {r["contender"]: r for r in rows if r["dtype"] == dtype}
  if name not in by or other not in by:
    return None
  get = (lambda r: _all_reduce_bytes(r)) if key == "all_reduce_bytes" else (lambda r: r[key])
  return get(by[name]) / get(by[other])


def targets(rows: list[dict]) -> list[tuple[str, float | None, bool | None]]:
  """The targets that these compiles can check: (what, figure, met)."""
  out = []
  for dtype in sorted({r["dtype"] for r in rows}):
    by = {r["contender"]: r for r in rows if r["dtype"] == dtype}
    check = lambda what, value, ok, dtype=dtype: out.append((f"{dtype}: {what}", value, ok))
    ratio = lambda *a, dtype=dtype: _ratio(rows, dtype, *a)
    if (x := ratio("gsam", "adamw", "all_reduce_bytes")) is not None:
      check("gsam all-reduce bytes / adamw == 1.000", x, abs(x - 1) < 5e-4)
    if (x := ratio("gsam sync", "adamw", "all_reduce_bytes")) is not None:
      extra = _all_reduce_bytes(by["gsam sync"]) - _all_reduce_bytes(by["gsam"])
      check("gsam sync extra all-reduce bytes / param bytes == 1.000", extra / by["gsam"]["param_bytes"],
            abs(extra / by["gsam"]["param_bytes"] - 1) < 5e-4)  # fmt: skip
    if (x := ratio("gsam", "adamw", "flops")) is not None:
      check("gsam flops / adamw <= 2.01", x, x <= 2.01)
    if "gsam" in by and "adamw" in by:
      limit = by["adamw"]["peak_bytes"] + 2 * by["gsam"]["param_bytes"]
      x = by["gsam"]["peak_bytes"] / limit
      check("gsam peak / (adamw peak + 2 x param bytes) <= 1", x, x <= 1)
    for name in ("gsam", "sam diagnostics=False"):
      if (x := ratio(name, "optax.contrib.sam", "peak_bytes")) is not None:
        check(f"{name} peak / optax.contrib.sam peak <= 1", x, x <= 1)
    for key in ("peak_bytes", "optimal_seconds"):
      if (x := ratio("gsam", "plain gsam", key)) is not None:
        check(f"gsam {key} / plain gsam within 2%", x, abs(x - 1) <= 0.02)
    if {"gsam k=5 full", "gsam k=5 cheap", "adamw"} <= by.keys():
      cycle = (by["gsam k=5 full"]["flops"] + 4 * by["gsam k=5 cheap"]["flops"]) / 5
      x = cycle / by["adamw"]["flops"]
      check("gsam k=5 static cycle flops / adamw <= 1.21", x, x <= 1.21)
  return out
