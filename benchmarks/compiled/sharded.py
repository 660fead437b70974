"""FSDP-sharded models compiled by the TPU compiler for a v4-64: a 1B decoder and a residual MLP.

With libtpu installed (``pip install -e ".[tpu-compile]"``), JAX compiles ahead of time for a
described TPU topology (``jax.experimental.topologies.get_topology_desc``) with no TPU
attached. Two models: ``decoder.py``'s decoder-only transformer (width 2048, 18 scanned and
rematerialized blocks, MLP 8192, vocabulary 32768, 512 tokens: 1.04B parameters; 4 sequences
per core) and, with ``--model mlp``, ``mlp.py``'s residual MLP (16 unrolled blocks of two
4096 x 4096 matrices, no remat: 537M parameters; 64 rows per core). Every parameter, and every
optimizer-state leaf of a parameter's shape, is sharded over the 64-core ``data`` axis of a
v4-64 (``v4:4x4x2``, one device per TensorCore) along its largest dimension that 64 divides
(FSDP); the batch is sharded over the same axis. Each step is ``jax.jit`` over the sharded
arrays in Auto axes (no ``shard_map``, no ``axis_name``), params and optimizer state donated,
outputs laid out as the inputs. Two precisions: ``f32`` and ``bf16``, mixed precision as
large-model trainers run it (float32 params, gradients and optimizer state, bfloat16 matmuls
and activations).

Per core, from the compiled program (``compiled_hlo.analyse``): peak memory (argument +
output - alias + temp + generated code), FLOPs, collectives by kind (count and bytes), and
the seconds to lower and to compile.

Rows (AdamW after every sharpness-aware transform): ``adamw``, ``gsam``, ``sam``, ``sam
diagnostics=False``, ``optax.contrib.sam``, ``momentum_sam``, ``gsam mb=4`` (``microbatches=4``,
the transform takes the clean gradient too) against ``adamw mb=4`` (AdamW's gradient
accumulated over the same 4 micro-batches in a ``lax.scan``), ``gsam every-5``
(``policy=every_k_policy(5)``, the ``lax.cond`` program) and ``gsam every-5 static`` (its full
step, ``perturb=True``), and the steps written from the formulas in this file, ``plain gsam``
and ``plain sam``. Not run by default: ``gsam perturb=True``.

    python -m benchmarks.compiled.sharded                 # v4-64, 1B decoder, f32 and bf16
    python -m benchmarks.compiled.sharded --model mlp     # v4-64, 537M residual MLP
    python -m benchmarks.compiled.sharded --quick         # tiny decoder on a v4-8, about a minute
    python -m benchmarks.compiled.sharded --contenders adamw gsam --dtypes bf16 --append
    python -m benchmarks.compiled.sharded --report        # the table and targets again, no compiling
    python -m benchmarks.compiled.sharded --dtypes f32 --contenders gsam --dump /tmp/dump  # then
    python -m benchmarks.compiled.buffers /tmp/dump/f32-gsam  # what is live at the peak

Writes ``benchmarks/results/tpu_sharded.json`` (``tpu_sharded_mlp.json`` with ``--model mlp``,
``tpu_sharded_quick.json`` with ``--quick``).

``--replicated`` (anywhere on the line) compiles the GSAM paper's replicated ViT-B/32 for a TPU v3
instead, per-device data-parallel steps (``tpu_compile.py``: its options follow, its results are
``tpu_compile*.json``)::

    python -m benchmarks.compiled.sharded --replicated                 # v3-64, ViT-B/32
    python -m benchmarks.compiled.sharded --replicated --quick         # small ViT for a v3-8
    python -m benchmarks.compiled.sharded --replicated --max-batch --batch-step 32
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import shutil
import statistics
import sys

from benchmarks.compiled import aot_env  # noqa: F401 (set before jax is imported)

# isort: split
import jax

from benchmarks.compiled import gpu_target
from benchmarks.compiled.buffers import peak_bytes
from benchmarks.compiled.buffers import request_dumps
from benchmarks.compiled.buffers import slug
from benchmarks.compiled.decoder import DECODER_1B
from benchmarks.compiled.decoder import DECODER_QUICK
from benchmarks.compiled.hlo import data_peak
from benchmarks.compiled.mlp import MLP_537M
from benchmarks.compiled.mlp import MLP_QUICK
from benchmarks.compiled.search import format_max_batch_table
from benchmarks.compiled.search import largest_batch
from benchmarks.compiled.sharded_steps import ALPHA
from benchmarks.compiled.sharded_steps import CONTENDERS
from benchmarks.compiled.sharded_steps import DTYPES
from benchmarks.compiled.sharded_steps import FULL_ORDER
from benchmarks.compiled.sharded_steps import GPU_TOPOLOGIES
from benchmarks.compiled.sharded_steps import LR
from benchmarks.compiled.sharded_steps import MAIN_CONTENDERS
from benchmarks.compiled.sharded_steps import RHO
from benchmarks.compiled.sharded_steps import TOPOLOGIES
from benchmarks.compiled.sharded_steps import WEIGHT_DECAY
from benchmarks.compiled.sharded_steps import compile_row
from benchmarks.compiled.sharded_steps import mesh_of
from benchmarks.compiled.sharded_steps import platform_of
from benchmarks.compiled.vit import VIT_L16
from benchmarks.compiled.vit import VIT_SCANNED_QUICK
from benchmarks.reporting import code_version
from benchmarks.reporting import cuda_plugin_version
from benchmarks.reporting import libtpu_version
from benchmarks.reporting import render_table
from benchmarks.reporting import write_json

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "results"
GiB = 2**30


# ----------------------------------------------------------------------------- report


def _collective(row, kind) -> str:
  entry = row["collectives"].get(kind, {"count": 0, "bytes": 0})
  return f"{entry['count']}, {entry['bytes'] / 2**20:.1f}"


def format_table(rows: list[dict]) -> str:
  header = (
    "dtype", "contender", "peak GiB", "temp GiB", "data peak over adamw / param shard",
    "live over adamw / shard", "GFLOPs", "/ adamw",
    "all-reduce (n, MiB)", "all-gather (n, MiB)", "reduce-scatter (n, MiB)", "other",
    "compile s (wall / CPU)",
  )  # fmt: skip
  cells = [header]
  base = {r["dtype"]: r for r in rows if r["contender"] == "adamw"}
  main = ("all-reduce", "all-gather", "reduce-scatter")
  for r in rows:
    b = base.get(r["dtype"])
    others = ", ".join(
      f"{k} {v['count']}x{v['bytes'] / 2**20:.1f}" for k, v in r["collectives"].items()
      if k not in main
    )  # fmt: skip
    extra = (data_peak(r) - data_peak(b)) / r["param_bytes_per_core"] if b else None
    live = None
    if b and r.get("live_peak_bytes") and b.get("live_peak_bytes"):
      live = (r["live_peak_bytes"] - b["live_peak_bytes"]) / r["param_bytes_per_core"]
    cells.append((
      r["dtype"], r["contender"], f"{r['peak_bytes'] / GiB:.3f}", f"{r['temp_bytes'] / GiB:.3f}",
      "-" if extra is None else f"{extra:.1f}", "-" if live is None else f"{live:.1f}",
      f"{r['flops'] / 1e9:.0f}",
      f"{r['flops'] / b['flops']:.3f}" if b else "-", *[_collective(r, k) for k in main],
      others or "-", f"{r['compile_s']:.0f} / {r['compile_cpu_s']:.0f}",
    ))  # fmt: skip
  return render_table(cells)


def _all_reduce_bytes(row) -> int:
  return row["collectives"].get("all-reduce", {}).get("bytes", 0)


def _peak_within(step: str, reference: str, shards: int) -> tuple:
  """The target: ``step``'s data peak <= ``reference``'s + ``shards`` param shards."""
  return (
    f"{step} data peak <= {reference}'s + {shards} param shards", (step, reference),
    lambda by: data_peak(by[step]),
    lambda by: data_peak(by[reference]) + shards * by[step]["param_bytes_per_core"],
  )  # fmt: skip


def _all_reduces_within(step: str, more: int) -> tuple:
  """The target ``step``'s all-reduce count <= optax.contrib.sam's + ``more``."""
  count = lambda row: row["collectives"].get("all-reduce", {}).get("count", 0)
  return (
    f"{step} all-reduces <= optax.contrib.sam's + {more}", (step, "optax.contrib.sam"),
    lambda by: count(by[step]), lambda by: count(by["optax.contrib.sam"]) + more,
  )  # fmt: skip


# (what, the rows it reads, value(by), limit(by)) with ``by`` a dtype's rows by contender.
TARGETS = (
  _peak_within("gsam", "adamw", 2),
  _peak_within("sam", "adamw", 2),
  _peak_within("sam diagnostics=False", "adamw", 1),
  _peak_within("sam diagnostics=False", "optax.contrib.sam", 0),
  _peak_within("momentum_sam", "adamw", 2),
  _peak_within("gsam every-5", "adamw", 3),
  _peak_within("gsam every-5 static", "adamw", 3),
  _peak_within("gsam mb=4", "adamw mb=4", 2),
  ("gsam flops / adamw's <= 2.01", ("gsam", "adamw"),
   lambda by: by["gsam"]["flops"] / by["adamw"]["flops"], lambda by: 2.01),
  ("gsam all-reduce bytes <= optax.contrib.sam's + 1 KiB", ("gsam", "optax.contrib.sam"),
   lambda by: _all_reduce_bytes(by["gsam"]),
   lambda by: _all_reduce_bytes(by["optax.contrib.sam"]) + 1024),
  _all_reduces_within("gsam", 2),
  _all_reduces_within("sam", 2),
  ("gsam compile CPU s / optax.contrib.sam's <= 1.2", ("gsam", "optax.contrib.sam"),
   lambda by: by["gsam"]["compile_cpu_s"] / by["optax.contrib.sam"]["compile_cpu_s"],
   lambda by: 1.2),
  ("gsam every-5 compile CPU s / optax.contrib.sam's <= 1.5",
   ("gsam every-5", "optax.contrib.sam"),
   lambda by: by["gsam every-5"]["compile_cpu_s"] / by["optax.contrib.sam"]["compile_cpu_s"],
   lambda by: 1.5),
)  # fmt: skip


_SECONDS = ("compile_s", "compile_cpu_s", "trace_s")


def _by_contender(rows: list[dict]) -> dict[str, dict]:
  """Each contender's row; one compiled several times (to time it again) gets the median of its
  compile seconds, its program being the same each time."""
  grouped: dict[str, list[dict]] = {}
  for row in rows:
    grouped.setdefault(row["contender"], []).append(row)
  return {
    name: {**group[-1], **{k: statistics.median(r[k] for r in group) for k in _SECONDS}}
    for name, group in grouped.items()
  }


def targets(rows: list[dict]) -> list[dict]:
  """Each target whose rows were compiled, per dtype: its figure, limit and verdict."""
  out = []
  for dtype in sorted({r["dtype"] for r in rows}):
    by = _by_contender([r for r in rows if r["dtype"] == dtype])
    for what, names, value, limit in TARGETS:
      if all(n in by for n in names):
        v, lim = value(by), limit(by)
        out.append({"target": f"{dtype}: {what}", "value": v, "limit": lim, "met": v <= lim})
  return out


# ----------------------------------------------------------------------------- main


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--replicated", action="store_true",
    help="the replicated ViT-B/32 on a TPU v3 instead (tpu_compile.py; its options follow)",
  )  # fmt: skip
  parser.add_argument("--quick", action="store_true", help="tiny model on a v4-8, seconds")
  parser.add_argument(
    "--model", choices=("decoder", "mlp", "vit"), default="decoder",
    help="the 1.04B scanned decoder, the 537M residual MLP (mlp.py) or a scanned ViT-L/16",
  )  # fmt: skip
  parser.add_argument(
    "--topology", choices=[*TOPOLOGIES, *GPU_TOPOLOGIES], default=None,
    help="a TPU (v4-8, v4-64) or a GPU host (8xh100: 8 H100s, jax's CUDA plugin)",
  )  # fmt: skip
  parser.add_argument(
    "--tp", type=int, default=1,
    help="tensor-parallel devices: a data x model mesh (FSDP x TP; 4 on 8 devices is 2 x 4)",
  )  # fmt: skip
  parser.add_argument(
    "--per-core-batch", type=int, default=None, help="default: 4 sequences, or 64 rows (mlp)"
  )
  parser.add_argument("--depth", type=int, default=None, help="blocks (default: the config's)")
  parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=None)
  parser.add_argument("--contenders", nargs="+", choices=list(CONTENDERS), default=None)
  parser.add_argument("--out", type=pathlib.Path, default=None)
  parser.add_argument("--report", action="store_true", help="only report --out's rows again")
  parser.add_argument(
    "--dump", type=pathlib.Path, default=None,
    help="XLA's dumps of each step (buffer assignment, live ranges at the peak) under DUMP/<row>",
  )  # fmt: skip
  parser.add_argument(
    "--append", action="store_true", help="keep --out's rows of the contenders not compiled"
  )
  parser.add_argument(
    "--largest-batch", action="store_true",
    help="GPU: the largest batch per device that fits the device's memory, per contender",
  )  # fmt: skip
  parser.add_argument("--batch-step", type=int, default=8, help="the search's granularity")
  args = parser.parse_args(argv)
  args.topology = args.topology or ("v4-8" if args.quick else "v4-64")
  configs = {
    "decoder": (DECODER_1B, DECODER_QUICK),
    "mlp": (MLP_537M, MLP_QUICK),
    "vit": (VIT_L16, VIT_SCANNED_QUICK),
  }
  args.config = configs[args.model][args.quick]
  if args.depth:
    args.config = dataclasses.replace(args.config, depth=args.depth)
  args.per_core_batch = args.per_core_batch or {"mlp": 64, "vit": 32}.get(args.model, 4)
  args.dtypes = args.dtypes or list(DTYPES)
  args.contenders = args.contenders or list(MAIN_CONTENDERS if args.quick else FULL_ORDER)
  platform = platform_of(args.topology)
  stem = f"{platform}_sharded" + ("" if args.model == "decoder" else f"_{args.model}")
  stem += f"_tp{args.tp}" if args.tp > 1 else ""
  stem += "_quick" if args.quick else ""
  stem += "_max_batch" if args.largest_batch else ""
  args.out = args.out or RESULTS / (stem + ".json")
  return args


def run_rows(args, mesh, result) -> list[dict]:
  """Every (contender, dtype) row, written to ``--out`` after each compile."""
  rows = result["rows"] = []
  if args.append and args.out.exists():
    redo = {(d, n) for d in args.dtypes for n in args.contenders}
    kept = json.loads(args.out.read_text())["rows"]
    rows.extend(
      r for r in kept if (r["dtype"], r["contender"]) not in redo and r["contender"] in CONTENDERS
    )
  for name in args.contenders:  # Contender-major: an interrupted run has both dtypes.
    for dtype in args.dtypes:
      row, compiled = compile_row(mesh, args.config, dtype, name, args.per_core_batch)
      row["code"] = result["code"]  # each row's own: --append keeps rows of earlier code
      del compiled
      if args.dump:
        folder = _file_dump(args.dump, f"{dtype}-{name}")
        row["live_peak_bytes"] = _live_peak(folder)
      rows.append(row)
      print(f"  {dtype} {name}: peak {row['peak_bytes'] / GiB:.3f} GiB, "
            f"compiled in {row['compile_s']:.1f} s ({row['compile_cpu_s']:.1f} CPU s)", flush=True)  # fmt: skip
      names = list(CONTENDERS)
      rows.sort(key=lambda r: (r["dtype"] != "f32", names.index(r["contender"])))
      write_json(args.out, result)
  return rows


def _live_peak(folder: pathlib.Path) -> int | None:
  """The bytes live at the step's peak (XLA's live-range dump), without the heap's packing."""
  found = sorted(folder.glob("*after_optimizations-live-range.txt"))
  return peak_bytes(found[-1].read_text()) if found else None


def _file_dump(root: pathlib.Path, row: str) -> pathlib.Path:
  """Moves the step's dumped files into ``root/<row>`` and drops the other programs' files."""
  folder = root / slug(row)
  folder.mkdir(parents=True, exist_ok=True)
  for path in root.glob("module_*"):
    if path.is_file() and ".jit_step." in path.name:
      path.rename(folder / path.name)
    elif path.is_file():
      path.unlink()
    else:
      shutil.rmtree(path)
  return folder


SEARCHED = ("adamw", "optax.contrib.sam", "gsam", "sam", "momentum_sam")


def probe_batch(mesh, config, dtype: str, name: str, per_device: int, memory: int) -> dict:
  """One compile of the search: the peak per device at ``per_device`` (or a refusal)."""
  try:
    row, compiled = compile_row(mesh, config, dtype, name, per_device)
  except Exception as error:  # A compiler that refuses a program too large for the device.
    if "RESOURCE_EXHAUSTED" not in str(error) and "out of memory" not in str(error).lower():
      raise
    return {"batch": per_device, "compiles": False, "memory_bytes": memory}
  del compiled
  keys = ("peak_bytes", "temp_bytes", "argument_bytes", "output_bytes", "alias_bytes")
  found = {k: row[k] for k in keys}
  return {"batch": per_device, "compiles": True, "memory_bytes": memory, **found}


def search_batches(args, mesh, result) -> dict:
  """The largest per-device batch of each searched contender whose step fits the device."""
  # JAX's GPU client takes 75% of the device's memory by default (XLA_PYTHON_CLIENT_MEM_FRACTION),
  # and the compiler's rematerialization aims below that (its warnings name about 59 GiB of an
  # H100's 79.1): a step fits where its peak does.
  device = gpu_target.TARGETS[GPU_TOPOLOGIES[args.topology][0]].memory_bytes
  memory = int(gpu_target.CLIENT_MEMORY_FRACTION * device)
  rows = result["rows"] = []
  for name in [n for n in args.contenders if n in SEARCHED]:
    for dtype in args.dtypes:
      probe = lambda b, n=name, d=dtype: probe_batch(mesh, args.config, d, n, b, memory)
      best, probes = largest_batch(probe, args.per_core_batch, args.batch_step)
      rows.append({"contender": name, "dtype": dtype, "largest_batch": best, "probes": probes})
      print(f"  {dtype} {name}: largest batch per device {best} ({len(probes)} compiles)")
      write_json(args.out, result)
  print(format_max_batch_table(rows, args.batch_step))
  result["targets"] = [
    {"target": f"{r['dtype']}: gsam largest batch / adamw's >= 0.97", "value": ratio,
     "limit": 0.97, "met": ratio >= 0.97}
    for r in rows if r["contender"] == "gsam"
    for base in rows if base["contender"] == "adamw" and base["dtype"] == r["dtype"]
    for ratio in [r["largest_batch"] / base["largest_batch"]]
  ]  # fmt: skip
  for t in result["targets"]:
    print(f"{t['target']}: {t['value']:.3f} -> {'met' if t['met'] else 'MISSED'}")
  write_json(args.out, result)
  return result


def main(argv: list[str] | None = None) -> dict:
  argv = sys.argv[1:] if argv is None else argv
  if "--replicated" in argv:  # The other program, with its own options and result files.
    from benchmarks.compiled import tpu_compile

    return tpu_compile.main([a for a in argv if a != "--replicated"])
  args = parse_args(argv)
  if args.report:  # No compiling: the table and targets of --out's rows.
    return report(json.loads(args.out.read_text()), args.out)
  if args.dump:  # Read when the TPU backend starts, below.
    request_dumps(args.dump)
  mesh = mesh_of(args.topology, tp=args.tp)
  platform = platform_of(args.topology)
  print(f"{args.topology}: {mesh.size} {platform.upper()} devices, {args.config}", flush=True)
  result = {
    "command": " ".join(["python -m benchmarks.compiled.sharded", *(argv or sys.argv[1:])]),
    "code": code_version(),
    "jax": jax.__version__,
    "platform": platform,
    **(
      {"libtpu": libtpu_version()} if platform == "tpu" else {"cuda_plugin": cuda_plugin_version()}
    ),
    "topology": args.topology,
    "tp": args.tp,
    "cores": mesh.size,
    "model": {"name": args.model, **dataclasses.asdict(args.config)},
    "per_core_batch": args.per_core_batch,
    "layout": (
      "FSDP: params, optimizer state and batch sharded over one 'data' axis (Auto)"
      if args.tp == 1
      else f"FSDP x TP: a data x model mesh {dict(mesh.shape)}; each weight's largest dimension "
      "over 'model', the next over 'data'; the batch over 'data' (Auto)"
    ),
    "precision": {"f32": "float32 throughout", "bf16": "float32 params, bfloat16 compute"},
    "hparams": {"rho": RHO, "alpha": ALPHA, "lr": LR, "weight_decay": WEIGHT_DECAY},
    "peak_formula": "argument + output - alias + temp + generated_code (bytes per core)",
  }
  if args.largest_batch:
    if platform != "gpu":
      raise SystemExit(
        "--largest-batch compiles for a GPU topology (--replicated --max-batch for TPUs)"
      )
    return search_batches(args, mesh, result)
  run_rows(args, mesh, result)
  return report(result, args.out)


def report(result: dict, out: pathlib.Path) -> dict:
  """Prints the table and the targets of ``result["rows"]`` and writes ``result`` to ``out``."""
  print(format_table(result["rows"]))
  result["targets"] = targets(result["rows"])
  for t in result["targets"]:
    print(f"{t['target']}: {t['value']:.4g} (limit {t['limit']:.4g}) -> "
          f"{'met' if t['met'] else 'MISSED'}")  # fmt: skip
  write_json(out, result)
  print(f"wrote {out}")
  return result


if __name__ == "__main__":
  main()
