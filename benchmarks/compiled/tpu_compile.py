"""GSAM's ViT-B/32 step compiled by the TPU compiler for a v3-64, with no TPU attached.

With libtpu installed (``pip install -e ".[tpu-compile]"``), JAX compiles ahead
of time for a described TPU topology
(``jax.experimental.topologies.get_topology_desc``) on a CPU-only host. This
script builds the GSAM paper's ViT-B/32 (patch 32, width 768, 12 blocks of 12
heads, MLP 3072, 224x224 images, 1000 classes, global-average-pool head) and,
for every contender, the per-device data-parallel train step under
``optax_gsam.data_parallel`` with params and optimizer state donated, at 64
images per core (global batch 4096 on the 64 cores of a v3-64), with float32
and with bfloat16 activations (params and optimizer state stay float32). It
lowers each step with ``ShapeDtypeStruct``s, compiles it for the topology and
reads, per core, what the TPU compiler reports:

* ``memory_analysis()``: argument, output, alias, temp and generated-code
  bytes. ``peak = argument + output - alias + temp + generated code`` (donated
  outputs reuse their argument's buffer, so aliased bytes are counted once);
  ``fits`` compares it with the 16 GiB of HBM of a v3 core;
* ``cost_analysis()``: ``flops``, ``bytes accessed`` and ``optimal_seconds``,
  the TPU cost model's estimate of the step's run time on one core;
* the collectives in the compiled HLO text, by kind, with their count and the
  bytes of their results (a tuple all-reduce counts once, with all its parts).

Contenders (base optimizer AdamW everywhere): ``adamw``; ``sam``; ``gsam``
(per-device perturbation, the paper's setting); ``gsam sync``; GSAM with
``policy=every_k_policy(5)`` as its two static programs (``update(..., perturb=True)``
and ``perturb=False``) and as the ``lax.cond`` program;
``gradient_norm_policy``'s cheap step; ``momentum_sam``; ``optax.contrib.sam``
(opaque mode, per-device adversary, averaged perturbed gradient); and
``plain gsam``, a GSAM step written in this file from the paper's formulas
(per-device perturbation, one pmean of the final gradient), the reference the
package is held to.

    python -m benchmarks.compiled.sharded --replicated                 # v3-64, ViT-B/32, f32 and bf16
    python -m benchmarks.compiled.sharded --replicated --quick         # small ViT for a v3-8, under a minute
    python -m benchmarks.compiled.sharded --replicated --contenders adamw gsam --dtypes bf16

Writes ``benchmarks/results/tpu_compile.json`` (``tpu_compile_quick.json``
with ``--quick``).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

from benchmarks.compiled import aot_env  # noqa: F401 (set before jax is imported)

# isort: split
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.sharding import SingleDeviceSharding

import optax_gsam

from benchmarks.baselines import contrib_sam
from benchmarks.baselines import plain_gsam_gradient
from benchmarks.compiled.hlo import HBM_BYTES
from benchmarks.compiled.hlo import analyse
from benchmarks.compiled.hlo import collectives as collectives  # re-exported for the tests
from benchmarks.compiled.hlo import out_of_memory
from benchmarks.compiled.search import (
  MAX_PROBE_BATCH as MAX_PROBE_BATCH,  # re-exported for the tests
)
from benchmarks.compiled.search import fits
from benchmarks.compiled.search import format_max_batch_table as format_max_batch_table
from benchmarks.compiled.search import format_microbatch_table
from benchmarks.compiled.search import largest_batch
from benchmarks.compiled.search import microbatch_targets
from benchmarks.compiled.tpu_report import format_table
from benchmarks.compiled.tpu_report import targets
from benchmarks.compiled.vit import VIT_B32
from benchmarks.compiled.vit import VIT_QUICK
from benchmarks.compiled.vit import ViT
from benchmarks.compiled.vit import ViTConfig
from benchmarks.reporting import check
from benchmarks.reporting import code_version
from benchmarks.reporting import libtpu_version
from benchmarks.reporting import write_json

AXIS = "data"
COMMAND = "python -m benchmarks.compiled.sharded --replicated"  # the harness runs this program
RESULTS = pathlib.Path(__file__).resolve().parents[1] / "results"
GiB = 2**30
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}
# name -> (topology_name, chips_per_host_bounds, TPU_ACCELERATOR_TYPE)
TOPOLOGIES = {
  "v3-8": ("v3:2x2", (2, 2, 1), "v3-8"),
  "v3-64": ("v3:4x8", (2, 2, 1), "v3-64"),
}


QUICK_CONTENDERS = ("adamw", "gsam", "gsam sync", "plain gsam")


# ----------------------------------------------------------------------------- contenders


@dataclasses.dataclass(frozen=True)
class HParams:
  lr: float = 1e-3
  weight_decay: float = 1e-4
  rho: float = 0.6  # the GSAM paper's ViT-B/32 values
  alpha: float = 0.4


def _policy_gsam(hp, **kw):
  return optax_gsam.gsam(hp.rho, hp.alpha, axis_name=AXIS, **kw)


@dataclasses.dataclass(frozen=True)
class Contender:
  """How a contender's optimizer is built and its ``update`` called.

  ``protocol``: ``"base"`` (pmean the gradient, plain update), ``"loss_fn"``
  (optax_gsam), ``"grad_fn"`` (``optax.contrib.sam``), ``"plain"`` (the
  formula-written GSAM gradient into the base optimizer), ``"momentum"``
  (``momentum_sam``: no clean pass). ``perturb`` is passed to ``update``.
  """

  make: Callable[[optax.GradientTransformation, HParams], optax.GradientTransformation]
  protocol: str = "loss_fn"
  perturb: bool | None = None
  microbatches: int = 1  # the ``"scan"`` protocol's (AdamW accumulated in a lax.scan)


CONTENDERS = {
  "adamw": Contender(lambda base, hp: base, "base"),
  "gsam": Contender(lambda base, hp: optax.chain(_policy_gsam(hp), base)),
  "plain gsam": Contender(lambda base, hp: base, "plain"),
  "optax.contrib.sam": Contender(lambda base, hp: contrib_sam(base, hp.rho), "grad_fn"),
  "gsam sync": Contender(
    lambda base, hp: optax.chain(_policy_gsam(hp, sync_perturbation=True), base)
  ),
  "gsam k=5 full": Contender(
    lambda base, hp: optax.chain(_policy_gsam(hp, policy=optax_gsam.every_k_policy(5)), base),
    perturb=True,
  ),
  "gsam k=5 cheap": Contender(
    lambda base, hp: optax.chain(_policy_gsam(hp, policy=optax_gsam.every_k_policy(5)), base),
    perturb=False,
  ),
  "sam": Contender(lambda base, hp: optax.chain(optax_gsam.sam(hp.rho, axis_name=AXIS), base)),
  "sam diagnostics=False": Contender(
    lambda base, hp: optax.chain(optax_gsam.sam(hp.rho, axis_name=AXIS, diagnostics=False), base)
  ),
  "gsam k=5 cond": Contender(
    lambda base, hp: optax.chain(_policy_gsam(hp, policy=optax_gsam.every_k_policy(5)), base)
  ),
  "gnorm cheap": Contender(
    lambda base, hp: optax.chain(
      _policy_gsam(hp, policy=optax_gsam.gradient_norm_policy(0.0)), base
    ),
    perturb=False,
  ),
  "momentum_sam": Contender(
    lambda base, hp: optax.chain(optax_gsam.momentum_sam(hp.rho, 0.9, axis_name=AXIS), base),
    "momentum",
  ),
}


def microbatch_contender(k: int, semantics: str = "whole", method: str = "gsam") -> Contender:
  """Per-device ``method`` over ``k`` micro-batches of each core's batch.

  ``method``: a key of ``MICROBATCH_METHODS``, the transform's options, or
  ``"adamw scan"``: AdamW with the gradient accumulated over the micro-batches
  in a ``lax.scan`` written here, the baseline. ``semantics``: ``"whole"``
  (``update(None, ...)``: the transform accumulates the clean gradient too, one
  micro-batch's activations live), ``"each"`` (``perturb_each_microbatch=True``)
  or ``"given"`` (whole batch, the caller's whole-batch clean gradient passed:
  the whole batch's activations live).
  """
  if method == MICROBATCH_BASELINE:
    return Contender(lambda base, hp: base, "scan", microbatches=k)
  factory, options = MICROBATCH_METHODS[method]
  each = semantics == "each"
  make = lambda base, hp: optax.chain(
    factory(hp)(microbatches=k, perturb_each_microbatch=each, **options), base
  )
  return Contender(make, "microbatch given" if semantics == "given" else "microbatch")


# name -> (hparams -> the transform's factory, its options)
MICROBATCH_METHODS = {
  "gsam": (lambda hp: lambda **kw: _policy_gsam(hp, **kw), {}),
  "sam": (lambda hp: lambda **kw: optax_gsam.sam(hp.rho, axis_name=AXIS, **kw), {}),
  "sam diagnostics=False": (
    lambda hp: lambda **kw: optax_gsam.sam(hp.rho, axis_name=AXIS, **kw),
    {"diagnostics": False},
  ),
}
MICROBATCH_BASELINE = "adamw scan"
MICROBATCH_SEMANTICS = {"whole": "", "each": " each", "given": " given"}
MICROBATCHES = 8  # the --max-batch contenders' micro-batch count
CONTENDERS.update(
  {f"gsam mb={MICROBATCHES}{tail}": microbatch_contender(MICROBATCHES, s)
   for s, tail in MICROBATCH_SEMANTICS.items()}
)  # fmt: skip


def make_step(model, contender: Contender, hp: HParams):
  """(tx, per-device step(params, opt_state, (images, labels)) -> (params, opt_state, loss))."""
  tx = contender.make(optax.adamw(hp.lr, weight_decay=hp.weight_decay), hp)

  def step(params, opt_state, batch):
    images, labels = batch

    def loss_of(p, images, labels):
      logits = model.apply({"params": p}, images)
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    loss_fn = lambda p: loss_of(p, images, labels)
    mb_loss = lambda p, microbatch: loss_of(p, *microbatch)  # micro-batched contenders

    if contender.protocol == "microbatch":  # The transform takes the clean gradient too.
      updates, opt_state = tx.update(None, opt_state, params, loss_fn=mb_loss, batch=batch)
      gsam_state = opt_state[0]  # The clean loss, without another pass:
      loss = gsam_state.perturbed_loss - gsam_state.surrogate_gap
      return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, AXIS)
    if contender.protocol == "scan":  # The baseline: a lax.scan over the micro-batches.
      k = contender.microbatches
      pieces = jax.tree.map(lambda a: a.reshape(k, -1, *a.shape[1:]), batch)
      grad_of = jax.value_and_grad(loss_of)
      add = lambda total, piece: (jax.tree.map(jnp.add, total, grad_of(params, *piece)), None)
      zeros = (jnp.zeros([]), jax.tree.map(jnp.zeros_like, params))
      (loss, grads), _ = jax.lax.scan(add, zeros, pieces)
      grads = jax.tree.map(lambda g: g / k, grads)
      updates, opt_state = tx.update(jax.lax.pmean(grads, AXIS), opt_state, params)
      return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss / k, AXIS)
    if contender.protocol == "momentum":  # One gradient, at the perturbed weights.
      zeros = optax.tree.zeros_like(params)
      updates, opt_state = tx.update(zeros, opt_state, params, loss_fn=loss_fn)
      return optax.apply_updates(params, updates), opt_state
    loss, grads = jax.value_and_grad(loss_fn)(params)
    if contender.protocol == "base":
      updates, opt_state = tx.update(jax.lax.pmean(grads, AXIS), opt_state, params)
    elif contender.protocol == "plain":
      g = plain_gsam_gradient(loss_fn, params, grads, hp.rho, hp.alpha, AXIS)
      updates, opt_state = tx.update(g, opt_state, params)
    elif contender.protocol == "grad_fn":
      grad_fn = lambda p, _: jax.lax.pmean(jax.grad(loss_fn)(p), AXIS)
      updates, opt_state = tx.update(grads, opt_state, params, grad_fn=grad_fn)
    elif contender.protocol == "microbatch given":  # The whole batch's clean gradient.
      updates, opt_state = tx.update(
        grads, opt_state, params, loss_fn=mb_loss, batch=batch, value=loss
      )
    else:
      extra = {} if contender.perturb is None else {"perturb": contender.perturb}
      updates, opt_state = tx.update(grads, opt_state, params, loss_fn=loss_fn, value=loss, **extra)
    return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, AXIS)

  return tx, step


# ----------------------------------------------------------------------------- compiling


def tpu_mesh(name: str) -> jax.sharding.Mesh:
  """A 1-D ``data`` mesh over every TensorCore of a described TPU topology."""
  from jax.experimental import topologies

  topology_name, host_bounds, accelerator = TOPOLOGIES[name]
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", accelerator)
  topology = topologies.get_topology_desc(
    platform="tpu",
    topology_name=topology_name,
    chip_config_name="default",
    chips_per_host_bounds=host_bounds,
  )
  return jax.make_mesh((len(topology.devices),), (AXIS,), devices=topology.devices)


def compile_step(mesh, config: ViTConfig, dtype, contender: Contender, per_core: int, hp=HParams()):
  """AOT-compiles one contender's data-parallel step; returns (compiled, param bytes, seconds)."""
  model = ViT(config, dtype)
  tx, step = make_step(model, contender, hp)
  image = jnp.zeros((1, config.image, config.image, 3), jnp.float32)
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), image)["params"])
  opt_state = jax.eval_shape(tx.init, params)
  replicated = NamedSharding(mesh, P())
  spec = lambda tree, sharding: jax.tree.map(
    lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), tree
  )
  global_batch = per_core * mesh.size
  batch = (
    jax.ShapeDtypeStruct((global_batch, config.image, config.image, 3), jnp.float32),
    jax.ShapeDtypeStruct((global_batch,), jnp.int32),
  )
  train_step = optax_gsam.data_parallel(step, mesh, axis_name=AXIS, donate_argnums=(0, 1))
  start = time.perf_counter()
  lowered = train_step.lower(
    spec(params, replicated),
    spec(opt_state, replicated),
    spec(batch, NamedSharding(mesh, P(AXIS))),
  )
  compiled = lowered.compile()
  param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  return compiled, int(param_bytes), time.perf_counter() - start


def probe_batch(mesh, config, dtype, contender, per_core) -> dict[str, Any]:
  """Compiles at one per-core batch: the peak, or the compiler's out-of-memory verdict."""
  try:
    compiled, _, seconds = compile_step(mesh, config, dtype, contender, per_core)
  except Exception as error:  # The TPU compiler raises when the program does not fit.
    refused = out_of_memory(error)
    if refused is None:
      raise
    return {"batch": per_core, "compiles": False, **refused}
  row = analyse(compiled)
  keys = ("peak_bytes", "temp_bytes", "argument_bytes", "output_bytes", "alias_bytes")
  return {"batch": per_core, "compiles": True, **{k: row[k] for k in keys}, "compile_s": seconds}


def max_batch_table(
  mesh, config, names, dtypes, step, save=lambda rows: None, start=64
) -> list[dict]:
  """The largest batch of each contender and dtype; ``save(rows)`` runs after each one."""
  rows: list[dict] = []
  for name in names:
    for dtype in dtypes:
      probe = lambda b, name=name, dtype=dtype: probe_batch(
        mesh, config, DTYPES[dtype], CONTENDERS[name], b
      )
      best, probes = largest_batch(probe, start, step)
      rows.append({"contender": name, "dtype": dtype, "largest_batch": best, "probes": probes})
      print(f"  {dtype} {name}: largest per-core batch {best} ({len(probes)} compiles)", flush=True)
      save(rows)
  return rows


def gradient_cache_table(batches, chunk, tile) -> dict[str, dict[str, Any]]:
  """benchmarks/costs/gradient_cache.py's two-tower CLIP step compiled for one TPU v3 core."""
  from benchmarks.costs import gradient_cache  # the model and the three forms, as on the CPU

  core = tpu_mesh("v3-8").devices.flat[0]
  config = dict(  # gradient_cache.py's configuration
    seq=32, image_features=48, text_features=32, width=64, depth=2, heads=4, mlp=256, out=32
  )
  params, embed, batch_spec = gradient_cache.make_problem(config)
  on_core = lambda tree: jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=SingleDeviceSharding(core)), tree
  )
  table = {}
  for name, fn in gradient_cache.variants(embed, chunk, tile).items():
    table[name] = {}
    for batch in batches:
      try:
        compiled = jax.jit(fn).lower(on_core(params), on_core(batch_spec(batch))).compile()
        memory = compiled.memory_analysis()
        entry = {"temp_bytes": int(memory.temp_size_in_bytes), "compiles": True}
      except Exception as error:
        refused = out_of_memory(error)
        if refused is None:
          raise
        entry = {"compiles": False, **refused}
      table[name][str(batch)] = entry
      temp = entry.get("temp_bytes", entry.get("used_bytes", 0))
      print(f"  {name} batch {batch}: temp {temp / 2**20:.0f} MiB", flush=True)
  return {"config": config, "chunk_size": chunk, "tile_size": tile, "temp": table}


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small ViT for a v3-8")
  parser.add_argument("--topology", choices=list(TOPOLOGIES), default=None)
  parser.add_argument("--per-core-batch", type=int, default=64)
  parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=None)
  parser.add_argument("--contenders", nargs="+", choices=list(CONTENDERS), default=None)
  parser.add_argument(
    "--max-batch", action="store_true", help="largest per-core batch that fits, by bisection"
  )
  parser.add_argument("--batch-step", type=int, default=8, help="--max-batch granularity")
  parser.add_argument("--start-batch", type=int, default=64, help="--max-batch's first probe")
  parser.add_argument(
    "--gradient-cache",
    action="store_true",
    help="gradient_cache.py's CLIP step on one v3 core instead",
  )
  parser.add_argument("--cache-batches", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
  parser.add_argument(
    "--microbatches", type=int, nargs="+", default=None,
    help="micro-batched GSAM with each of these counts at --per-core-batch instead",
  )  # fmt: skip
  parser.add_argument(
    "--semantics", nargs="+", choices=list(MICROBATCH_SEMANTICS), default=["whole", "each"]
  )
  parser.add_argument(
    "--methods",
    nargs="+",
    choices=list(MICROBATCH_METHODS),
    default=["gsam"],
    help="with --microbatches: the transforms, each beside the AdamW scan",
  )
  parser.add_argument("--out", type=pathlib.Path, default=None)
  parser.add_argument(
    "--append", action="store_true", help="keep --out's rows of the contenders not compiled"
  )
  args = parser.parse_args(argv)
  args.topology = args.topology or ("v3-8" if args.quick else "v3-64")
  args.config = VIT_QUICK if args.quick else VIT_B32
  args.dtypes = args.dtypes or (["f32"] if args.quick else list(DTYPES))
  default = ("adamw", "sam", "gsam") if args.max_batch else CONTENDERS
  args.contenders = args.contenders or list(QUICK_CONTENDERS if args.quick else default)
  stem = "tpu_compile" + ("_max_batch" if args.max_batch else "")
  stem = "tpu_compile_microbatches" if args.microbatches else stem
  stem = "tpu_compile_gradient_cache" if args.gradient_cache else stem
  args.out = args.out or RESULTS / (stem + ("_quick" if args.quick else "") + ".json")
  return args


def step_table(args, mesh, result) -> None:
  """The per-core figures of every contender at one batch size, into ``result``."""
  rows = result["rows"] = []
  if args.append and args.out.exists():  # Keep the rows of contenders not compiled again.
    redo = {(d, n) for d in args.dtypes for n in args.contenders}
    kept = json.loads(args.out.read_text())["rows"]
    rows.extend(r for r in kept if (r["dtype"], r["contender"]) not in redo)
  for name in args.contenders:  # Contender-major: an interrupted run has both dtypes.
    for dtype in args.dtypes:
      compiled, param_bytes, seconds = compile_step(
        mesh, args.config, DTYPES[dtype], CONTENDERS[name], args.per_core_batch
      )
      row = {"dtype": dtype, "contender": name, "param_bytes": param_bytes, **analyse(compiled)}
      rows.append({**row, "compile_s": seconds})
      print(f"  compiled {dtype} {name} in {seconds:.0f} s", flush=True)
      del compiled
      write_json(args.out, result)  # After every compile, so an interrupted run keeps what it did.
  names = list(CONTENDERS)
  rows.sort(key=lambda r: (r["dtype"] != "f32", names.index(r["contender"])))
  print(format_table(rows))
  checked = targets(rows)
  for what, value, ok in checked:
    print(f"{what}: {value:.4f} -> {'met' if ok else 'MISSED'}")
  result["targets"] = [{"target": w, "value": v, "met": ok} for w, v, ok in checked]


def _probe_with_cost(mesh, config, dtype, contender, per_core) -> dict[str, Any]:
  """``probe_batch``'s verdict at one batch, with the cost analysis's FLOPs when it compiles."""
  try:
    compiled, param_bytes, seconds = compile_step(mesh, config, dtype, contender, per_core)
  except Exception as error:
    refused = out_of_memory(error)
    if refused is None:
      raise
    return {"batch": per_core, "compiles": False, "fits": False, **refused}
  row = analyse(compiled)
  keys = (
    "peak_bytes",
    "temp_bytes",
    "argument_bytes",
    "generated_code_bytes",
    "flops",
    "bytes_accessed",
  )
  found = {"batch": per_core, "compiles": True, **{k: row[k] for k in keys}}
  return {**found, "fits": fits(found), "param_bytes": param_bytes, "compile_s": seconds}


def microbatch_probes(args, mesh, result) -> None:
  """GSAM over each of ``args.microbatches`` at ``--per-core-batch``: peak, FLOPs, or refusal.

  Rows are merged into ``--out`` by (dtype, contender, batch), so that probes
  at several batches, run one at a time, accumulate in one file.
  """
  old = json.loads(args.out.read_text())["rows"] if args.out.exists() else []
  rows = result["rows"] = old
  for dtype in args.dtypes:
    methods = [*args.methods, MICROBATCH_BASELINE]
    for k, method, semantics in itertools.product(args.microbatches, methods, args.semantics):
      if method != MICROBATCH_BASELINE or semantics == "whole":
        name = f"{method} mb={k}{MICROBATCH_SEMANTICS[semantics]}"
        contender = microbatch_contender(k, semantics, method)
        found = _probe_with_cost(mesh, args.config, DTYPES[dtype], contender, args.per_core_batch)
        key = (dtype, name, args.per_core_batch)
        rows[:] = [r for r in rows if (r["dtype"], r["contender"], r["batch"]) != key]
        rows.append({"dtype": dtype, "contender": name, "microbatches": k, **found})
        peak = found.get("peak_bytes", found.get("used_bytes", 0)) / GiB
        print(f"  {dtype} {name} at {args.per_core_batch}: peak {peak:.3f} GiB", flush=True)
        write_json(args.out, result)
  print(format_microbatch_table(rows))
  result["targets"] = [check(*t) for t in microbatch_targets(rows, MICROBATCH_BASELINE)]


def main(argv: list[str] | None = None) -> dict:
  args = parse_args(argv)
  result = {
    "command": " ".join([COMMAND, *(sys.argv[1:] if argv is None else argv)]),
    "code": code_version(),
    "jax": jax.__version__,
    "libtpu": libtpu_version(),
  }
  if args.gradient_cache:
    result.update(gradient_cache_table(args.cache_batches, 128, 128))
    write_json(args.out, result)
    print(f"wrote {args.out}")
    return result
  mesh = tpu_mesh(args.topology)
  print(f"{args.topology}: {mesh.size} TPU cores, {args.config}")
  result.update(
    topology=args.topology,
    cores=mesh.size,
    model=dataclasses.asdict(args.config),
    hparams=dataclasses.asdict(HParams()),
    peak_formula="argument + output - alias + temp + generated_code (bytes per core)",
    hbm_bytes=HBM_BYTES,
  )
  if args.microbatches:
    microbatch_probes(args, mesh, result)
  elif args.max_batch:
    result["batch_step"] = args.batch_step
    result["rows"] = max_batch_table(
      mesh, args.config, args.contenders, args.dtypes, args.batch_step,
      save=lambda rows: write_json(args.out, {**result, "rows": rows}), start=args.start_batch,
    )  # fmt: skip
    print(format_max_batch_table(result["rows"], args.batch_step))
  else:
    result.update(per_core_batch=args.per_core_batch, time_estimate_key="optimal_seconds")
    step_table(args, mesh, result)
  write_json(args.out, result)
  print(f"wrote {args.out}")
  return result


if __name__ == "__main__":
  main()
