"""Two-pass steps compiled for a described GPU host (jax's CUDA plugin, no GPU attached).

XLA's GPU compiler once kept a scanned model's saved activations (and its stacked weight
gradients) twice in every two-pass step: the clean and the perturbed pass shared one zero
constant, which it copied before the clean pass. These compiles fail if that comes back:
the activations here are four times the parameters, so one more copy of them breaks every
limit below. They run where the ``gpu-compile`` extra is installed (``.ci/run`` does), and skip
with the reason elsewhere.
"""

import functools
import importlib.util
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_gsam


def _cuda_plugin_installed():
  # jax_plugins is a namespace package that exists only once some plugin is
  # installed: find_spec of its child raises where it is absent.
  try:
    return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
  except ModuleNotFoundError:
    return False


pytestmark = [
  pytest.mark.skipif(
    not _cuda_plugin_installed(),
    reason="jax's CUDA plugin is not installed; "
    "pip install -e '.[gpu-compile]' to compile for a GPU",
  ),
  # conftest.py: an executable compiled for a described GPU (none attached) cannot be loaded back.
  pytest.mark.usefixtures("no_compilation_cache"),
]

BATCH, SEQ, WIDTH, HIDDEN, DEPTH = 64, 256, 512, 2048, 4
PARAM_BYTES = 4 * DEPTH * 2 * WIDTH * HIDDEN  # the stacked layers
ACTIVATION_BYTES = 4 * BATCH * SEQ * WIDTH * DEPTH  # what the scan saves: 4 parameter buffers


def _gpu_devices(count):
  from benchmarks.compiled import gpu_target  # the repository root is on the tests' path

  return gpu_target.gpu_devices(gpu_target.H100_SXM, count)


def _params():
  return {
    "w_in": jax.ShapeDtypeStruct((DEPTH, WIDTH, HIDDEN), jnp.float32),
    "w_out": jax.ShapeDtypeStruct((DEPTH, HIDDEN, WIDTH), jnp.float32),
    "head": jax.ShapeDtypeStruct((WIDTH, 8), jnp.float32),
  }


def _loss(params, x):
  """Residual blocks in one rematerialized scan, as big_vision and MaxText lay them out."""

  def block(h, w):
    return h + jnp.tanh(h @ w[0]) @ w[1], None

  h, _ = jax.lax.scan(jax.checkpoint(block), x, (params["w_in"], params["w_out"]))
  return jnp.mean((h.mean(1) @ params["head"]) ** 2)


def _contrib_sam(base):
  return optax.contrib.sam(
    base, optax.chain(optax.contrib.normalize(), optax.sgd(0.05)), sync_period=1
  )


STEPS = {
  "adamw": None,
  "gsam": lambda: optax_gsam.gsam(0.05, 0.3),
  "sam": lambda: optax_gsam.sam(0.05),
  "sam diagnostics=False": lambda: optax_gsam.sam(0.05, diagnostics=False),
  "optax.contrib.sam": "contrib",
}


def _compile(name, sharding, dump):
  base = optax.adamw(1e-3)
  make = STEPS[name]
  tx = (
    base if make is None else _contrib_sam(base) if make == "contrib" else optax.chain(make(), base)
  )

  def step(params, opt_state, x):
    loss_fn = lambda p: _loss(p, x)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    if make is None:
      updates, opt_state = tx.update(grads, opt_state, params)
    elif make == "contrib":
      grad_fn = lambda p, _: jax.grad(loss_fn)(p)
      updates, opt_state = tx.update(grads, opt_state, params, grad_fn=grad_fn)
    else:
      updates, opt_state = tx.update(grads, opt_state, params, loss_fn=loss_fn, value=loss)
    return optax.apply_updates(params, updates), opt_state

  params = jax.tree.map(
    lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding(s)), _params()
  )
  state = jax.tree.map(
    lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding(s)),
    jax.eval_shape(tx.init, params),
  )
  batch = jax.ShapeDtypeStruct((BATCH, SEQ, WIDTH), jnp.float32, sharding=sharding(None))
  lowered = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, batch)
  folder = dump / name.replace(" ", "_").replace("=", "")
  # The Triton GEMM flag per compile too: XLA_FLAGS is read once, when the first backend starts,
  # and another test module may have started the CPU's before gpu_target sets it.
  options = {"xla_dump_to": str(folder), "xla_gpu_enable_triton_gemm": False}
  compiled = lowered.compile(compiler_options=options)
  memory = compiled.memory_analysis()
  peak = (
    memory.argument_size_in_bytes
    + memory.output_size_in_bytes
    - memory.alias_size_in_bytes
    + memory.temp_size_in_bytes
  )
  return {"peak": peak, "live": _live_peak(folder), "hlo": compiled.as_text()}


def _live_peak(folder):
  """The bytes live at the program's peak, from XLA's live-range dump (no heap packing)."""
  from benchmarks.compiled import buffers  # the dump's reader, shared with the TPU

  (path,) = folder.glob("*after_optimizations-live-range.txt")
  return buffers.peak_bytes(path.read_text())


@pytest.fixture(scope="module")
def one_gpu(tmp_path_factory):
  device = _gpu_devices(1)[0]
  sharding = lambda _: jax.sharding.SingleDeviceSharding(device)
  dump = tmp_path_factory.mktemp("one_gpu")
  return {name: _compile(name, sharding, dump) for name in STEPS}


def _over(steps, key, size):
  return {name: (step[key] - steps["adamw"][key]) / size for name, step in steps.items()}


def test_one_gpu_holds_the_maths_need_and_no_second_copy_of_the_activations(one_gpu):
  """Live at the peak: the need exactly. The allocation (memory_analysis) packs those buffers
  with up to one parameter buffer more on this small program; a copy of the activations would
  add four."""
  assert ACTIVATION_BYTES >= 4 * PARAM_BYTES
  live, peak = _over(one_gpu, "live", PARAM_BYTES), _over(one_gpu, "peak", PARAM_BYTES)
  assert live["gsam"] <= 2.001 and live["sam"] <= 2.001, live
  assert live["sam diagnostics=False"] <= 1.001, live
  assert max(peak.values()) <= 3.01, peak
  contrib = one_gpu["optax.contrib.sam"]["live"]  # its scalars aside (1 KiB)
  assert one_gpu["sam diagnostics=False"]["live"] <= contrib + 1024, live
  assert " conditional(" in one_gpu["gsam"]["hlo"]  # the perturbed pass is a branch of its own


def _fsdp(mesh):
  def sharding(shape_struct):
    if shape_struct is None or len(shape_struct.shape) < 2:
      spec = P("data") if shape_struct is None else P()
      return NamedSharding(mesh, spec)
    dims = [i for i, d in enumerate(shape_struct.shape) if d % mesh.size == 0]
    best = max(dims, key=lambda i: shape_struct.shape[i])
    return NamedSharding(
      mesh, P(*["data" if i == best else None for i in range(len(shape_struct.shape))])
    )

  return sharding


def _all_reduce_bytes(hlo):
  from benchmarks.compiled import hlo as compiled_hlo

  return compiled_hlo.collectives(hlo).get("all-reduce", {"bytes": 0})["bytes"]


def test_fsdp_on_eight_gpus_keeps_the_gradients_sharded_and_the_need(tmp_path):
  mesh = jax.sharding.Mesh(np.array(_gpu_devices(8)), ("data",))
  names = ("adamw", "gsam", "optax.contrib.sam")
  steps = {name: _compile(name, _fsdp(mesh), tmp_path) for name in names}
  live = _over(steps, "live", PARAM_BYTES / mesh.size)
  assert live["gsam"] <= 2.001, live
  # Scalars only: an all-reduced gradient (48 MiB on a ViT-L/16) would be parameter-sized.
  contrib = _all_reduce_bytes(steps["optax.contrib.sam"]["hlo"])
  assert _all_reduce_bytes(steps["gsam"]["hlo"]) <= contrib + 1024


@pytest.mark.parametrize("tp", [1, 4], ids=["fsdp", "fsdp x tp"])
def test_vit_l_all_reduces_at_most_two_more_than_optax_contrib_sam(tp):
  """A ViT-L/16, FSDP over 8 GPUs or over a 2 x 4 mesh with TP: the model's own all-reduces (TP's
  partial sums) are the two passes' in every two-pass step; the transform's scalar rounds add at
  most two: the clean gradient's norm, then the perturbed loss and the statistics (FSDP: 3 and 3
  against 1; FSDP x TP: 34 and 34 against 34 in f32; the count does not depend on the batch)."""
  from benchmarks.compiled import hlo as compiled_hlo
  from benchmarks.compiled import sharded_steps
  from benchmarks.compiled.vit import VIT_L16

  mesh = sharded_steps.mesh_of("8xh100", tp=tp)
  count = {
    name: compiled_hlo.collectives(
      sharded_steps.compile_row(mesh, VIT_L16, "f32", name, 2)[1].as_text()
    )["all-reduce"]["count"]
    for name in ("optax.contrib.sam", "gsam", "sam")
  }
  assert count["gsam"] <= count["optax.contrib.sam"] + 2, count
  assert count["sam"] <= count["optax.contrib.sam"] + 2, count


# --- The memory table's met GPU cells, compiled again at full size -------------------------


def _gpu_met_cells():
  from benchmarks.compiled import memory_table

  recorded = json.loads((memory_table.RESULTS / "memory_table.json").read_text())["rows"]
  return [
    (row["model"], row["step"], row["over"], dtype)
    for row in recorded
    if row["model"] in memory_table.GPU_MODELS and not row["step"].endswith("(reference)")
    for dtype in ("f32", "bf16")
    if row.get(dtype, {}).get("met")
  ]


@functools.cache
def _recompiled(model, name, dtype):
  """One step's row compiled now at the model, batch and topology its result file records."""
  from benchmarks.compiled import memory_table
  from benchmarks.compiled import sharded_steps

  result = json.loads((memory_table.RESULTS / memory_table.GPU_MODELS[model][0]).read_text())
  fields = {k: v for k, v in result["model"].items() if k != "name"}
  from benchmarks.compiled import decoder

  config = {"vit": sharded_steps.ViTConfig, "decoder": decoder.DecoderConfig,
            "mlp": sharded_steps.MLPConfig}[result["model"]["name"]](**fields)  # fmt: skip
  mesh = sharded_steps.mesh_of(result["topology"], tp=result.get("tp", 1))
  row, _ = sharded_steps.compile_row(mesh, config, dtype, name, result["per_core_batch"])
  recorded = {(r["contender"], r["dtype"]): r for r in result["rows"]}[name, dtype]
  assert row["argument_bytes"] == recorded["argument_bytes"], name  # the program recorded
  return row


@pytest.mark.gpu_limits
@pytest.mark.parametrize("cell", _gpu_met_cells(), ids=lambda c: " ".join(c))
def test_every_met_gpu_cell_is_still_met(cell):
  """Each GPU cell the recorded memory table marks met, compiled again at full size: a change
  that brings the second copy of the activations (or any held buffer) back fails here."""
  from benchmarks.compiled import memory_table

  model, label, over, dtype = cell
  name, reference, needs = next(
    (name, reference, needs)
    for step_label, name, reference, needs in memory_table.GPU_MODELS[model][1]
    if step_label == label and reference == over
  )
  entry = memory_table.tpu_cell(
    _recompiled(model, name, dtype),
    _recompiled(model, reference, dtype),
    needs,
    memory_table.LIVE_TOLERANCE_BYTES,
  )
  assert entry["met"], (cell, entry)
