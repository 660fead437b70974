"""Compile time of a sharpness-aware step against ``optax.contrib.sam``'s, and where it goes.

A small CPU CNN (two convolutions and two dense layers, batch 128, Adam). For
each step (the base step; ``optax.contrib.sam``; gsam, sam; gsam with a full
step every fifth step, as a ``lax.cond`` and as two static branches; gsam on 4
micro-batches) it times ``jax.jit(step).lower(...)`` (tracing) and
``.compile()`` over interleaved rounds on one process (the median), and counts
the optimized HLO's instructions by opcode, so that the extra compile time can
be read against the extra ops.

Targets: the gsam step compiles in at most 1.2x ``optax.contrib.sam``'s time;
the every-k step in at most 1.5x.

How the program grows with the number of leaves: gsam and ``optax.contrib.sam``
on tanh MLPs of 10, 40 and 100 layers (16 x 16 kernels, one compile each):
``--depths``; ``--depths`` with no value skips it.

Run: ``python -m benchmarks.costs.compile_time`` (about two minutes on 2 cores);
writes ``benchmarks/results/compile_time.json``.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import re
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import optax_gsam

from benchmarks.baselines import contrib_sam

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "results"
RHO, ALPHA, LR = 0.05, 0.3, 1e-3


class SmallCNN(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(16, (3, 3))(x))
    x = nn.max_pool(nn.relu(nn.Conv(32, (3, 3))(x)), (2, 2), (2, 2))
    x = nn.relu(nn.Dense(64)(x.reshape((x.shape[0], -1))))
    return nn.Dense(10)(x)


def _gsam(**kwargs):
  return lambda base: optax.chain(optax_gsam.gsam(RHO, ALPHA, **kwargs), base)


# name -> (optimizer from the base, protocol, static perturb)
CONTENDERS = {
  "adam": (lambda base: base, "base", None),
  "optax.contrib.sam": (lambda base: contrib_sam(base, RHO), "grad_fn", None),
  "gsam": (_gsam(), "loss_fn", None),
  "sam": (lambda base: optax.chain(optax_gsam.sam(RHO), base), "loss_fn", None),
  "gsam every-5 (cond)": (_gsam(policy=optax_gsam.every_k_policy(5)), "loss_fn", None),
  "gsam every-5 (full branch)": (_gsam(policy=optax_gsam.every_k_policy(5)), "loss_fn", True),
  "gsam every-5 (cheap branch)": (_gsam(policy=optax_gsam.every_k_policy(5)), "loss_fn", False),
  "gsam microbatches=4": (_gsam(microbatches=4), "batch", None),
}


def make_step(name: str, model: nn.Module):
  make, protocol, perturb = CONTENDERS[name]
  tx = make(optax.adam(LR))

  def loss_fn(params, batch):
    images, labels = batch
    logits = model.apply({"params": params}, images)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  def step(params, opt_state, batch):
    if protocol == "batch":
      updates, opt_state = tx.update(None, opt_state, params, loss_fn=loss_fn, batch=batch)
      return optax.apply_updates(params, updates), opt_state
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    if protocol == "grad_fn":
      grad_fn = lambda p, _: jax.grad(loss_fn)(p, batch)
      updates, opt_state = tx.update(grads, opt_state, params, grad_fn=grad_fn)
    elif protocol == "loss_fn":
      extra = {} if perturb is None else {"perturb": perturb}
      closed = lambda p: loss_fn(p, batch)
      updates, opt_state = tx.update(grads, opt_state, params, loss_fn=closed, value=loss, **extra)
    else:
      updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return tx, step


def opcode_counts(hlo_text: str) -> collections.Counter:
  """Instructions of the optimized HLO (all computations, fusions included) by opcode."""
  found = re.findall(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*[^=]*?\s([a-z][\w\-]*)\(", hlo_text, re.M)
  return collections.Counter(found)


def measure_once(name: str, batch_size: int) -> dict:
  model = SmallCNN()
  images = jnp.zeros((batch_size, 28, 28, 1))
  labels = jnp.zeros((batch_size,), jnp.int32)
  params = model.init(jax.random.key(0), images[:1])["params"]
  tx, step = make_step(name, model)
  opt_state = tx.init(params)
  jitted = jax.jit(step)  # a new function each round: nothing comes from jit's caches
  start = time.perf_counter()
  lowered = jitted.lower(params, opt_state, (images, labels))
  trace = time.perf_counter() - start
  start = time.perf_counter()
  compiled = lowered.compile()
  compile_seconds = time.perf_counter() - start
  return {"trace": trace, "compile": compile_seconds, "hlo": compiled.as_text()}


def run(names: list[str], rounds: int, batch_size: int) -> list[dict]:
  times: dict[str, dict[str, list[float]]] = {n: {"trace": [], "compile": []} for n in names}
  counts: dict[str, collections.Counter] = {}
  for round_index in range(rounds):
    for name in names:  # interleaved, so a slow spell of the machine hits every contender
      found = measure_once(name, batch_size)
      times[name]["trace"].append(found["trace"])
      times[name]["compile"].append(found["compile"])
      counts[name] = opcode_counts(found["hlo"])
    print(f"  round {round_index + 1}/{rounds} done", flush=True)
  rows = []
  for name in names:
    rows.append({
      "contender": name,
      "trace_seconds": statistics.median(times[name]["trace"]),
      "compile_seconds": statistics.median(times[name]["compile"]),
      "hlo_instructions": sum(counts[name].values()),
      "opcodes": dict(counts[name].most_common()),
    })  # fmt: skip
  return rows


def _deep_mlp_step(name: str, depth: int):
  """(step, args) of ``name`` on a tanh MLP of ``depth`` 16 x 16 kernels (``depth`` leaves)."""
  params = {f"w{i}": jnp.full((16, 16), 0.1) for i in range(depth)}
  inputs = jnp.ones((8, 16))

  def loss_fn(params, inputs):
    for i in range(depth):
      inputs = jnp.tanh(inputs @ params[f"w{i}"])
    return jnp.sum(inputs**2)

  make, protocol, _ = CONTENDERS[name]
  tx = make(optax.adam(LR))

  def step(params, opt_state):
    loss, grads = jax.value_and_grad(loss_fn)(params, inputs)
    if protocol == "grad_fn":
      grad_fn = lambda p, _: jax.grad(loss_fn)(p, inputs)
      updates, opt_state = tx.update(grads, opt_state, params, grad_fn=grad_fn)
    else:
      closed = lambda p: loss_fn(p, inputs)
      updates, opt_state = tx.update(grads, opt_state, params, loss_fn=closed, value=loss)
    return optax.apply_updates(params, updates), opt_state

  return step, (params, tx.init(params))


def depth_scaling(depths: list[int]) -> list[dict]:
  """Compile seconds and HLO instructions of gsam and ``optax.contrib.sam`` by MLP depth."""
  rows = []
  for depth in depths:
    for name in ("optax.contrib.sam", "gsam"):
      step, args = _deep_mlp_step(name, depth)
      lowered = jax.jit(step).lower(*args)
      start = time.perf_counter()
      compiled = lowered.compile()
      seconds = time.perf_counter() - start
      count = sum(opcode_counts(compiled.as_text()).values())
      rows.append(
        {"depth": depth, "contender": name, "compile_seconds": seconds, "hlo_instructions": count}
      )
      print(f"  depth {depth} {name}: {count} instructions, {seconds:.2f} s", flush=True)
  return rows


def targets(rows: list[dict]) -> list[dict]:
  by_name = {r["contender"]: r for r in rows}
  reference = by_name.get("optax.contrib.sam")
  found = []
  for name, limit in (("gsam", 1.2), ("gsam every-5 (cond)", 1.5)):
    if reference is None or name not in by_name:
      continue
    ratio = by_name[name]["compile_seconds"] / reference["compile_seconds"]
    found.append(
      {"contender": name, "ratio_to_contrib_sam": ratio, "limit": limit, "met": ratio <= limit}
    )
  return found


def print_table(rows: list[dict]) -> None:
  base = rows[0]
  print(
    "contender | trace s | compile s | HLO instructions | top extra opcodes vs " + base["contender"]
  )
  for r in rows:
    extra = collections.Counter(r["opcodes"])
    extra.subtract(base["opcodes"])
    top = ", ".join(f"{op} +{n}" for op, n in extra.most_common(4) if n > 0)
    print(
      f"{r['contender']} | {r['trace_seconds']:.2f} | {r['compile_seconds']:.2f} | "
      f"{r['hlo_instructions']} | {top}"
    )


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--batch", type=int, default=128)
  parser.add_argument("--contenders", nargs="*", default=list(CONTENDERS))
  parser.add_argument("--depths", nargs="*", type=int, default=[10, 40, 100])
  parser.add_argument("--out", default=str(RESULTS / "compile_time.json"))
  args = parser.parse_args(argv)
  rows = run(args.contenders, args.rounds, args.batch)
  print_table(rows)
  result = {"batch": args.batch, "rounds": args.rounds, "rows": rows, "targets": targets(rows)}
  result["depth_scaling"] = depth_scaling(args.depths)
  for t in result["targets"]:
    status = "met" if t["met"] else "MISSED"
    print(f"{t['contender']}: {t['ratio_to_contrib_sam']:.2f}x optax.contrib.sam's compile time "
          f"(target <= {t['limit']}x): {status}")  # fmt: skip
  pathlib.Path(args.out).write_text(json.dumps(result, indent=2))
  return result


if __name__ == "__main__":
  main()
