"""The pod-path checks, run as one job of 2 processes x 4 CPU devices or in one 8-device process.

Under the launcher (what ``tests/test_multihost.py`` runs)::

    python -m optax_gsam.launch --local-processes 2 --devices-per-process 4 -- \\
      tests/_multihost_worker.py OUT_DIR

every process writes ``OUT_DIR/process_<i>.npz`` with the results of
:func:`run_checks`; the test calls :func:`run_checks` in its own 8-device
process and compares. All inputs are the same on every process (seeded), and
each process hands JAX only its own rows of every batch
(``jax.make_array_from_process_local_data``), as a pod's input pipeline does.

``--crash kill``, ``--crash raise`` or ``--crash exit`` makes process 1 die
(SIGKILL, an uncaught exception, or ``sys.exit(3)``) while process 0 waits in
collectives, which would hang without the launcher.
"""

from __future__ import annotations

import argparse
import functools
import os
import pathlib
import signal
import sys

import numpy as np

STEPS, SAVE_AT = 4, 2
GLOBAL_BATCH = 32  # 4 examples per device on 8 devices
RHO, ALPHA, LR = 0.1, 0.4, 0.05


def problem(seed: int = 0) -> dict[str, np.ndarray]:
  """Inputs of every check, the same on every process."""
  rng = np.random.default_rng(seed)
  return {
    "x": rng.normal(size=(GLOBAL_BATCH, 6)).astype(np.float32),
    "y": rng.normal(size=(GLOBAL_BATCH, 3)).astype(np.float32),
    "w1": (rng.normal(size=(6, 8)) / np.sqrt(6)).astype(np.float32),
    "w2": (rng.normal(size=(8, 3)) / np.sqrt(8)).astype(np.float32),
    "images": rng.normal(size=(GLOBAL_BATCH, 5)).astype(np.float32),
    "texts": rng.normal(size=(GLOBAL_BATCH, 7)).astype(np.float32),
    "w_image": (rng.normal(size=(5, 4)) / np.sqrt(5)).astype(np.float32),
    "w_text": (rng.normal(size=(7, 4)) / np.sqrt(7)).astype(np.float32),
  }


def shard_batch(mesh, data):
  """The global batch array, built from the rows this process's devices hold."""
  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  sharding = NamedSharding(mesh, P("data"))
  global_rows = jax.tree.leaves(data)[0].shape[0]
  indices = sharding.addressable_devices_indices_map((global_rows,)).values()
  starts = sorted({index[0].indices(global_rows)[0] for index in indices})
  stops = sorted({index[0].indices(global_rows)[1] for index in indices})
  rows = slice(starts[0], stops[-1])  # contiguous: the mesh lists each process's devices together
  return jax.tree.map(
    lambda x: jax.make_array_from_process_local_data(sharding, x[rows], x.shape), data
  )


def mlp_loss(params, x, y):
  import jax.numpy as jnp

  return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] - y) ** 2)


def gsam_step(tx):
  """A per-device GSAM train step (the loss of the device's shard)."""
  import jax
  import optax

  def step(params, opt_state, batch):
    x, y = batch
    loss_fn = functools.partial(mlp_loss, x=x, y=y)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params, loss_fn=loss_fn, value=loss)
    return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "data")

  return step


def gsam_runs(mesh, data, ckpt_dir: pathlib.Path | None) -> dict[str, np.ndarray]:
  """Per-device and synchronized GSAM; the per-device run is checkpointed and resumed."""
  import jax
  import optax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import optax_gsam

  replicated = NamedSharding(mesh, P())
  batch = shard_batch(mesh, (data["x"], data["y"]))
  out = {}
  for name, sync in (("per_device", False), ("sync", True)):
    tx = optax.chain(
      optax_gsam.gsam(RHO, ALPHA, axis_name="data", sync_perturbation=sync),
      optax.sgd(LR, momentum=0.9),
    )
    step = optax_gsam.data_parallel(gsam_step(tx), mesh)
    params = {"w1": data["w1"], "w2": data["w2"]}
    state = jax.device_put((params, tx.init(params)), replicated)
    losses = []
    for i in range(STEPS):
      if i == SAVE_AT and name == "per_device" and ckpt_dir is not None:
        out |= checkpoint_and_resume(step, state, batch, tx, params, replicated, ckpt_dir)
      *state, loss = step(*state, batch)
      losses.append(float(loss))
    out[f"{name}/losses"] = np.array(losses)
    out |= {f"{name}/params/{k}": np.asarray(v) for k, v in state[0].items()}
  return out


def checkpoint_and_resume(step, state, batch, tx, init_params, replicated, ckpt_dir):
  """Saves (params, opt_state) from every process, restores into a fresh target, resumes."""
  import jax
  import optax
  import orbax.checkpoint as ocp

  checkpointer = ocp.StandardCheckpointer()
  path = ckpt_dir.resolve() / f"step_{SAVE_AT}"
  checkpointer.save(path, {"params": state[0], "opt_state": state[1]})
  checkpointer.wait_until_finished()
  # What a new job builds: its own fresh state, only for shapes, dtypes and shardings.
  fresh = jax.device_put({"params": init_params, "opt_state": tx.init(init_params)}, replicated)
  target = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), fresh
  )
  restored = checkpointer.restore(path, target)
  resumed = (restored["params"], restored["opt_state"])
  for _ in range(STEPS - SAVE_AT):
    *resumed, _ = step(*resumed, batch)
  count = np.asarray(optax.tree.get(restored["opt_state"], "count"))  # GSAMState.count
  return {"resumed/count": count} | {
    f"resumed/params/{k}": np.asarray(v) for k, v in resumed[0].items()
  }


def clip_run(mesh, data) -> dict[str, np.ndarray]:
  """The gradient cache with a CLIP loss over the global batch, then 3 GSAM steps with it."""
  import jax
  import jax.numpy as jnp
  import optax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import optax_gsam

  def embed(p, pair):
    images, texts = pair
    unit = lambda z: z / jnp.linalg.norm(z, axis=-1, keepdims=True)
    return unit(jnp.tanh(images @ p["w_image"])), unit(jnp.tanh(texts @ p["w_text"]))

  def loss(p, reps):
    return optax_gsam.clip_loss(*reps, p["t"])

  # The cache gathers the representations over "data", so the contrastive batch is global.
  grad_fn = optax_gsam.cached_value_and_grad(embed, loss, chunk_size=3, axis_name="data")
  # The cache's gradients are already global (the same on every device), so the
  # synchronized transform's averages change nothing and it perturbs with the global gradient.
  tx = optax.chain(
    optax_gsam.gsam(RHO, ALPHA, axis_name="data", sync_perturbation=True), optax.sgd(LR)
  )

  def step(params, opt_state, batch):
    value, grads = grad_fn(params, batch)
    updates, opt_state = tx.update(
      grads, opt_state, params, value_and_grad_fn=lambda p: grad_fn(p, batch), value=value
    )
    return optax.apply_updates(params, updates), opt_state, value, grads

  train_step = optax_gsam.data_parallel(step, mesh)
  params = {"w_image": data["w_image"], "w_text": data["w_text"], "t": np.float32(1.0)}
  state = jax.device_put((params, tx.init(params)), NamedSharding(mesh, P()))
  batch = shard_batch(mesh, (data["images"], data["texts"]))
  out = {}
  for i in range(3):
    *state, value, grads = train_step(*state, batch)
    if i == 0:  # value and gradient at the initial params
      out["clip/value"] = np.asarray(value)
      out |= {f"clip/grads/{k}": np.asarray(v) for k, v in grads.items()}
  return out | {f"clip/params/{k}": np.asarray(v) for k, v in state[0].items()}


def microbatch_runs(mesh, data) -> dict[str, np.ndarray]:
  """Two SGD steps of per-device GSAM with 2 micro-batches a device, both semantics."""
  import jax
  import optax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import optax_gsam

  batch = shard_batch(mesh, (data["x"], data["y"]))
  out = {}
  for name, each in (("whole", False), ("each", True)):
    tx = optax.chain(
      optax_gsam.gsam(RHO, ALPHA, axis_name="data", microbatches=2, perturb_each_microbatch=each),
      optax.sgd(LR),
    )

    def step(params, opt_state, batch, tx=tx):
      loss = lambda p, microbatch: mlp_loss(p, *microbatch)
      updates, opt_state = tx.update(None, opt_state, params, loss_fn=loss, batch=batch)
      return optax.apply_updates(params, updates), opt_state

    step = optax_gsam.data_parallel(step, mesh)
    params = {"w1": data["w1"], "w2": data["w2"]}
    state = jax.device_put((params, tx.init(params)), NamedSharding(mesh, P()))
    for _ in range(2):
      state = step(*state, batch)
    out |= {f"microbatch/{name}/params/{k}": np.asarray(v) for k, v in state[0].items()}
  return out


def run_checks(ckpt_dir: pathlib.Path | None = None) -> dict[str, np.ndarray]:
  """Every check on a mesh over all of ``jax.devices()``; host arrays, the same on every process."""
  import jax

  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  data = problem()
  return gsam_runs(mesh, data, ckpt_dir) | clip_run(mesh, data) | microbatch_runs(mesh, data)


def crash(how: str) -> None:
  """Process 1 dies after a first collective; process 0 keeps waiting in collectives."""
  import jax
  import jax.numpy as jnp

  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  total = jax.jit(
    jnp.sum, out_shardings=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  )
  x = shard_batch(mesh, np.ones((jax.device_count(),), np.float32))
  for i in range(10_000):
    total(x).block_until_ready()
    if i == 1 and jax.process_index() == 1:
      print(f"process 1 dies now ({how})", flush=True)
      if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
      if how == "exit":
        sys.exit(3)  # without initialize's exit hook: 300 s in JAX's shutdown barrier
      raise RuntimeError("process 1 fails on purpose")


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("out_dir", type=pathlib.Path)
  parser.add_argument("--crash", choices=("kill", "raise", "exit"), default=None)
  args = parser.parse_args(argv)
  import optax_gsam.launch

  optax_gsam.launch.initialize()  # the launcher's environment: coordinator, process count and id
  import jax

  if args.crash:
    crash(args.crash)
    return
  results = run_checks(ckpt_dir=args.out_dir / "checkpoints")
  results["process_count"] = np.array(jax.process_count())
  results["device_count"] = np.array(jax.device_count())
  np.savez(args.out_dir / f"process_{jax.process_index()}.npz", **results)


if __name__ == "__main__":
  sys.exit(main())
