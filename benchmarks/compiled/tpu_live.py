"""What each missed memory cell holds at its peak on the TPU compiler: live buffers or packing.

``results/memory_table.json`` marks each TPU cell met or missed from the compiled data peak
(argument + output - alias + temp). For every missed cell this script compiles the step and its
reference again, at the model, batch and topology their result file records, with XLA's dumps,
and reads the live-range dump's breakdown of the peak (``buffers.py``): the bytes of every
buffer live at the step's peak, arguments included. The cell's excess over its reference (the
difference of the data peaks, in ``P``) splits in two:

* **live**: the step's live bytes at its peak less the reference's at its own: what the step
  holds beyond the reference, the number to hold against what the maths needs;
* **packing**: the rest, the step's allocation beyond its live bytes less the reference's (the
  TPU compiler places buffers of different lifetimes in one address space, and the gaps count
  in the temporary allocation though nothing is live in them; negative where the step packs
  tighter than its reference).

A cell whose live excess stays within the maths' need is missed by the heap's packing, not by a
held buffer. Beside it, by kind of buffer (XLA's names without instruction numbers), ``held``
lists the kinds with the most more bytes live at the step's peak than at the reference's and
``released`` those with the most fewer: gross figures, which name what a held excess is made of
where both compiles name their buffers alike.

    python -m benchmarks.compiled.memory_table                # the verdicts, from the recorded results
    python -m benchmarks.compiled.tpu_live                    # every missed TPU cell (about 40 minutes)
    python -m benchmarks.compiled.tpu_live --models decoder   # one model's cells; --dumps DIR keeps dumps
    python -m benchmarks.compiled.memory_table                # the table again, with the live excess

Writes ``results/tpu_live.json``, which ``memory_table.py`` reads into the table.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import pathlib
import re
import sys
import tempfile
from typing import Any

from benchmarks.compiled import aot_env  # noqa: F401 (set before jax is imported)

# isort: split
from benchmarks.compiled import buffers
from benchmarks.compiled import memory_table
from benchmarks.compiled.hlo import data_peak
from benchmarks.reporting import code_version
from benchmarks.reporting import write_json

GiB, MiB = memory_table.GiB, memory_table.MiB
MODELS = memory_table.TPU_MODEL_LABELS  # command-line name -> the table's model label
OUT = memory_table.RESULTS / "tpu_live.json"


def compile_recorded(model: str, name: str, dtype: str, dump: str | None = None) -> dict:
  """One step's compiled figures at the model, batch and topology its result file records.

  Run it in a fresh process (:func:`in_fresh_process`): the persistent compilation cache is
  switched off here (a cached program would be neither compiled nor dumped), and ``dump``, a
  folder for XLA's dumps, must reach the TPU backend before it starts.
  """
  if dump:
    buffers.request_dumps(dump)
  import jax

  from benchmarks.compiled import sharded_steps
  from benchmarks.compiled import tpu_compile
  from benchmarks.compiled.decoder import DecoderConfig
  from benchmarks.compiled.hlo import analyse
  from benchmarks.compiled.mlp import MLPConfig
  from benchmarks.compiled.vit import ViTConfig

  jax.config.update("jax_enable_compilation_cache", False)
  recorded = memory_table.recorded_result(model)
  config = {k: v for k, v in recorded["model"].items() if k != "name"}
  if model in (MODELS["decoder"], MODELS["mlp"]):
    kind = DecoderConfig if model == MODELS["decoder"] else MLPConfig
    mesh = sharded_steps.mesh_of(recorded["topology"])
    row, compiled = sharded_steps.compile_row(
      mesh, kind(**config), dtype, name, recorded["per_core_batch"]
    )
  else:
    mesh = tpu_compile.tpu_mesh(recorded["topology"])
    if model == MODELS["vit256"]:
      method = name.rsplit(" mb=", 1)[0]
      contender = tpu_compile.microbatch_contender(4, "whole", method)
      per_core = memory_table.VIT_MICROBATCH_BATCH
    else:
      contender, per_core = tpu_compile.CONTENDERS[name], recorded["per_core_batch"]
    compiled, param_bytes, _ = tpu_compile.compile_step(
      mesh, ViTConfig(**config), tpu_compile.DTYPES[dtype], contender, per_core
    )
    row = {"param_bytes": param_bytes, **analyse(compiled)}
  row["module"] = compiled.as_text().split(None, 2)[1].rstrip(",")  # "HloModule jit_step, ..."
  return row


def in_fresh_process(fn, *args):
  """``fn(*args)`` in a spawned process: the TPU compiler keeps much of what it allocated, and a
  process that compiled the ViT's programs one after another grew past 15 GB."""
  context = multiprocessing.get_context("spawn")
  with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
    return pool.submit(fn, *args).result()


def recorded_rows(model: str) -> dict:
  """The recorded rows of ``model`` by (contender, dtype)."""
  return {(r["contender"], r["dtype"]): r for r in memory_table.recorded_result(model)["rows"]}


def step_of(model: str, label: str, over: str) -> tuple:
  """(row name, reference, needs) of a table row, from memory_table's step lists."""
  found = [s[1:] for s in memory_table.TPU_MODELS[model][1] if s[0] == label and s[2] == over]
  if len(found) != 1:
    raise ValueError(f"memory_table.TPU_MODELS has no single step {label!r} over {over!r}")
  return found[0]


def table_cells(models, verdict: bool) -> list[tuple[str, str, str, str]]:
  """(model, label, over, dtype) of every TPU cell of ``models`` whose met is ``verdict``."""
  table = json.loads((memory_table.RESULTS / "memory_table.json").read_text())["rows"]
  cells = []
  for row in table:
    if row["model"].startswith("CPU") or row["step"].endswith("(reference)"):
      continue  # the CPU rows: tests/test_microbatches.py; references have no verdict
    if row["model"] in memory_table.GPU_MODELS:
      continue  # the GPU rows: tests/test_gpu_compile.py
    if row["model"] not in memory_table.TPU_MODELS:
      raise ValueError(f"memory_table.json has a TPU model the scripts do not know: {row}")
    for dtype in ("f32", "bf16"):
      entry = row.get(dtype)
      if row["model"] in models and entry is not None and entry["met"] == verdict:
        cells.append((row["model"], row["step"], row["over"], dtype))
  return cells


def kind(label: str) -> str:
  """A buffer group's kind, without XLA's instruction numbers (``all-reduce.781`` ->
  ``all-reduce``), the layers' (``Block_3/`` -> ``Block_*/``) or a ``lax.cond``'s branch, so
  that two programs' peaks (a conditional's and its static step's) compare group by group."""
  label = re.sub(r"(\.(clone|\d+))+$", "", label)
  return re.sub(r"_\d+/", "_*/", re.sub(r"cond/branch_\d+_fun/", "", label))


def read_dump(folder: pathlib.Path, module: str) -> dict[str, Any]:
  """What is live at the peak of ``module``'s dump in ``folder``: the bytes, and by kind."""
  text = buffers.read(folder, module)
  kinds: dict[str, int] = {}
  for group, (_, size) in buffers.grouped(buffers.peak_buffers(text)).items():
    kinds[kind(group)] = kinds.get(kind(group), 0) + size
  kept = {k: b for k, b in sorted(kinds.items(), key=lambda kv: -kv[1]) if b >= MiB}
  return {"live_bytes": buffers.peak_bytes(text), "kinds": kept}


def _dumped_program(model: str, name: str, dtype: str, folder: pathlib.Path) -> dict:
  """The step compiled with dumps into ``folder``; its figures and what is live at its peak."""
  folder.mkdir(parents=True, exist_ok=True)
  row = in_fresh_process(compile_recorded, model, name, dtype, str(folder))
  if row["argument_bytes"] != recorded_rows(model)[name, dtype]["argument_bytes"]:
    raise RuntimeError(f"{model} {dtype} {name}: not the recorded program (argument bytes)")
  return {
    "module": row["module"],
    "code": code_version(),
    "data_peak_bytes": data_peak(row),
    "param_bytes": row.get("param_bytes_per_core") or row["param_bytes"],
    **read_dump(folder, row["module"]),
  }


def live_cell(step: dict, reference: dict, needs: int | str) -> dict[str, Any]:
  """A missed cell split into the live excess over its reference and the heap's packing, in P
  (a ratio cell: the live bytes' ratio beside the data peaks'), with the kinds of buffer of
  which the step's peak holds the most more (``held``) and the most fewer (``released``) bytes
  than the reference's, in P."""
  p = step["param_bytes"]
  kinds = step["kinds"].keys() | reference["kinds"].keys()
  change = {
    k: round((step["kinds"].get(k, 0) - reference["kinds"].get(k, 0)) / p, 2) for k in kinds
  }
  ranked = sorted(change.items(), key=lambda kv: (-kv[1], kv[0]))
  kinds_held = {
    "held": [[k, v] for k, v in ranked[:3] if v > 0],
    "released": [[k, v] for k, v in ranked[::-1][:3] if v < 0],
  }
  if isinstance(needs, str):
    return {
      "ratio": step["data_peak_bytes"] / reference["data_peak_bytes"],
      "live_ratio": step["live_bytes"] / reference["live_bytes"],
      **kinds_held,
    }
  over = (step["data_peak_bytes"] - reference["data_peak_bytes"]) / p
  live_over = (step["live_bytes"] - reference["live_bytes"]) / p
  return {"over_P": over, "live_over_P": live_over, "packing_P": over - live_over,
          "param_bytes": p, **kinds_held}  # fmt: skip


def collect(
  models: list[str],
  root: pathlib.Path,
  out: pathlib.Path,
  from_dumps: bool = False,
  steps: list[str] | None = None,
) -> dict:
  """Every missed cell of ``models``: its programs dumped and read, written to ``out`` as it goes.

  ``from_dumps``: no compiling; ``out``'s programs are read again from their dumps under ``root``.
  ``steps``: compile only these steps' programs again (after a change to them), keeping ``out``'s
  others of ``models``.
  """
  result: dict[str, Any] = {
    "command": " ".join(["python -m benchmarks.compiled.tpu_live", *sys.argv[1:]]),
    "programs": {},  # each with the code version it was compiled at
    "cells": [],
  }
  if out.exists():  # keep the other models' cells (and, from the dumps, these models' programs)
    kept = json.loads(out.read_text())
    keep = lambda model, step: (
      from_dumps or model not in models or (steps is not None and step not in steps)
    )
    result["programs"] = {k: v for k, v in kept["programs"].items() if keep(*k.split(" | ")[:2])}
    result["cells"] = [c for c in kept["cells"] if c["model"] not in models]
  programs = result["programs"]
  for model, label, over, dtype in table_cells(models, verdict=False):
    name, reference, needs = step_of(model, label, over)
    for program in (name, reference):
      key = f"{model} | {program} | {dtype}"
      folder = root / buffers.slug(f"{model} {dtype} {program}")
      if from_dumps:
        programs[key].update(read_dump(folder, programs[key]["module"]))
      elif key not in programs:
        programs[key] = _dumped_program(model, program, dtype, folder)
        print(f"  {key}: live {programs[key]['live_bytes'] / GiB:.3f} GiB at the peak of "
              f"{programs[key]['data_peak_bytes'] / GiB:.3f}", flush=True)  # fmt: skip
    cell = live_cell(programs[f"{model} | {name} | {dtype}"],
                     programs[f"{model} | {reference} | {dtype}"], needs)  # fmt: skip
    result["cells"].append(
      {"model": model, "step": label, "over": over, "dtype": dtype, "needs": needs, **cell}
    )
    write_json(out, result)
  return result


def format_cells(cells: list[dict]) -> str:
  lines = ["| model | step | over | dtype | needs | over (P) | live over (P) | packing (P) |",
           "|---|---|---|---|---|---|---|---|"]  # fmt: skip
  for c in cells:
    if "ratio" in c:
      figures = f"{c['ratio']:.3f}x | {c['live_ratio']:.3f}x | -"
    else:
      figures = f"{c['over_P']:+.2f} | {c['live_over_P']:+.2f} | {c['packing_P']:+.2f}"
    lines.append(f"| {c['model']} | {c['step']} | {c['over']} | {c['dtype']} | {c['needs']} | "
                 f"{figures} |")  # fmt: skip
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
  parser.add_argument("--dumps", type=pathlib.Path, default=None, help="keep the dumps here")
  parser.add_argument("--out", type=pathlib.Path, default=OUT)
  parser.add_argument(
    "--from-dumps", action="store_true", help="no compiling: read --out's programs from --dumps"
  )
  parser.add_argument(
    "--steps", nargs="+", default=None, help="compile only these steps again, keep --out's others"
  )
  args = parser.parse_args(argv)
  if args.from_dumps and not args.dumps:
    parser.error("--from-dumps reads the dumps a run kept with --dumps DIR: give --dumps DIR")
  with tempfile.TemporaryDirectory() as scratch:
    root = args.dumps or pathlib.Path(scratch)
    result = collect([MODELS[m] for m in args.models], root, args.out, args.from_dumps, args.steps)
  print(format_cells(result["cells"]))
  print(f"wrote {args.out}")
  return result


if __name__ == "__main__":
  main()
