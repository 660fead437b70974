"""The GPU steps run on a real GPU: peak memory against the deviceless compile, and step time.

For a lent GPU. ``sharded.py --topology 8xh100`` measures every step from the program the
GPU compiler builds with no GPU attached; this script checks those figures on the device.
For each contender (AdamW, optax.contrib.sam, gsam, sam, ``sam(diagnostics=False)``,
momentum_sam) and dtype, on one GPU:

* **memory**: in a fresh process (the device's ``peak_bytes_in_use`` only grows), the step is
  compiled for the GPU at hand and run; the device's peak is compared with the program's
  ``memory_analysis()`` peak, and with the same step compiled deviceless for a described GPU of
  the same memory (another fresh process, ``JAX_PLATFORMS=cpu``);
* **time**: in one process, every step compiled and timed in interleaved rounds, as ratios to
  AdamW's and optax.contrib.sam's.

    python -m benchmarks.compiled.gpu_runtime                       # ViT-L/16, 32 images, f32 and bf16
    python -m benchmarks.compiled.gpu_runtime --model decoder --per-device-batch 4
    python -m benchmarks.compiled.gpu_runtime --quick               # a small ViT; also runs on the CPU

Writes ``benchmarks/results/gpu_runtime.json`` (``--out``), and prints the table.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import pathlib
import statistics
import sys
import time

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "results"
CONTENDERS = ("adamw", "optax.contrib.sam", "gsam", "sam", "sam diagnostics=False", "momentum_sam")
GiB = 2**30


def _arrays(args, key_seed: int = 0):
  """Real arrays for the step's argument specs: small random params, zero state, a batch."""
  import jax
  import jax.numpy as jnp

  params, opt_state, batch = args
  keys = iter(jax.random.split(jax.random.key(key_seed), len(jax.tree.leaves(params)) + 1))
  made = lambda s: jax.device_put(
    0.02 * jax.random.normal(next(keys), s.shape, s.dtype)
    if jnp.issubdtype(s.dtype, jnp.floating) else jnp.zeros(s.shape, s.dtype), s.sharding
  )  # fmt: skip
  zeros = lambda s: jax.device_put(jnp.zeros(s.shape, s.dtype), s.sharding)
  if jnp.issubdtype(batch.dtype, jnp.integer):  # tokens
    data = jax.random.randint(next(keys), batch.shape, 0, 256, batch.dtype)
  else:
    data = jax.random.normal(next(keys), batch.shape, batch.dtype)
  return (
    jax.tree.map(made, params),
    jax.tree.map(zeros, opt_state),
    jax.device_put(data, batch.sharding),
  )


def _problem(options):
  from benchmarks.compiled import decoder
  from benchmarks.compiled import vit

  configs = {"vit": (vit.VIT_L16, vit.VIT_SCANNED_QUICK),
             "decoder": (decoder.DECODER_1B, decoder.DECODER_QUICK)}  # fmt: skip
  return configs[options["model"]][options["quick"]]


def _one_device_mesh(device):
  import jax
  import numpy as np

  return jax.sharding.Mesh(np.array([device]), ("data",))  # sharded_steps.AXIS


def _peak_on_device(options, name, dtype, queue) -> None:
  """A fresh process: the step compiled and run on the device; its peak bytes in use."""
  import jax

  device = jax.devices()[0]  # the backend starts here, before aot_env (sharded_steps) sets the CPU
  from benchmarks.compiled import sharded_steps
  from benchmarks.compiled.hlo import analyse

  mesh = _one_device_mesh(device)
  jitted, args, _ = sharded_steps.build(mesh, _problem(options), sharded_steps.DTYPES[dtype], name,
                                      options["batch"])  # fmt: skip
  with jax.set_mesh(mesh):
    compiled = jitted.lower(*args).compile()
    state = _arrays(args)
    for _ in range(options["memory_steps"]):
      params, opt_state = compiled(*state)
      state = (params, opt_state, state[2])
    jax.block_until_ready(state)
  stats = device.memory_stats() or {}
  queue.put({
    "device": device.device_kind, "memory_bytes": stats.get("bytes_limit"),
    "peak_bytes_in_use": stats.get("peak_bytes_in_use"), "compiled": analyse(compiled)["peak_bytes"],
  })  # fmt: skip


def _peak_deviceless(options, name, dtype, memory_bytes, queue) -> None:
  """A fresh process on the CPU: the step compiled for a described GPU with that memory."""
  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax

  from benchmarks.compiled import gpu_target
  from benchmarks.compiled import sharded_steps
  from benchmarks.compiled.hlo import analyse

  (device,) = gpu_target.gpu_devices(gpu_target.H100_SXM, 1, memory_bytes)
  mesh = _one_device_mesh(device)
  jitted, args, _ = sharded_steps.build(mesh, _problem(options), sharded_steps.DTYPES[dtype], name,
                                      options["batch"])  # fmt: skip
  with jax.set_mesh(mesh):
    compiled = jitted.lower(*args).compile()
  queue.put({"deviceless": analyse(compiled)["peak_bytes"]})


def _in_fresh_process(target, *args) -> dict:
  context = multiprocessing.get_context("spawn")
  queue = context.Queue()
  process = context.Process(target=target, args=(*args, queue))
  process.start()
  found = queue.get(timeout=1800)
  process.join()
  return found


def _times(options, dtype) -> dict[str, float]:
  """Seconds per step of every contender, timed in interleaved rounds in this process."""
  import jax

  mesh = _one_device_mesh(jax.devices()[0])  # before aot_env (sharded_steps) sets the CPU
  from benchmarks.compiled import sharded_steps

  compiled, states = {}, {}
  with jax.set_mesh(mesh):
    for name in options["contenders"]:
      jitted, args, _ = sharded_steps.build(mesh, _problem(options), sharded_steps.DTYPES[dtype], name,
                                          options["batch"])  # fmt: skip
      compiled[name] = jitted.lower(*args).compile()
      states[name] = _arrays(args)
    samples: dict[str, list[float]] = {name: [] for name in compiled}
    for round_ in range(options["rounds"] + 1):  # the first round warms up
      for name, step in compiled.items():
        state = states[name]
        start = time.perf_counter()
        for _ in range(options["steps"]):
          params, opt_state = step(*state)
          state = (params, opt_state, state[2])
        jax.block_until_ready(state)
        states[name] = state
        if round_:
          samples[name].append((time.perf_counter() - start) / options["steps"])
  return {name: statistics.median(values) for name, values in samples.items()}


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", choices=("vit", "decoder"), default="vit")
  parser.add_argument("--quick", action="store_true", help="a small model (runs on the CPU too)")
  parser.add_argument("--per-device-batch", type=int, default=None)
  parser.add_argument("--dtypes", nargs="+", default=["f32", "bf16"])
  parser.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=list(CONTENDERS))
  parser.add_argument("--steps", type=int, default=10, help="steps per timing round")
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "gpu_runtime.json")
  a = parser.parse_args(argv)
  options = {
    "model": a.model, "quick": a.quick, "contenders": a.contenders, "steps": a.steps,
    "rounds": a.rounds, "memory_steps": 3,
    "batch": a.per_device_batch or (4 if a.quick else {"vit": 32, "decoder": 4}[a.model]),
  }  # fmt: skip
  import jax

  from benchmarks.reporting import code_version
  from benchmarks.reporting import render_table
  from benchmarks.reporting import write_json

  platform = jax.devices()[0].platform
  result = {"command": " ".join(["python -m benchmarks.compiled.gpu_runtime", *(argv or sys.argv[1:])]),
            "code": code_version(), "jax": jax.__version__, "platform": platform,
            "device": jax.devices()[0].device_kind, "options": options, "rows": []}  # fmt: skip
  for dtype in a.dtypes:
    times = _times(options, dtype)
    for name in a.contenders:
      row = {"dtype": dtype, "contender": name, "seconds_per_step": times[name]}
      row.update(_in_fresh_process(_peak_on_device, options, name, dtype))
      if platform == "gpu" and row.get("memory_bytes"):
        row.update(_in_fresh_process(_peak_deviceless, options, name, dtype, row["memory_bytes"]))
      row["time / adamw"] = times[name] / times["adamw"] if "adamw" in times else None
      row["time / optax.contrib.sam"] = (
        times[name] / times["optax.contrib.sam"] if "optax.contrib.sam" in times else None
      )
      result["rows"].append(row)
      write_json(a.out, result)
  cells = [("dtype", "contender", "device peak GiB", "compiled GiB", "deviceless GiB",
            "device / deviceless", "ms / step", "/ adamw", "/ contrib.sam")]  # fmt: skip
  gib = lambda v: "-" if not v else f"{v / GiB:.3f}"
  ratio = lambda v: "-" if v is None else f"{v:.3f}"
  for r in result["rows"]:
    versus = (
      r.get("peak_bytes_in_use") / r["deviceless"]
      if r.get("deviceless") and r.get("peak_bytes_in_use")
      else None
    )
    cells.append((r["dtype"], r["contender"], gib(r.get("peak_bytes_in_use")), gib(r["compiled"]),
                  gib(r.get("deviceless")), ratio(versus), f"{1e3 * r['seconds_per_step']:.2f}",
                  ratio(r["time / adamw"]), ratio(r["time / optax.contrib.sam"])))  # fmt: skip
  print(render_table(cells))
  write_json(a.out, result)
  print(f"wrote {a.out}")
  return result


if __name__ == "__main__":
  main()
