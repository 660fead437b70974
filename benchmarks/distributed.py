"""Data-parallel GSAM: collectives in the compiled step, 8-device throughput, pod estimate.

For base / SAM / GSAM, per-device and synchronized perturbation (and GSAM with
``perturb_every=5``), each written as a per-device step under
``optax_gsam.data_parallel`` on an 8-device mesh, this script

1. compiles the step and reads its HLO: the number of all-reduce ops and the
   bytes they move, split into gradient-sized and scalar ones;
2. times the steps on the 8 simulated CPU devices, interleaved over rounds, and
   reports each contender's median step time as a ratio to the base step;
3. estimates the per-step cost of GSAM on a TPU v3-64 pod for the paper's
   ViT-B/32 (global batch 4096, 64 per core), from the FLOPs of the per-device
   step (XLA's cost analysis of the lowered program) and the gradient bytes
   all-reduced. Hardware figures are command-line assumptions, printed with the
   estimate.

    python benchmarks/distributed.py            # full
    python benchmarks/distributed.py --quick    # about a minute on 2 cores

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

import harness
from harness import render_table
from models import ViT

AXIS = "data"
RESULTS = pathlib.Path(__file__).resolve().parent / "results"
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
    "gsam k=5": optax_gsam.gsam(rho, alpha, axis_name=AXIS, perturb_every=5),
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


def pod_estimate(args) -> dict:
  """Per-step cost of per-device GSAM for ViT-B/32 on a v3-64 from FLOPs and bytes."""
  model = ViT(patch=32, width=768, depth=12, heads=12, num_classes=1000)
  per_core_batch = args.pod_global_batch // args.pod_cores
  images = jax.ShapeDtypeStruct((per_core_batch, 224, 224, 3), jnp.float32)
  labels = jax.ShapeDtypeStruct((per_core_batch,), jnp.int32)
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 224, 224, 3))))
  num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  flops = {}
  for name, sharpness in (("base", None), ("gsam", optax_gsam.gsam(0.6, 0.6))):
    # Single-device program of one core's shard: the FLOPs a core executes.
    tx, _ = make_step(model, sharpness)

    def local_step(p, s, x, y, tx=tx, sharpness=sharpness):
      loss_fn = lambda q: optax.softmax_cross_entropy_with_integer_labels(
        model.apply(q, x), y
      ).mean()
      loss, grads = jax.value_and_grad(loss_fn)(p)
      extra = {} if sharpness is None else {"loss_fn": loss_fn, "value": loss}
      updates, s = tx.update(grads, s, p, **extra)
      return optax.apply_updates(p, updates), s

    state = jax.eval_shape(tx.init, params)
    analysis = jax.jit(local_step).lower(params, state, images, labels).cost_analysis()
    flops[name] = float(analysis["flops"])
  gradient_bytes = 4 * num_params  # float32 gradients
  chips = args.pod_cores // 2
  # A bandwidth-optimal all-reduce moves 2 (n - 1) / n of the buffer per chip.
  allreduce_s = 2 * (chips - 1) / chips * gradient_bytes / (args.ici_gbytes_per_s * 1e9)
  compute = {k: v / (args.core_tflops * 1e12 * args.mfu) for k, v in flops.items()}
  return {
    "model": "ViT-B/32, 224x224, 1000 classes",
    "num_params": num_params,
    "pod_cores": args.pod_cores,
    "global_batch": args.pod_global_batch,
    "per_core_batch": per_core_batch,
    "flops_per_core_step": flops,
    "gsam_to_base_flops": flops["gsam"] / flops["base"],
    "gradient_bytes": gradient_bytes,
    "assumptions": {
      "core_peak_tflops": args.core_tflops,
      "mfu": args.mfu,
      "allreduce_gbytes_per_s_per_chip": args.ici_gbytes_per_s,
    },
    "estimated_ms": {
      "base_compute": 1e3 * compute["base"],
      "gsam_compute": 1e3 * compute["gsam"],
      "gradient_allreduce": 1e3 * allreduce_s,
      "base_step": 1e3 * (compute["base"] + allreduce_s),
      "gsam_step": 1e3 * (compute["gsam"] + allreduce_s),
      "gsam_sync_step": 1e3 * (compute["gsam"] + 2 * allreduce_s),
    },
  }


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
  parser.add_argument("--no-pod-estimate", action="store_true")
  parser.add_argument(
    "--contenders",
    nargs="+",
    choices=list(contenders()),
    default=list(contenders()),
    help="which steps to compile and time (base always joins: the ratios need it)",
  )
  parser.add_argument("--pod-cores", type=int, default=64)
  parser.add_argument("--pod-global-batch", type=int, default=4096)
  parser.add_argument("--core-tflops", type=float, default=61.5, help="v3: 123 TFLOP/s per chip")
  parser.add_argument("--mfu", type=float, default=0.4, help="assumed model FLOPs utilisation")
  parser.add_argument(
    "--ici-gbytes-per-s", type=float, default=100.0, help="assumed all-reduce bandwidth per chip"
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
    estimate = pod_estimate(args)
    result["pod_estimate"] = estimate
    ms = estimate["estimated_ms"]
    print(
      f"\nv3-{args.pod_cores} estimate, {estimate['model']}, {estimate['per_core_batch']}/core: "
      f"GSAM/base FLOPs {estimate['gsam_to_base_flops']:.2f}x; base {ms['base_step']:.0f} ms, "
      f"GSAM {ms['gsam_step']:.0f} ms, GSAM sync {ms['gsam_sync_step']:.0f} ms per step "
      f"(all-reduce {ms['gradient_allreduce']:.1f} ms; assumptions: {estimate['assumptions']})"
    )
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(json.dumps(result, indent=2))
  print(f"wrote {args.out}")
  return result


if __name__ == "__main__":
  main()
