"""Sharded parameters on a CPU mesh: the collectives and memory of each compiled step.

An MLP whose weights are sharded over a ``data x model`` mesh of 8 simulated
CPU devices (FSDP over ``data``, tensor parallelism over ``model``), the batch
sharded over ``data``, trained under ``jax.jit`` in Auto or Explicit axes. For
each step (AdamW; ``optax.contrib.sam``; gsam, sam, momentum_sam, every-k and
micro-batched gsam before AdamW) it compiles the step and reads the compiled
HLO's collectives (count and bytes of each kind), the compiled temporary
memory and the compile time. The compiled program is deterministic, so the
counts are exact.

Targets: a sharded gsam or sam step has at most 2 all-reduces and 1 KiB of
all-reduced bytes more than ``optax.contrib.sam``'s step (two base passes).

Run: ``python -m benchmarks.costs.sharded`` (about a minute on 2 cores); writes
``benchmarks/results/sharded.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optax_gsam  # noqa: E402

from benchmarks.baselines import contrib_sam  # noqa: E402
from benchmarks.compiled import hlo  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "results"
MESH_SHAPE, AXES = (2, 4), ("data", "model")
# The params' layout (FSDP x tensor parallel) and the layout the model computes in.
PARAM_SPECS = {"w1": P("data", "model"), "w2": P("model", "data"), "w3": P("data", "model")}
COMPUTE_SPECS = {"w1": P(None, "model"), "w2": P("model", None), "w3": P(None, "model")}
RHO, ALPHA, LR = 0.05, 0.3, 1e-3


def make_model(width: int, batch: int, mode: AxisType):
  """Params, a batch and a loss laid out on the mesh as the users of ``mode`` write it."""
  keys = jax.random.split(jax.random.key(0), 5)
  shapes = {"w1": (width, width), "w2": (width, width), "w3": (width, width)}
  params = {
    k: jax.random.normal(key, s) / width**0.5
    for (k, s), key in zip(shapes.items(), keys[:3], strict=True)
  }
  x = jax.random.normal(keys[3], (batch, width))
  y = jax.random.normal(keys[4], (batch, width))
  explicit = mode == AxisType.Explicit

  def place(value, spec):
    if explicit:
      return jax.sharding.reshard(value, spec)
    return jax.lax.with_sharding_constraint(value, spec)

  def matmul(a, b, spec):
    return jnp.matmul(a, b, out_sharding=spec) if explicit else place(a @ b, spec)

  def loss_fn(params, batch):
    p = {k: place(v, COMPUTE_SPECS[k]) for k, v in params.items()}
    x, y = batch
    h = jnp.tanh(matmul(x, p["w1"], P("data", "model")))
    h = jnp.tanh(matmul(h, p["w2"], P("data", None)))
    out = matmul(h, p["w3"], P("data", "model"))
    return jnp.mean((out - y) ** 2)

  return params, (x, y), loss_fn


# name -> (optimizer from the base, protocol, perturb) with protocol "base", "grad_fn" (contrib.sam),
# "loss_fn" (the clean gradient passed in), "batch" (micro-batches: update(None, batch=)),
# "closed" (no clean pass: update(None, loss_fn=)).
CONTENDERS = {
  "adamw": (lambda base: base, "base", None),
  "optax.contrib.sam": (lambda base: contrib_sam(base, RHO), "grad_fn", None),
  "gsam": (lambda base: optax.chain(optax_gsam.gsam(RHO, ALPHA), base), "loss_fn", None),
  "sam": (lambda base: optax.chain(optax_gsam.sam(RHO), base), "loss_fn", None),
  "momentum_sam": (lambda base: optax.chain(optax_gsam.momentum_sam(RHO), base), "closed", None),
  "gsam every-5 (cond)": (
    lambda base: optax.chain(
      optax_gsam.gsam(RHO, ALPHA, policy=optax_gsam.every_k_policy(5)), base
    ),
    "loss_fn",
    None,
  ),
  "gsam microbatches=4": (
    lambda base: optax.chain(optax_gsam.gsam(RHO, ALPHA, microbatches=4), base),
    "batch",
    None,
  ),
}


def make_step(name: str, loss_fn):
  make, protocol, perturb = CONTENDERS[name]
  tx = make(optax.adamw(LR))

  def step(params, opt_state, batch):
    if protocol == "batch":
      updates, opt_state = tx.update(None, opt_state, params, loss_fn=loss_fn, batch=batch)
    elif protocol == "closed":
      closed = lambda p: loss_fn(p, batch)
      updates, opt_state = tx.update(None, opt_state, params, loss_fn=closed)
    elif protocol == "grad_fn":
      grads = jax.grad(loss_fn)(params, batch)
      grad_fn = lambda p, _: jax.grad(loss_fn)(p, batch)
      updates, opt_state = tx.update(grads, opt_state, params, grad_fn=grad_fn)
    else:
      loss, grads = jax.value_and_grad(loss_fn)(params, batch)
      closed = lambda p: loss_fn(p, batch)
      kwargs = {"loss_fn": closed, "value": loss} if protocol == "loss_fn" else {}
      if perturb is not None:
        kwargs["perturb"] = perturb
      updates, opt_state = tx.update(grads, opt_state, params, **kwargs)
    return optax.apply_updates(params, updates), opt_state

  return tx, step


def measure(name: str, mode: AxisType, width: int, batch: int) -> dict:
  mesh = jax.make_mesh(MESH_SHAPE, AXES, axis_types=(mode,) * len(AXES))
  with jax.set_mesh(mesh):
    params, data, loss_fn = make_model(width, batch, mode)
    params = {k: jax.device_put(v, NamedSharding(mesh, PARAM_SPECS[k])) for k, v in params.items()}
    data = jax.device_put(data, NamedSharding(mesh, P("data", None)))
    tx, step = make_step(name, loss_fn)
    opt_state = jax.jit(tx.init)(params)
    start = time.perf_counter()
    lowered = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, data)
    traced = time.perf_counter() - start
    start = time.perf_counter()
    compiled = lowered.compile()
    compile_seconds = time.perf_counter() - start
  memory = compiled.memory_analysis()
  found = hlo.collectives(compiled.as_text())
  return {
    "contender": name,
    "mode": mode.name,
    "collectives": found,
    "all_reduce_count": found.get("all-reduce", {}).get("count", 0),
    "all_reduce_bytes": found.get("all-reduce", {}).get("bytes", 0),
    "temp_bytes": int(memory.temp_size_in_bytes),
    "trace_seconds": traced,
    "compile_seconds": compile_seconds,
  }


def targets(rows: list[dict]) -> list[dict]:
  """gsam and sam against optax.contrib.sam in each mode: <= 2 more all-reduces, <= 1 KiB more."""
  found = []
  for mode in {r["mode"] for r in rows}:
    by_name = {r["contender"]: r for r in rows if r["mode"] == mode}
    ref = by_name["optax.contrib.sam"]
    for name in ("gsam", "sam"):
      extra_count = by_name[name]["all_reduce_count"] - ref["all_reduce_count"]
      extra_bytes = by_name[name]["all_reduce_bytes"] - ref["all_reduce_bytes"]
      found.append({
        "mode": mode,
        "contender": name,
        "extra_all_reduces": extra_count,
        "extra_all_reduce_bytes": extra_bytes,
        "met": extra_count <= 2 and extra_bytes <= 1024,
      })  # fmt: skip
  return found


def print_table(rows: list[dict]) -> None:
  kinds = sorted({k for r in rows for k in r["collectives"]})
  header = ["mode", "contender", *[f"{k} n/bytes" for k in kinds], "temp MiB", "compile s"]
  print(" | ".join(header))
  for r in rows:
    cells = [r["mode"], r["contender"]]
    for k in kinds:
      entry = r["collectives"].get(k, {"count": 0, "bytes": 0})
      cells.append(f"{entry['count']}/{entry['bytes']}")
    cells += [f"{r['temp_bytes'] / 2**20:.2f}", f"{r['compile_seconds']:.2f}"]
    print(" | ".join(cells))


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--width", type=int, default=256)
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--contenders", nargs="*", default=list(CONTENDERS))
  parser.add_argument("--modes", nargs="*", default=["Auto", "Explicit"])
  parser.add_argument("--out", default=str(RESULTS / "sharded.json"))
  args = parser.parse_args(argv)
  rows = []
  for mode in args.modes:
    for name in args.contenders:
      rows.append(measure(name, AxisType[mode], args.width, args.batch))
      print(f"  {mode} {name}: done", flush=True)
  print_table(rows)
  result = {
    "mesh": dict(zip(AXES, MESH_SHAPE, strict=True)),
    "width": args.width,
    "batch": args.batch,
    "rows": rows,
  }
  if "optax.contrib.sam" in args.contenders and "gsam" in args.contenders:
    result["targets"] = targets(rows)
    for t in result["targets"]:
      status = "met" if t["met"] else "MISSED"
      print(
        f"{t['mode']} {t['contender']}: {t['extra_all_reduces']} all-reduces and "
        f"{t['extra_all_reduce_bytes']} bytes more than optax.contrib.sam ({status})"
      )
  pathlib.Path(args.out).write_text(json.dumps(result, indent=2))
  return result


if __name__ == "__main__":
  main()
