"""Micro-batched GSAM: time per example and compiled memory against the number of micro-batches.

At a fixed global batch, a tanh MLP's GSAM step is compiled and timed as

* ``whole``: the usual step, the clean gradient of the whole batch from the caller;
* ``k=K``: ``gsam(..., microbatches=K)`` with ``update(None, ...)``, both passes accumulated
  over K micro-batches (whole-batch semantics);
* ``k=K each``: ``perturb_each_microbatch=True`` (one perturbation per micro-batch);
* ``base``: the AdamW step without GSAM, for the time in base steps.

Times are medians of paired interleaved rounds, as ratios to ``whole`` in the same process;
compiled ``temp_size_in_bytes`` is deterministic. (XLA's CPU cost analysis counts a loop body
once, whatever its trip count, so FLOPs of the scanned steps are not comparable and not shown.)

    python -m benchmarks.costs.microbatches            # global batch 2048, K in 1 2 4 8 16, 15 rounds
    python -m benchmarks.costs.microbatches --quick    # global batch 512, K in 2 4, 3 rounds
    python -m benchmarks.costs.microbatches --memory   # compiled temp memory only (no timing), K in
                                                 # 2 4 8, then K=4 at micro-batches 16 64 256

``--memory`` compares compiled ``temp_size_in_bytes`` at the same micro-batch size: the
micro-batched GSAM, SAM and SAM ``diagnostics=False`` steps against AdamW with its gradient
accumulated in a ``lax.scan``, in parameter-sized buffers over it (targets: at most 2, 2 and 1),
and the clean pass alone as :func:`optax_gsam.accumulate_value_and_grad` (a ``lax.scan``) against
``optax.microbatching.microbatch`` (a ``fori_loop`` over a reshaped batch) with a MEAN accumulator.

Writes ``results/microbatches[_quick].json``; targets and results in benchmarks/README.md.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_gsam

from benchmarks import harness

RHO, ALPHA, LR = 0.05, 0.3, 1e-3
WIDTH, FEATURES, CLASSES = 512, 64, 10


def make_problem(batch_size: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  dims = [FEATURES, WIDTH, WIDTH, CLASSES]
  params = {
    f"w{i}": jnp.asarray(rng.normal(size=(a, b)) / np.sqrt(a), jnp.float32)
    for i, (a, b) in enumerate(itertools.pairwise(dims))
  }
  x = jnp.asarray(rng.normal(size=(batch_size, FEATURES)), jnp.float32)
  y = jnp.asarray(rng.integers(0, CLASSES, size=batch_size), jnp.int32)
  return params, (x, y)


def loss_fn(params, batch):
  x, y = batch
  h = x
  for i in range(len(params) - 1):
    h = jnp.tanh(h @ params[f"w{i}"])
  logits = h @ params[f"w{len(params) - 1}"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def make_step(name: str, method: str = "gsam", **options):
  """``(params, opt_state, batch) -> (params, opt_state)`` for one contender.

  ``method``: ``"gsam"`` or ``"sam"``; ``options`` go to it.
  """
  if name == "base":
    tx = optax.adamw(LR)
  else:
    if name.startswith("k="):
      options["microbatches"] = int(name.split()[0][2:])
      options["perturb_each_microbatch"] = name.endswith("each")
    transform = optax_gsam.gsam(RHO, ALPHA, **options) if method == "gsam" else None
    transform = transform or optax_gsam.sam(RHO, **options)
    tx = optax.chain(transform, optax.adamw(LR))

  def step(params, opt_state, batch):
    if name.startswith("k="):
      updates, opt_state = tx.update(None, opt_state, params, loss_fn=loss_fn, batch=batch)
    else:
      grads = jax.grad(loss_fn)(params, batch)
      whole_loss = lambda p: loss_fn(p, batch)
      updates, opt_state = tx.update(grads, opt_state, params, loss_fn=whole_loss)
    return optax.apply_updates(params, updates), opt_state

  return tx, step


def scanned_adamw_step(num_microbatches: int):
  """AdamW with the gradient accumulated over ``num_microbatches`` in a ``lax.scan``."""
  tx = optax.adamw(LR)

  def step(params, opt_state, batch):
    pieces = jax.tree.map(lambda a: a.reshape(num_microbatches, -1, *a.shape[1:]), batch)

    def body(total, piece):
      grads = jax.grad(loss_fn)(params, piece)
      return jax.tree.map(jnp.add, total, grads), None

    total, _ = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), pieces)
    grads = jax.tree.map(lambda g: g / num_microbatches, total)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return tx, step


def clean_pass(kind: str, num_microbatches: int, batch_size: int):
  """The clean pass alone: ``params, batch -> (loss, grads)``, ours or optax.microbatching's."""
  if kind == "ours":
    return lambda params, batch: optax_gsam.accumulate_value_and_grad(
      loss_fn, params, batch, microbatches=num_microbatches
    )
  return optax.microbatching.microbatch(
    jax.value_and_grad(loss_fn),
    argnums=1,
    microbatch_size=batch_size // num_microbatches,
    accumulator=optax.microbatching.AccumulationType.MEAN,
  )


def temp_bytes(fn, *args) -> int:
  return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


# Micro-batched step -> (how it is built, the parameter-sized buffers it may hold over AdamW's).
MEMORY_CONTENDERS = {
  "gsam": (("gsam", {}), 2),  # the perturbed weights, the perturbed gradient's sum beside g_c
  "sam": (("sam", {}), 2),  # the diagnostics read g_c after the perturbed pass
  "sam diagnostics=False": (("sam", {"diagnostics": False}), 1),  # the perturbed weights
}


def measure_memory(cases: list[tuple[int, int]]) -> dict:
  """Compiled temp MiB per contender for each (k, global batch), and the targets' verdicts."""
  rows: dict[str, dict[str, float]] = {}
  checks = []
  param_mib = 0.0
  for k, batch_size in cases:
    params, batch = make_problem(batch_size)
    param_mib = sum(x.nbytes for x in jax.tree.leaves(params)) / 2**20
    adamw_tx, adamw_step = scanned_adamw_step(k)
    adamw = temp_bytes(adamw_step, params, adamw_tx.init(params), batch) / 2**20
    row = {"microbatch_size": batch_size // k, "adamw_scan_MiB": adamw}
    label = f"k={k} micro={batch_size // k}"
    for name, ((method, options), allowed) in MEMORY_CONTENDERS.items():
      tx, step = make_step(f"k={k}", method, **options)
      mib = temp_bytes(step, params, tx.init(params), batch) / 2**20
      extra = (mib - adamw) / param_mib
      row[f"{name}_MiB"], row[f"{name}_extra_params"] = mib, extra
      # Counted to 1% of a buffer: the state's scalars and the batch's index vectors add bytes.
      what = f"{label} {name}: params-sized buffers over AdamW scan <= {allowed} (to 1%)"
      checks.append(harness.check(what, extra, extra <= allowed + 0.01))
    row["clean_scan_MiB"] = temp_bytes(clean_pass("ours", k, batch_size), params, batch) / 2**20
    row["clean_optax_MiB"] = temp_bytes(clean_pass("optax", k, batch_size), params, batch) / 2**20
    rows[label] = row
  return {"param_MiB": param_mib, "rows": rows, "checks": checks}


def memory_table(rows: dict) -> str:
  names = list(MEMORY_CONTENDERS)
  cells = [
    (
      "k, micro-batch",
      "AdamW scan",
      *[f"{n} (+params)" for n in names],
      "clean: scan",
      "clean: optax",
    )
  ]
  for label, row in rows.items():
    found = [f"{row[f'{n}_MiB']:.2f} (+{row[f'{n}_extra_params']:.2f})" for n in names]
    cells.append(
      (
        label,
        f"{row['adamw_scan_MiB']:.2f}",
        *found,
        f"{row['clean_scan_MiB']:.2f}",
        f"{row['clean_optax_MiB']:.2f}",
      )
    )
  return harness.render_table(cells)


def compile_contender(name: str, params, batch) -> tuple[harness.Timed, dict]:
  tx, step = make_step(name)
  opt_state = tx.init(params)
  compiled = jax.jit(step).lower(params, opt_state, batch).compile()
  stats = harness.hlo_stats(compiled) | {
    "temp_bytes": compiled.memory_analysis().temp_size_in_bytes
  }
  timed = harness.Timed((lambda state: compiled(*state, batch),), (params, opt_state), stats)
  timed.run(2)  # warm up
  return timed, stats


def measure(batch_size: int, counts: list[int], rounds: int, steps: int) -> dict:
  params, batch = make_problem(batch_size)
  names = ["base", "whole", *[f"k={k}" for k in counts], *[f"k={k} each" for k in counts]]
  timed, stats = {}, {}
  for name in names:
    timed[name], stats[name] = compile_contender(name, params, batch)
  times = harness.interleaved(timed, "whole", rounds=rounds, steps=steps, paired=True)
  rows = {}
  for name in names:
    rows[name] = {
      "ms": times[name]["ms"],
      "us_per_example": 1e3 * times[name]["ms"] / batch_size,
      "time_vs_whole": times[name]["ratio"],
      "temp_MiB": stats[name]["temp_bytes"] / 2**20,
    }
  return rows


def table(rows: dict) -> str:
  cells = [("step", "ms", "us/example", "time / whole", "temp MiB")]
  for name, row in rows.items():
    cells.append(
      (
        name,
        f"{row['ms']:.2f}",
        f"{row['us_per_example']:.3f}",
        f"{row['time_vs_whole']:.3f}",
        f"{row['temp_MiB']:.2f}",
      )
    )
  return harness.render_table(cells)


def main(argv: list[str] | None = None) -> dict:
  parser = harness.parser(__doc__)
  parser.add_argument("--batch", type=int, default=None)
  parser.add_argument("--rounds", type=int, default=None)
  parser.add_argument("--memory", action="store_true", help="compiled temp memory only")
  args = parser.parse_args(argv)
  batch_size = args.batch or (512 if args.quick else 2048)
  if args.memory:
    # k micro-batches of the global batch, then k = 4 at small micro-batch sizes, where the
    # activations no longer hide a parameter-sized buffer.
    counts = [2] if args.quick else [2, 4, 8]
    sizes = [16] if args.quick else [16, 64, 256]
    cases = [(k, batch_size) for k in counts] + [(4, 4 * size) for size in sizes]
    found = measure_memory(cases)
    print(f"compiled temp MiB, MLP {FEATURES}-{WIDTH}-{WIDTH}-10, AdamW, global batch {batch_size}")
    print(f"and 4 x micro-batch; params {found['param_MiB']:.2f} MiB; (+n): n params-sized")
    print("buffers over AdamW with the gradient summed in a lax.scan")
    print(memory_table(found["rows"]))
    mode = "quick" if args.quick else "full"
    result = {"batch": batch_size, "cases": cases, **found}
    return harness.save("microbatches", mode, result, args.out_dir, argv, suffix="_memory")
  counts = [2, 4] if args.quick else [2, 4, 8, 16]
  rounds = args.rounds or (3 if args.quick else 15)
  rows = measure(batch_size, counts, rounds, steps=2 if args.quick else 5)
  print(f"micro-batched GSAM, global batch {batch_size}, tanh MLP {FEATURES}-{WIDTH}-{WIDTH}-10")
  print(table(rows))
  checks = []
  if 4 in counts:
    ratio = rows["k=4"]["time_vs_whole"]
    checks.append(harness.check("k=4 time per example / whole <= 1.10", ratio, ratio <= 1.10))
  mode = "quick" if args.quick else "full"
  result = {"batch": batch_size, "counts": counts, "rounds": rounds, "rows": rows, "checks": checks}
  return harness.save("microbatches", mode, result, args.out_dir, argv)


if __name__ == "__main__":
  main()
