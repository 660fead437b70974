"""Gradient cache: compiled memory against batch size, and step time against full batch.

A two-tower CLIP model with small transformer encoders (written in plain JAX)
is differentiated three ways:

* ``full``: ``jax.value_and_grad`` of the dense CLIP loss over the whole batch;
* ``cached``: ``optax_gsam.cached_value_and_grad`` (chunk 128) with the dense loss;
* ``cached+tiled``: the same with the tiled loss (``tile_size=128``).

For each batch size the script compiles every variant and reads XLA's
``memory_analysis().temp_size_in_bytes`` (deterministic on CPU; nothing is
run, so batch 16384 costs only a compile), then times the variants where the
full batch is small enough to run, interleaved over rounds (median).

    python -m benchmarks.costs.gradient_cache            # full: batches up to 16384, timing at 256 and 1024
    python -m benchmarks.costs.gradient_cache --quick    # about a minute on 2 cores

Writes ``results/gradient_cache[_quick].json`` and a PNG; targets and results in
benchmarks/README.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import optax_gsam

from benchmarks import harness


def init_tower(key, features, width, depth, mlp, out):
  keys = iter(jax.random.split(key, 4 + 4 * depth))

  def dense(fan_in, fan_out):
    return jax.random.normal(next(keys), (fan_in, fan_out)) / np.sqrt(fan_in)

  layers = [
    {
      "qkv": dense(width, 3 * width),
      "proj": dense(width, width),
      "up": dense(width, mlp),
      "down": dense(mlp, width),
    }
    for _ in range(depth)
  ]
  return {"embed": dense(features, width), "layers": layers, "head": dense(width, out)}


def layer_norm(x):
  mean = jnp.mean(x, axis=-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(jnp.var(x, axis=-1, keepdims=True) + 1e-6)


def tower(params, x, heads):
  """[batch, seq, features] -> L2-normalised [batch, out]: pre-LN transformer, mean pool."""
  h = x @ params["embed"]
  batch, seq, width = h.shape
  for layer in params["layers"]:
    q, k, v = jnp.split(layer_norm(h) @ layer["qkv"], 3, axis=-1)
    q, k, v = (a.reshape(batch, seq, heads, width // heads) for a in (q, k, v))
    attention = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(width // heads))
    h = h + jnp.einsum("bhqk,bkhd->bqhd", attention, v).reshape(batch, seq, width) @ layer["proj"]
    h = h + jax.nn.gelu(layer_norm(h) @ layer["up"]) @ layer["down"]
  z = jnp.mean(h, axis=1) @ params["head"]
  return z / jnp.linalg.norm(z, axis=-1, keepdims=True)


def make_problem(config):
  keys = jax.random.split(jax.random.key(0), 2)
  kw = {k: config[k] for k in ("width", "depth", "mlp", "out")}
  params = {
    "image": init_tower(keys[0], config["image_features"], **kw),
    "text": init_tower(keys[1], config["text_features"], **kw),
    "t": jnp.float32(np.log(1 / 0.07)),
  }

  def embed(p, batch):
    return {
      "image": tower(p["image"], batch["image"], config["heads"]),
      "text": tower(p["text"], batch["text"], config["heads"]),
    }

  def batch_spec(size):
    return {
      "image": jax.ShapeDtypeStruct((size, config["seq"], config["image_features"]), jnp.float32),
      "text": jax.ShapeDtypeStruct((size, config["seq"], config["text_features"]), jnp.float32),
    }

  return params, embed, batch_spec


def variants(embed, chunk, tile):
  def loss(tile_size):
    return lambda p, r: optax_gsam.clip_loss(r["image"], r["text"], p["t"], tile_size=tile_size)

  return {
    "full": jax.value_and_grad(lambda p, b: loss(None)(p, embed(p, b))),
    "cached": optax_gsam.cached_value_and_grad(embed, loss(None), chunk_size=chunk),
    "cached+tiled": optax_gsam.cached_value_and_grad(embed, loss(tile), chunk_size=chunk),
  }


def compiled(fn, params, spec):
  return jax.jit(fn).lower(params, spec).compile()


def time_variants(fns, params, batch, rounds):
  """Per variant: median seconds per call and median ratio to ``full``, interleaved over rounds."""
  timed = {name: harness.Timed((lambda _, fn=fn: fn(params, batch),)) for name, fn in fns.items()}
  for t in timed.values():
    t.run(1)  # compile and warm up
  times = harness.interleaved(timed, "full", rounds=rounds, steps=1)
  return {name: t["ms"] / 1e3 for name, t in times.items()}, {
    n: t["ratio"] for n, t in times.items()
  }


def plot(memory, path):
  fig, ax = harness.figure(figsize=(6, 4))
  for name, by_batch in memory.items():
    sizes = sorted(int(b) for b in by_batch)
    ax.plot(sizes, [by_batch[str(b)] / 2**20 for b in sizes], marker="o", label=name)
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xlabel("batch size")
  ax.set_ylabel("compiled temp memory (MiB)")
  ax.set_title("Two-tower transformer, CLIP loss: value_and_grad memory")
  ax.grid(True, which="both", alpha=0.3)
  ax.legend()
  harness.save_figure(fig, path)


def measure(fns, params, batch_spec, memory_batches, timing_batches, rounds) -> tuple:
  """Each variant's compiled temp bytes per batch; its median seconds and ratio to full batch."""
  memory = {
    name: {
      str(b): int(compiled(fn, params, batch_spec(b)).memory_analysis().temp_size_in_bytes)
      for b in memory_batches
    }
    for name, fn in fns.items()
  }
  timing, time_ratios = {}, {}
  rng = np.random.default_rng(0)
  for batch in timing_batches:
    spec = batch_spec(batch)
    data = jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s.shape), s.dtype), spec)
    jitted = {name: jax.jit(fn) for name, fn in fns.items()}
    timing[str(batch)], time_ratios[str(batch)] = time_variants(jitted, params, data, rounds)
  return memory, timing, time_ratios


def main(argv: list[str] | None = None) -> dict:
  parser = harness.parser(__doc__)
  parser.add_argument("--chunk", type=int, default=128)
  parser.add_argument("--tile", type=int, default=128)
  parser.add_argument("--rounds", type=int, default=None)
  args = parser.parse_args(argv)

  config = dict(
    seq=32, image_features=48, text_features=32, width=64, depth=2, heads=4, mlp=256, out=32
  )
  memory_batches = [256, 1024, 4096, 16384] if not args.quick else [1024, 4096, 16384]
  timing_batches = [256, 1024] if not args.quick else [256]
  rounds = args.rounds or (5 if not args.quick else 3)

  params, embed, batch_spec = make_problem(config)
  fns = variants(embed, args.chunk, args.tile)
  memory, timing, time_ratios = measure(
    fns, params, batch_spec, memory_batches, timing_batches, rounds
  )

  print(f"Two-tower transformer {config}, chunk {args.chunk}, tile {args.tile}")
  print("\ncompiled temp memory (MiB)")
  print(f"{'batch':>8} " + " ".join(f"{n:>14}" for n in fns))
  for batch in memory_batches:
    cells = " ".join(f"{memory[n][str(batch)] / 2**20:14.1f}" for n in fns)
    print(f"{batch:>8} {cells}")
  tiled = memory["cached+tiled"]
  memory_ratio = tiled["16384"] / tiled["1024"]

  print("\nseconds per value_and_grad (median), ratio to full batch")
  print(f"{'batch':>8} " + " ".join(f"{n:>22}" for n in fns))
  for batch, times in timing.items():
    ratios = time_ratios[batch]
    cells = " ".join(f"{times[n]:10.3f}s ({ratios[n]:5.2f}x)" for n in fns)
    print(f"{batch:>8} {cells}")
  worst = max(r[n] for r in time_ratios.values() for n in ("cached", "cached+tiled"))
  checks = [
    harness.check(
      "cached+tiled temp memory, batch 16384 / 1024 <= 1.5", memory_ratio, memory_ratio <= 1.5
    ),
    harness.check("worst cached / full time ratio <= 1.35", worst, worst <= 1.35),
  ]

  result = {
    "config": config,
    "chunk_size": args.chunk,
    "tile_size": args.tile,
    "temp_bytes": memory,
    "tiled_memory_ratio_16384_over_1024": memory_ratio,
    "seconds": timing,
    "time_ratio_to_full": time_ratios,
    "worst_time_ratio": worst,
    "targets": checks,
  }
  draw = None if args.no_plot else functools.partial(plot, memory)
  return harness.save(
    "gradient_cache", "quick" if args.quick else "full", result, args.out_dir, argv, draw
  )


if __name__ == "__main__":
  main()
