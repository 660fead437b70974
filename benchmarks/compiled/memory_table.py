"""One table of every step's memory against what its maths needs, from the recorded results.

Reads the compiled-memory results the other scripts wrote (no compiling): the FSDP decoder and
residual MLP on the v4-64 compiler (``tpu_sharded.json``, ``tpu_sharded_mlp.json``), the same
steps and a scanned ViT-L/16 on the GPU compiler for 8 H100s (``gpu_sharded*.json``), the
replicated ViT-B/32 on the v3-64 compiler (``tpu_compile.json``) and the CPU MLP on micro-batches
(``microbatches_memory.json``), and what is live at each missed TPU cell's peak
(``tpu_live.json``, from ``tpu_live.py``'s dumps). For each model and step: the peak of the data
per core (TPU: argument + output - alias + temp, without the generated code, which a two-pass
program doubles whatever it holds; CPU: temp), its excess over the reference step in ``P`` (one
parameter buffer per core: one FSDP shard, or the whole replicated params), what the maths needs
over that reference, and the verdict. A missed TPU cell also shows its live excess: the bytes
live at the step's peak over the reference's, in ``P``. Within the need, the rest of the excess
is the heap's packing, not a held buffer.

What the maths needs, beyond the base step: the perturbed weights (1 P) and the clean gradient
while the perturbed pass runs (1 P, for GSAM's decomposition and SAM's diagnostics); a stored
direction (1 P) for the every-k policy. ``sam(diagnostics=False)`` and momentum SAM need only the
perturbed weights over their own base step (momentum SAM's momentum is its base's).

    python -m benchmarks.compiled.memory_table   # prints the table, writes results/memory_table.{json,md}
"""

from __future__ import annotations

import json
import pathlib

from benchmarks.compiled.hlo import data_peak

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "results"
LIVE = "tpu_live.json"  # what is live at each missed TPU cell's peak (tpu_live.py)
FILES = ("tpu_sharded.json", "tpu_sharded_mlp.json", "tpu_compile.json",
         "tpu_compile_microbatches.json", "microbatches_memory.json", LIVE, "gpu_sharded.json",
         "gpu_sharded_vit.json", "gpu_sharded_mlp.json")  # fmt: skip
GiB = 2**30
MiB = 2**20
# A live excess within the need by at most this counts as within: tpu_live.py keeps the kinds of
# buffer from 1 MiB up, so less than that is scalars and small buffers, not a parameter buffer.
LIVE_TOLERANCE_BYTES = MiB

# (label, row, reference row, P the maths needs over the reference)
TPU_STEPS = (
  ("gsam", "gsam", "adamw", 2),
  ("sam", "sam", "adamw", 2),
  ("sam diagnostics=False", "sam diagnostics=False", "adamw", 1),
  ("sam diagnostics=False", "sam diagnostics=False", "optax.contrib.sam", 0),
  ("momentum_sam", "momentum_sam", "adamw", 2),
  ("gsam every-5, lax.cond", "gsam every-5", "adamw", 3),
  ("gsam every-5, static full step", "gsam every-5 static", "adamw", 3),
  ("gsam microbatches=4", "gsam mb=4", "adamw mb=4", 2),
  ("optax.contrib.sam (reference)", "optax.contrib.sam", "adamw", 1),
)
VIT_STEPS = (
  ("gsam", "gsam", "adamw", 2),
  ("sam", "sam", "adamw", 2),
  ("sam diagnostics=False", "sam diagnostics=False", "optax.contrib.sam", 0),
  ("momentum_sam", "momentum_sam", "adamw", 2),
  ("gsam every-5, lax.cond", "gsam k=5 cond", "gsam k=5 full", "1.01x"),
  ("optax.contrib.sam (reference)", "optax.contrib.sam", "adamw", 1),
)
VIT_MICROBATCH_STEPS = (  # 4 micro-batches of 64 images per core, against AdamW's scan
  ("gsam microbatches=4", "gsam mb=4", "adamw scan mb=4", 2),
  ("sam microbatches=4", "sam mb=4", "adamw scan mb=4", 2),
  ("sam diagnostics=False, microbatches=4", "sam diagnostics=False mb=4", "adamw scan mb=4", 1),
)
CPU_STEPS = (("gsam", 2), ("sam", 2), ("sam diagnostics=False", 1))
VIT_MICROBATCH_BATCH = 256  # images per core of the micro-batched ViT rows
# The TPU models of the table by short name (tpu_live.py's --models) and label.
TPU_MODEL_LABELS = {
  "decoder": "FSDP decoder 1.04B, v4-64",
  "mlp": "FSDP residual MLP 537M, v4-64",
  "vit": "ViT-B/32 replicated, v3-64",
  "vit256": "ViT-B/32 replicated, v3-64, 256 images",
}
# label -> (result file, steps). tests/test_tpu_memory_limits.py compiles their met cells again
# from the same entries.
TPU_MODELS = {
  TPU_MODEL_LABELS["decoder"]: ("tpu_sharded.json", TPU_STEPS),
  TPU_MODEL_LABELS["mlp"]: ("tpu_sharded_mlp.json", TPU_STEPS),
  TPU_MODEL_LABELS["vit"]: ("tpu_compile.json", VIT_STEPS),
  TPU_MODEL_LABELS["vit256"]: ("tpu_compile_microbatches.json", VIT_MICROBATCH_STEPS),
}
# The same FSDP steps compiled by the GPU compiler for one host of 8 H100s (sharded.py
# --topology 8xh100), with no GPU attached. tests/test_gpu_compile.py guards their fix.
GPU_MODELS = {
  "FSDP ViT-L/16 scanned, 8 x H100, 128 images": ("gpu_sharded_vit.json", TPU_STEPS),
  "FSDP decoder 1.04B, 8 x H100": ("gpu_sharded.json", TPU_STEPS),
  "FSDP residual MLP 537M, 8 x H100": ("gpu_sharded_mlp.json", TPU_STEPS),
  "FSDP x TP ViT-L/16 scanned, 2 x 4 H100s, 32 images": ("gpu_sharded_vit_tp4.json", TPU_STEPS),
}


def _tpu_rows(model: str, result: dict, steps, tolerance_bytes: int = 0) -> list[dict]:
  """Table rows of one compiled result: each step in f32 and bf16 against its reference."""
  rows = []
  for label, name, reference, needs in steps:
    row = {"model": model, "step": label, "over": reference, "needs": needs}
    for dtype in ("f32", "bf16"):
      by = {r["contender"]: r for r in result["rows"] if r["dtype"] == dtype}
      if name in by and reference in by:
        row[dtype] = tpu_cell(by[name], by[reference], needs, tolerance_bytes)
    rows.append(row)
  return rows


def tpu_cell(step: dict, reference: dict, needs: int | str, tolerance_bytes: int = 0) -> dict:
  """One step's compiled row against its reference's: the peak, the excess and the verdict.

  ``needs``: the parameter buffers per core (``P``) the maths needs over the reference, or a
  ratio to the reference's peak (``"1.01x"``). ``tolerance_bytes``: scalars the verdict allows
  beyond the need (the GPU rows: ``LIVE_TOLERANCE_BYTES``, as for the live excess).
  """
  p = step.get("param_bytes_per_core") or step["param_bytes"]  # a shard, or the whole params
  peak, base = data_peak(step), data_peak(reference)
  if isinstance(needs, str):
    return {"peak_GiB": peak / GiB, "ratio": peak / base,
            "met": peak <= float(needs.rstrip("x")) * base}  # fmt: skip
  over = (peak - base) / p
  cell = {"peak_GiB": peak / GiB, "over_P": over, "met": over <= needs + tolerance_bytes / p}
  if step.get("live_peak_bytes") and reference.get("live_peak_bytes"):  # the GPU's own dumps
    live = (step["live_peak_bytes"] - reference["live_peak_bytes"]) / p
    cell.update(live_over_P=live, param_bytes=p)
  return cell


def _cpu_rows(result: dict) -> list[dict]:
  """Table rows of the CPU micro-batch memory run: each case's three steps over AdamW's scan."""
  rows = []
  for case, row in result["rows"].items():
    if case == "k=8 micro=256":  # the micro-batch of "k=4 micro=256": the same figures
      continue
    for name, needs in CPU_STEPS:
      over = row[f"{name}_extra_params"]
      rows.append({
        "model": f"CPU MLP, {case.replace('micro=', 'micro-batch ')}", "step": name,
        "over": "adamw scan", "needs": needs,
        "f32": {"peak_MiB": row[f"{name}_MiB"], "over_P": over,
                "met": over <= needs * 1.01},  # microbatches.py's 1%
      })  # fmt: skip
  return rows


def recorded_result(model: str) -> dict:
  """The result file of a TPU model of the table, with only that model's rows (the micro-batched
  ViT's file keeps probes at other batches; its rows are those at ``VIT_MICROBATCH_BATCH``)."""
  result = json.loads((RESULTS / TPU_MODELS[model][0]).read_text())
  if model == TPU_MODEL_LABELS["vit256"]:
    rows = [r for r in result["rows"] if r.get("batch") == VIT_MICROBATCH_BATCH]
    result = {**result, "rows": rows}
  return result


def _add_live(rows: list[dict], live: dict) -> None:
  """Each missed TPU cell's live excess over its reference (``tpu_live.py``'s dumps), in place.

  A cell whose dumped programs are not the recorded ones (another excess: results recorded since)
  is left out, with a warning: run ``tpu_live.py`` again, then this script.
  """
  found = {(c["model"], c["step"], c["over"], c["dtype"]): c for c in live["cells"]}
  for row in rows:
    for dtype in ("f32", "bf16"):
      cell = found.get((row["model"], row["step"], row["over"], dtype))
      if cell is None or dtype not in row or row[dtype]["met"]:
        continue
      measure = "ratio" if "ratio" in cell else "over_P"
      if abs(cell[measure] - row[dtype][measure]) > 1e-9:
        print(f"warning: {LIVE} is stale for {row['model']} {row['step']} {dtype}: left out")
        continue
      keys = ("live_over_P", "packing_P", "live_ratio", "param_bytes")
      row[dtype].update({k: cell[k] for k in keys if k in cell})


def collect() -> list[dict]:
  """Every row of the table, read from the result files of ``FILES``."""
  read = lambda name: json.loads((RESULTS / name).read_text())
  rows = []
  for model, (_, steps) in TPU_MODELS.items():
    rows.extend(_tpu_rows(model, recorded_result(model), steps))
  _add_live(rows, read(LIVE))
  for model, (name, steps) in GPU_MODELS.items():
    if (RESULTS / name).exists():
      rows.extend(_tpu_rows(model, read(name), steps, LIVE_TOLERANCE_BYTES))
  return [
    *rows,
    *_cpu_rows(read("microbatches_memory.json")),
  ]


def _cell(entry: dict | None) -> str:
  if entry is None:
    return "-"
  if "ratio" in entry:
    live = f"; live {entry['live_ratio']:.3f}x" if "live_ratio" in entry else ""
    return f"{entry['peak_GiB']:.3f} ({entry['ratio']:.3f}x{live})"
  if "peak_MiB" in entry:  # the CPU rows: temp memory, in MiB
    return f"{entry['peak_MiB']:.2f} MiB ({entry['over_P']:+.2f})"
  live = f"; live {entry['live_over_P']:+.2f}" if "live_over_P" in entry else ""
  return f"{entry['peak_GiB']:.3f} ({entry['over_P']:+.2f}{live})"


def live_within_needs(entry: dict, needs: int | str) -> bool | None:
  """Whether a missed cell's live buffers stay within the maths' need (within
  ``LIVE_TOLERANCE_BYTES``), so that the rest of its excess is the heap's packing; None where
  ``tpu_live.py`` has not dumped it."""
  if "live_ratio" in entry:
    return entry["live_ratio"] <= float(str(needs).rstrip("x"))
  if "live_over_P" in entry:
    return entry["live_over_P"] <= float(needs) + LIVE_TOLERANCE_BYTES / entry["param_bytes"]
  return None


def _verdict(row: dict) -> str:
  if row["step"].endswith("(reference)"):
    return "reference"
  measured = [d for d in ("f32", "bf16") if d in row]
  if not measured:
    return "not measured"
  missed = [d for d in measured if not row[d]["met"]]
  if not missed:
    return "met"
  text = "missed " + ", ".join(missed)
  live = [live_within_needs(row[d], row["needs"]) for d in missed]
  if None in live:
    return text
  if all(live):
    return text + " (live within the need: packing)"
  parts = [
    f"{d} {'packing' if ok else 'live over the need'}" for d, ok in zip(missed, live, strict=True)
  ]
  return text + " (" + "; ".join(parts) + ")"


def markdown(rows: list[dict]) -> str:
  """The table in Markdown: one line per model and step."""
  lines = [
    "| model | step | over | needs | f32 peak GiB (P over) | bf16 peak GiB (P over) | verdict |",
    "|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    needs = r["needs"] if isinstance(r["needs"], str) else f"{r['needs']}"
    lines.append(
      f"| {r['model']} | {r['step']} | {r['over']} | {needs} | {_cell(r.get('f32'))} | "
      f"{_cell(r.get('bf16'))} | {_verdict(r)} |"
    )
  return "\n".join(lines)


def main() -> list[dict]:
  rows = collect()
  print(markdown(rows))
  for r in rows:
    r["verdict"] = _verdict(r)
  out = RESULTS / "memory_table.json"
  out.write_text(
    json.dumps({"command": "python -m benchmarks.compiled.memory_table", "rows": rows}, indent=2)
    + "\n"
  )
  (RESULTS / "memory_table.md").write_text(
    "# Memory against the maths\n\n`python -m benchmarks.compiled.memory_table` (from the recorded "
    "results; what each column means: benchmarks/README.md).\n\n" + markdown(rows) + "\n"
  )
  print(f"wrote {out} and memory_table.md")
  return rows


if __name__ == "__main__":
  main()
