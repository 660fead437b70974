"""What the sharded harness compiles: its contenders' steps, the meshes and the FSDP layout.

``sharded.py`` (the command line, the report) compiles these: every contender's step over a
``data`` mesh of a described TPU topology (v4-8, v4-64) or GPU host (8xh100, jax's CUDA plugin),
params, optimizer state and batch sharded by :func:`fsdp_spec` (FSDP), in Auto axes; with
``tp > 1`` a ``data x model`` mesh, each weight's largest dimension over ``model`` (tensor
parallelism) and the next over ``data``.
"""

from __future__ import annotations

import os
import time

from benchmarks.compiled import aot_env  # noqa: F401 (set before jax is imported)

# isort: split
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_gsam

from benchmarks.baselines import contrib_sam
from benchmarks.compiled import gpu_target
from benchmarks.compiled import mlp
from benchmarks.compiled.decoder import Decoder
from benchmarks.compiled.decoder import next_token_loss
from benchmarks.compiled.decoder import param_count
from benchmarks.compiled.hlo import analyse
from benchmarks.compiled.mlp import MLPConfig
from benchmarks.compiled.vit import ScannedViT
from benchmarks.compiled.vit import ViTConfig

AXIS = "data"
MODEL = "model"  # the tensor-parallel axis of an FSDP x TP mesh
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}
# name -> (topology_name, TPU_ACCELERATOR_TYPE); "default" chips: one device per TensorCore.
TOPOLOGIES = {"v4-8": ("v4:2x2x1", "v4-8"), "v4-64": ("v4:4x4x2", "v4-64")}
# name -> (GPU target, GPUs): one host, described to jax's CUDA plugin (gpu_target.py).
GPU_TOPOLOGIES = {"8xh100": ("h100", 8)}
RHO, ALPHA, LR, WEIGHT_DECAY = 0.05, 0.3, 1e-4, 0.1


# ----------------------------------------------------------------------------- contenders


def plain_gsam(loss_fn, params, g_c, alpha):
  """GSAM from the paper's formulas, nothing else: e = rho g_c / |g_c|, g_p at w + e,
  g = g_p - alpha (g_c - <g_c, g_p> / |g_p|^2 g_p). ``alpha=None``: SAM (g = g_p)."""
  dot = lambda a, b: sum(
    jnp.vdot(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  )
  scale = RHO / jnp.sqrt(dot(g_c, g_c))
  g_p = jax.grad(loss_fn)(jax.tree.map(lambda w, g: w + scale * g, params, g_c))
  if alpha is None:
    return g_p
  projection = dot(g_c, g_p) / dot(g_p, g_p)
  return jax.tree.map(lambda gp, gc: gp - alpha * (gc - projection * gp), g_p, g_c)


def _chain(transform):
  return lambda base: optax.chain(transform, base)


# name -> (optimizer from the base AdamW, protocol, perturb=). Protocols: "base" (the clean
# gradient into AdamW), "loss_fn" (optax_gsam with the clean gradient), "grad_fn"
# (optax.contrib.sam), "batch" (micro-batches: update(None, batch=)), "closed" (momentum_sam:
# no clean pass), "plain" / "plain sam" (the formulas above into AdamW).
CONTENDERS = {
  "adamw": (lambda base: base, "base", None),
  "gsam": (_chain(optax_gsam.gsam(RHO, ALPHA)), "loss_fn", None),
  "sam": (_chain(optax_gsam.sam(RHO)), "loss_fn", None),
  "optax.contrib.sam": (lambda base: contrib_sam(base, RHO), "grad_fn", None),
  "momentum_sam": (_chain(optax_gsam.momentum_sam(RHO)), "closed", None),
  "gsam mb=4": (_chain(optax_gsam.gsam(RHO, ALPHA, microbatches=4)), "batch", None),
  "adamw mb=4": (lambda base: base, "base mb=4", None),
  "gsam every-5": (
    _chain(optax_gsam.gsam(RHO, ALPHA, policy=optax_gsam.every_k_policy(5))),
    "loss_fn",
    None,
  ),
  "gsam every-5 static": (
    _chain(optax_gsam.gsam(RHO, ALPHA, policy=optax_gsam.every_k_policy(5))),
    "loss_fn",
    True,
  ),
  "sam diagnostics=False": (_chain(optax_gsam.sam(RHO, diagnostics=False)), "loss_fn", None),
  "gsam perturb=True": (_chain(optax_gsam.gsam(RHO, ALPHA)), "loss_fn", True),
  "plain gsam": (lambda base: base, "plain", None),
  "plain sam": (lambda base: base, "plain sam", None),
}
MAIN_CONTENDERS = ("adamw", "gsam", "sam", "optax.contrib.sam", "momentum_sam", "gsam mb=4",
                   "adamw mb=4", "gsam every-5")  # fmt: skip
FULL_ORDER = ("adamw", "gsam", "optax.contrib.sam", "sam", "sam diagnostics=False", "plain gsam",
              "momentum_sam", "gsam mb=4", "adamw mb=4", "gsam every-5", "gsam every-5 static",
              "plain sam")  # fmt: skip


def make_step(name: str, loss_of):
  """(tx, step(params, opt_state, tokens) -> (params, opt_state)); ``loss_of(params, tokens)``."""
  make, protocol, perturb = CONTENDERS[name]
  tx = make(optax.adamw(LR, weight_decay=WEIGHT_DECAY))

  def step(params, opt_state, tokens):
    closed = lambda p: loss_of(p, tokens)
    if protocol == "base mb=4":  # the clean gradient accumulated in a lax.scan, as AdamW's users do
      updates, opt_state = tx.update(_scanned_grad(loss_of, params, tokens, 4), opt_state, params)
    elif protocol == "batch":
      updates, opt_state = tx.update(None, opt_state, params, loss_fn=loss_of, batch=tokens)
    elif protocol == "closed":
      updates, opt_state = tx.update(None, opt_state, params, loss_fn=closed)
    elif protocol == "grad_fn":
      grads = jax.grad(closed)(params)
      grad_fn = lambda p, _: jax.grad(closed)(p)
      updates, opt_state = tx.update(grads, opt_state, params, grad_fn=grad_fn)
    else:
      loss, grads = jax.value_and_grad(closed)(params)
      kwargs = {}
      if protocol.startswith("loss_fn"):
        kwargs = {"loss_fn": closed, "value": loss}
        kwargs.update({} if perturb is None else {"perturb": perturb})
      elif protocol.startswith("plain"):
        grads = plain_gsam(closed, params, grads, None if protocol == "plain sam" else ALPHA)
      updates, opt_state = tx.update(grads, opt_state, params, **kwargs)
    return optax.apply_updates(params, updates), opt_state

  return tx, step


def _scanned_grad(loss_of, params, batch, num_microbatches: int):
  """The mean gradient over ``num_microbatches`` equal row blocks of ``batch``, in a ``lax.scan``."""
  pieces = batch.reshape(num_microbatches, -1, *batch.shape[1:])

  def body(total, piece):
    return jax.tree.map(jnp.add, total, jax.grad(loss_of)(params, piece)), None

  total, _ = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), pieces)
  return jax.tree.map(lambda g: g / num_microbatches, total)


# ----------------------------------------------------------------------------- compiling


def mesh_of(name: str, memory_bytes: int | None = None, tp: int = 1) -> jax.sharding.Mesh:
  """An Auto mesh over every device of a described TPU or GPU topology: ``data`` alone, or
  ``data x model`` with ``tp`` devices along ``model`` (FSDP x TP).

  ``memory_bytes`` replaces a GPU's memory in its target description (the batch search).
  """
  if name in GPU_TOPOLOGIES:
    target, gpus = GPU_TOPOLOGIES[name]
    devices = np.array(gpu_target.gpu_devices(gpu_target.TARGETS[target], gpus, memory_bytes))
  else:
    devices = np.array(tpu_devices(name))
  if tp == 1:
    return jax.sharding.Mesh(devices, (AXIS,))
  if devices.size % tp:
    raise SystemExit(f"--tp {tp} does not divide the {devices.size} devices of {name}")
  return jax.sharding.Mesh(devices.reshape(devices.size // tp, tp), (AXIS, MODEL))


def platform_of(name: str) -> str:
  return "gpu" if name in GPU_TOPOLOGIES else "tpu"


def tpu_devices(name: str) -> list:
  """Every TensorCore of a described TPU topology, one device each."""
  from jax.experimental import topologies

  topology_name, accelerator = TOPOLOGIES[name]
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", accelerator)
  topology = topologies.get_topology_desc(
    platform="tpu",
    topology_name=topology_name,
    chip_config_name="default",
    chips_per_host_bounds=(2, 2, 1),
  )
  # One device per TensorCore (64 on a v4-64), which jax.make_mesh refuses past v3.
  return list(topology.devices)


def fsdp_spec(shape, n: int) -> P:
  """FSDP: the largest dimension that ``n`` divides is sharded over ``data`` (else replicated)."""
  dims = [i for i, d in enumerate(shape) if d % n == 0]
  if not dims:
    return P()
  best = max(dims, key=lambda i: (shape[i], -i))
  return P(*[AXIS if i == best else None for i in range(len(shape))])


def layout_spec(shape, mesh: jax.sharding.Mesh) -> P:
  """:func:`fsdp_spec` on a ``data`` mesh. On ``data x model``, a leaf of 2 or more dimensions
  (a weight, or the scanned blocks' stacked vectors) puts its largest dimension that the model
  axis divides over ``model`` (a feed-forward layer's hidden dimension: column-parallel going
  up, row-parallel coming down) and the largest of the others that the data axis divides over
  ``data``; a vector is sharded over ``data``. A generic layout, not a hand-tuned one: the
  contenders share it, so their collectives compare."""
  if MODEL not in mesh.axis_names:
    return fsdp_spec(shape, mesh.size)
  tp, dp = mesh.shape[MODEL], mesh.shape[AXIS]
  axes: list[str | None] = [None] * len(shape)
  model_dims = [i for i, d in enumerate(shape) if d % tp == 0] if len(shape) >= 2 else []
  if model_dims:
    axes[max(model_dims, key=lambda i: (shape[i], i))] = MODEL
  data_dims = [i for i, d in enumerate(shape) if d % dp == 0 and axes[i] is None]
  if data_dims:
    axes[max(data_dims, key=lambda i: (shape[i], -i))] = AXIS
  return P(*axes)


def fsdp_specs(tree, mesh):
  """``ShapeDtypeStruct``s of ``tree`` (shapes) laid out by :func:`layout_spec`."""
  return jax.tree.map(
    lambda s: jax.ShapeDtypeStruct(
      s.shape, s.dtype, sharding=NamedSharding(mesh, layout_spec(s.shape, mesh))
    ),
    tree,
  )


def problem(config, dtype, constrain, rows: int):
  """(param shapes, ``loss_of(params, batch)``, the batch's shape and dtype) of each model."""
  if isinstance(config, ViTConfig):  # images; the labels are a function of them
    vit = ScannedViT(config, dtype, constrain)
    images = jnp.zeros((1, config.image, config.image, 3), jnp.float32)
    params = jax.eval_shape(lambda: vit.init(jax.random.key(0), images)["params"])

    def vit_loss(p, images):
      logits = vit.apply({"params": p}, constrain(images))
      labels = (images[:, 0, 0, 0] > 0).astype(jnp.int32)
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    return params, vit_loss, ((rows, config.image, config.image, 3), jnp.float32)
  if isinstance(config, MLPConfig):
    params = jax.eval_shape(lambda: mlp.init(config, jax.random.key(0)))
    loss_of = lambda p, inputs: mlp.loss(p, constrain(inputs), dtype, constrain)
    return params, loss_of, ((rows, config.width), jnp.float32)
  model = Decoder(config, dtype, constrain)
  tokens = jnp.zeros((1, config.seq), jnp.int32)
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens)["params"])
  loss_of = lambda p, tokens: next_token_loss(model, p, constrain(tokens))
  return params, loss_of, ((rows, config.seq), jnp.int32)


def build(mesh, config, dtype, name: str, per_core: int):
  """(jitted step, its argument specs, param count) of one contender on ``mesh``."""
  batch_sharding = NamedSharding(mesh, P(AXIS))
  constrain = lambda x: jax.lax.with_sharding_constraint(x, batch_sharding)
  params, loss_of, (batch_shape, batch_dtype) = problem(
    config, dtype, constrain, per_core * mesh.size
  )
  params = fsdp_specs(params, mesh)
  shardings = lambda tree: jax.tree.map(lambda s: s.sharding, tree)
  tx, step = make_step(name, loss_of)
  opt_state = fsdp_specs(jax.eval_shape(tx.init, params), mesh)
  batch = jax.ShapeDtypeStruct(batch_shape, batch_dtype, sharding=batch_sharding)
  jitted = jax.jit(
    step,
    in_shardings=(shardings(params), shardings(opt_state), batch_sharding),
    out_shardings=(shardings(params), shardings(opt_state)),
    donate_argnums=(0, 1),
  )
  return jitted, (params, opt_state, batch), param_count(params)


def compile_row(mesh, config, dtype: str, name: str, per_core: int) -> tuple[dict, object]:
  """Lowers and compiles one contender; its row of figures and the compiled program."""
  jitted, args, n_params = build(mesh, config, DTYPES[dtype], name, per_core)
  start = time.perf_counter()
  with jax.set_mesh(mesh):
    lowered = jitted.lower(*args)
  trace_s = time.perf_counter() - start
  start, cpu = time.perf_counter(), time.process_time()
  compiled = lowered.compile()
  compile_s, compile_cpu_s = time.perf_counter() - start, time.process_time() - cpu
  row = {"dtype": dtype, "contender": name, "params": n_params, **analyse(compiled)}
  row.update(
    param_bytes=4 * n_params,
    param_bytes_per_core=_per_core_bytes(args[0]),
    trace_s=trace_s,
    compile_s=compile_s,
    compile_cpu_s=compile_cpu_s,  # this process's CPU seconds: steadier on a shared machine
  )
  row.pop("conditionals", None)
  return row, compiled


def _per_core_bytes(tree) -> int:
  """Bytes of one core's shards of ``tree``."""
  total = 0
  for s in jax.tree.leaves(tree):
    shard = s.sharding.shard_shape(s.shape)
    total += s.dtype.itemsize * int(jnp.prod(jnp.array(shard))) if shard else s.dtype.itemsize
  return total
