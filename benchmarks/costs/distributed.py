"""Data-parallel GSAM: collectives in the compiled step, 8-device throughput, v3-64 figures.

For base / SAM / GSAM, per-device and synchronized perturbation (and GSAM with
``policy=every_k_policy(5)``), each written as a per-device step under
``optax_gsam.data_parallel`` on an 8-device mesh, this script

1. compiles the step and reads its HLO: the number of all-reduce ops and the
   bytes they move, split into gradient-sized and scalar ones;
2. times the steps on the 8 simulated CPU devices, interleaved over rounds, and
   reports each contender's median step time as a ratio to the base step;
3. prints the TPU compiler's figures for the paper's ViT-B/32 on a TPU v3-64
   (global batch 4096, 64 per core): peak memory, FLOPs, XLA's time estimate
   and all-reduce bytes per core, as ``benchmarks/compiled/tpu_compile.py`` recorded them
   in ``results/tpu_compile.json`` (compiled ahead of time, no estimate on paper).

    python -m benchmarks.costs.distributed            # full
    python -m benchmarks.costs.distributed --quick    # about a minute on 2 cores

Writes ``benchmarks/results/distributed.json``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import time

import jax

if jax.config.jax_platforms in (None, "", "cpu"):
  jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp
import numpy as np
import optax

import optax_gsam

from benchmarks import harness
from benchmarks.harness import render_table
from benchmarks.models import ViT

AXIS = "data"
RESULTS = pathlib.Path(__file__).resolve().parents[1] / "results"
DTYPE_BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "pred": 1}
SCALAR_BYTES = 1024  # all-reduces at or below this size carry losses and diagnostics


def contenders(rho: float = 0.05, alpha: float = 0.3) -> dict[str, optax.GradientTransformation]:
  """name -> the transform that goes before the base optimizer (None: base step)."""
  return {
    "base": None,
    "sam": optax_gsam.sam(rho, axis_name=AXIS),
    "sam sync": optax_gsam.sam(rho, axis_name=AXIS, sync_perturbation=True),
    "gsam": optax_gsam.gsam(rho, alpha, axis_name=AXIS),
    "gsam sync": optax_gsam.gsam(rho, alpha, axis_name=AXIS, sync_perturbation=True),
    "gsam k=5": optax_gsam.gsam(rho, alpha, axis_name=AXIS, policy=optax_gsam.every_k_policy(5)),
  }


def make_step(model, sharpness):
  """A per-device train step; the base step averages its own gradient."""
  base = optax.adamw(1e-3, weight_decay=1e-4)
  tx = base if sharpness is None else optax.chain(sharpness, base)

  def step(params, opt_state, batch):
    images, labels = batch

    loss_fn = lambda p: harness.cross_entropy(model.apply(p, images), labels)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    if sharpness is None:
      grads = jax.lax.pmean(grads, AXIS)
      updates, opt_state = tx.update(grads, opt_state, params)
    else:
      updates, opt_state = tx.update(grads, opt_state, params, loss_fn=loss_fn, value=loss)
    return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, AXIS)

  return tx, step


def _shape_bytes(shape_text: str) -> int:
  total = 0
  for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", shape_text):
    if dtype in DTYPE_BYTES:
      total += DTYPE_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
  return total


def all_reduce_stats(hlo_text: str) -> dict[str, int]:
  """Counts all-reduce ops in optimized HLO and the bytes of their results."""
  ops = re.findall(r"=\s*(\(.*?\)|\S+)\s+all-reduce(?:-start)?\(", hlo_text)
  sizes = [_shape_bytes(shape) for shape in ops]
  gradient = [s for s in sizes if s > SCALAR_BYTES]
  return {
    "all_reduce_ops": len(sizes),
    "gradient_sized_ops": len(gradient),
    "scalar_ops": len(sizes) - len(gradient),
    "all_reduce_bytes": int(sum(sizes)),
    "gradient_sized_bytes": int(sum(gradient)),
  }


def measure(args) -> list[dict]:
  mesh = jax.make_mesh((jax.device_count(),), (AXIS,))
  model = ViT(patch=4, width=args.width, depth=args.depth, heads=3)
  global_batch = args.per_device_batch * jax.device_count()
  rng = np.random.default_rng(0)
  images = jnp.asarray(rng.normal(size=(global_batch, 32, 32, 3)), jnp.float32)
  labels = jnp.asarray(rng.integers(0, 10, global_batch), jnp.int32)
  params = model.init(jax.random.key(0), images[:1])
  param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))

  timed, hlo = {}, {}
  chosen = {name: t for name, t in contenders().items() if name in args.contenders}
  for name, sharpness in chosen.items():
    tx, step = make_step(model, sharpness)
    state = tx.init(params)
    start = time.perf_counter()
    train_step = optax_gsam.data_parallel(step, mesh, axis_name=AXIS)
    compiled = train_step.lower(params, state, (images, labels)).compile()
    advance = lambda s, c=compiled: c(s[0], s[1], (images, labels))
    timed[name] = harness.Timed(
      (advance,), (params, state, None), compile_s=time.perf_counter() - start
    )
    hlo[name] = all_reduce_stats(compiled.as_text())

  times = harness.interleaved(timed, "base", rounds=args.rounds, steps=args.steps_per_round)
  rows = []
  for name in timed:
    rows.append(
      {
        "contender": name,
        **hlo[name],
        "gradient_bytes": int(param_bytes),
        "step_ms": times[name]["ms"],
        "ratio_to_base": times[name]["ratio"],
        "compile_s": timed[name].compile_s,
      }
    )
  return rows


def pod_figures(path: pathlib.Path) -> dict | None:
  """The TPU compiler's per-core figures for the v3-64 ViT-B/32 step, from tpu_compile.py's JSON.

  Nothing here is estimated: ``benchmarks/compiled/tpu_compile.py`` compiled each step for a
  described v3-64 and recorded what ``memory_analysis()``, ``cost_analysis()``
  and the HLO say. Returns None when that JSON is missing.
  """
  if not path.exists():
    return None
  compiled = json.loads(path.read_text())
  rows = {(r["dtype"], r["contender"]): r for r in compiled["rows"]}
  summary = {}
  for (dtype, name), r in rows.items():
    if name not in ("adamw", "gsam", "gsam sync"):
      continue
    base = rows[(dtype, "adamw")]
    summary[f"{dtype} {name}"] = {
      "peak_gib": r["peak_bytes"] / 2**30,
      "flops_over_base": r["flops"] / base["flops"],
      "optimal_ms": 1e3 * r["optimal_seconds"],
      "all_reduce_ops": r["collectives"]["all-reduce"]["count"],
      "all_reduce_bytes": r["collectives"]["all-reduce"]["bytes"],
    }
  return {
    "source": path.name,
    "topology": compiled["topology"],
    "per_core_batch": compiled["per_core_batch"],
    "param_bytes": next(iter(rows.values()))["param_bytes"],
    "steps": summary,
  }


def format_pod_figures(figures: dict) -> str:
  lines = [
    f"{figures['topology']}, ViT-B/32, {figures['per_core_batch']} images per core, compiled "
    f"by the TPU compiler (results/{figures['source']}); per core:"
  ]
  for name, f in figures["steps"].items():
    lines.append(
      f"  {name:<15} peak {f['peak_gib']:.2f} GiB, FLOPs {f['flops_over_base']:.3f}x base, "
      f"XLA estimate {f['optimal_ms']:.1f} ms, {f['all_reduce_ops']} all-reduces of "
      f"{f['all_reduce_bytes']:,} bytes in all"
    )
  return "\n".join(lines)


def format_table(rows: list[dict]) -> str:
  header = ("contender", "all-reduces", "grad-sized", "scalar", "MB reduced", "step ms", "/ base")
  cells = [header]
  for r in rows:
    cells.append(
      (
        r["contender"],
        str(r["all_reduce_ops"]),
        str(r["gradient_sized_ops"]),
        str(r["scalar_ops"]),
        f"{r['all_reduce_bytes'] / 1e6:.3f}",
        f"{r['step_ms']:.1f}",
        f"{r['ratio_to_base']:.2f}x",
      )
    )
  return render_table(cells)


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--width", type=int, default=96)
  parser.add_argument("--depth", type=int, default=4)
  parser.add_argument("--per-device-batch", type=int, default=16)
  parser.add_argument("--rounds", type=int, default=None)
  parser.add_argument("--steps-per-round", type=int, default=None)
  parser.add_argument(
    "--no-pod-estimate", action="store_true", help="leave out the compiled v3-64 figures"
  )
  parser.add_argument(
    "--contenders",
    nargs="+",
    choices=list(contenders()),
    default=list(contenders()),
    help="which steps to compile and time (base always joins: the ratios need it)",
  )
  parser.add_argument(
    "--pod-results",
    type=pathlib.Path,
    default=RESULTS / "tpu_compile.json",
    help="benchmarks/compiled/tpu_compile.py's JSON, for the v3-64 figures",
  )
  parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "distributed.json")
  args = parser.parse_args(argv)
  args.contenders = ["base", *(c for c in args.contenders if c != "base")]
  if args.quick:
    args.width, args.depth = min(args.width, 48), min(args.depth, 2)
    args.per_device_batch = min(args.per_device_batch, 8)
  args.rounds = args.rounds or (3 if args.quick else 7)
  args.steps_per_round = args.steps_per_round or (3 if args.quick else 10)

  print(f"{jax.device_count()} {jax.default_backend()} devices, mesh axis {AXIS!r}")
  rows = measure(args)
  print(format_table(rows))
  result = {"devices": jax.device_count(), "backend": jax.default_backend(), "rows": rows}
  if not args.no_pod_estimate:
    figures = pod_figures(args.pod_results)
    if figures is None:
      print(
        f"\nno {args.pod_results}: run benchmarks/compiled/tpu_compile.py for the v3-64 figures"
      )
    else:
      result["pod_compiled"] = figures
      print("\n" + format_pod_figures(figures))
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(json.dumps(result, indent=2))
  print(f"wrote {args.out}")
  return result


if __name__ == "__main__":
  main()
