"""GSAM with per-device perturbation on a multi-host TPU pod (or 8 simulated CPU devices).

The same file runs on every host of a pod, e.g. a TPU v3-64 (32 chips, 64
cores, 8 hosts)::

    gcloud compute tpus tpu-vm ssh $TPU_NAME --zone $ZONE --worker=all --command \\
      "cd optax_gsam && python -m benchmarks.costs.pod_launch --multihost --model vit_b32 \\
         --global-batch 4096 --steps 50"

and, with ``--cpu-devices 8``, on one machine with simulated devices (which is
how the tests run it). On one machine it also runs as several processes of
JAX's multi-process runtime, the pod's own code path with real cross-process
collectives (gloo)::

    python -m optax_gsam.launch --local-processes 2 --devices-per-process 4 -- \
      python -m benchmarks.costs.pod_launch --multihost --global-batch 16 --steps 3

Each host:

1. calls ``jax.distributed.initialize`` (``--multihost``) through
   ``optax_gsam.launch.initialize``: with ``--coordinator``,
   ``--num-processes`` and ``--process-id``, or the variables the launcher
   sets, or, with neither, JAX's own detection (Cloud TPU, SLURM, Open MPI);
2. builds one global mesh over ``jax.devices()`` with a single ``data`` axis;
3. makes its own share of the global batch (synthetic data here, example ``i``
   drawn from seed ``i`` so the batch is the same for any number of hosts; a
   real input pipeline reads this host's shard) and assembles the global array
   with ``jax.make_array_from_process_local_data``;
4. runs the GSAM train step under ``optax_gsam.data_parallel``: every core
   perturbs with its own gradient (the paper's m-sharpness setting) and the
   transform averages the GSAM gradients, so params stay replicated.

Process 0 prints each step's loss and the step time, and writes ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time
from typing import Any

import jax
import numpy as np


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--multihost", action="store_true", help="call jax.distributed.initialize")
  parser.add_argument(
    "--coordinator", default=None, metavar="HOST:PORT", help="process 0's address"
  )
  parser.add_argument("--num-processes", type=int, default=None, metavar="N")
  parser.add_argument("--process-id", type=int, default=None, metavar="I")
  parser.add_argument("--cpu-devices", type=int, default=0, help="simulate N CPU devices (each)")
  parser.add_argument("--model", choices=("vit_tiny", "vit_b32"), default="vit_tiny")
  parser.add_argument("--width", type=int, default=48, help="vit_tiny's width (3 heads)")
  parser.add_argument("--depth", type=int, default=2, help="vit_tiny's number of blocks")
  parser.add_argument("--global-batch", type=int, default=64)
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--rho-max", type=float, default=0.6)
  parser.add_argument("--rho-min", type=float, default=0.1)
  parser.add_argument("--alpha", type=float, default=0.6)
  parser.add_argument("--lr", type=float, default=3e-3)
  parser.add_argument("--sync-perturbation", action="store_true")
  parser.add_argument("--out", type=pathlib.Path, default=None)
  args = parser.parse_args(argv)
  flags = {"--coordinator": args.coordinator, "--num-processes": args.num_processes}
  flags["--process-id"] = args.process_id
  given = [flag for flag, value in flags.items() if value is not None]
  if given and not args.multihost:  # otherwise every host would train alone
    parser.error(f"{', '.join(given)} need --multihost")
  if given and args.coordinator is None and not os.environ.get("JAX_COORDINATOR_ADDRESS"):
    parser.error(f"{', '.join(given)} need --coordinator HOST:PORT (or JAX_COORDINATOR_ADDRESS)")
  if args.steps < 2:
    parser.error(
      f"--steps must be at least 2 (the learning rate warms up from 0), got {args.steps}"
    )
  return args


def host_rows(sharding: jax.sharding.Sharding, global_batch: int) -> range:
  """The rows of a ``[global_batch, ...]`` array that this process's devices hold."""
  rows = sorted(
    index[0].indices(global_batch)[:2]
    for index in sharding.addressable_devices_indices_map((global_batch,)).values()
  )
  start, stop = rows[0][0], rows[-1][1]
  if sum(b - a for a, b in set(rows)) != stop - start:
    raise ValueError(f"this process's rows {rows} are not one contiguous block")
  return range(start, stop)


def example(index: int, image_size: int, classes: int) -> tuple:
  """Synthetic example ``index``: the same on every host, whatever the number of hosts."""
  rng = np.random.default_rng(index)
  image = rng.normal(size=(image_size, image_size, 3)).astype(np.float32)
  return image, int(rng.integers(0, classes))


def global_batch(
  sharding: jax.sharding.Sharding, size: int, image_size: int, classes: int
) -> tuple[jax.Array, jax.Array]:
  """(images, labels) of the global batch; this host makes (or reads) only its own rows."""
  examples = [example(i, image_size, classes) for i in host_rows(sharding, size)]
  images = np.stack([image for image, _ in examples])
  labels = np.array([label for _, label in examples], np.int32)
  return (
    jax.make_array_from_process_local_data(sharding, images, (size, *images.shape[1:])),
    jax.make_array_from_process_local_data(sharding, labels, (size,)),
  )


def start_runtime(args: argparse.Namespace) -> None:
  """CPU device count and the multi-process runtime, before anything starts a backend."""
  if args.cpu_devices and jax.config.jax_num_cpu_devices != args.cpu_devices:
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", args.cpu_devices)
  if args.multihost:
    import optax_gsam.launch

    if args.cpu_devices:  # CPU processes talk through gloo (JAX's default has changed)
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
    optax_gsam.launch.initialize(args.coordinator, args.num_processes, args.process_id)


def make_model(args: argparse.Namespace) -> tuple[Any, int, int]:
  """``(model, image_size, classes)`` of ``--model``."""
  from benchmarks.models import ViT

  if args.model == "vit_b32":
    return ViT(patch=32, width=768, depth=12, heads=12, num_classes=1000), 224, 1000
  return ViT(patch=4, width=args.width, depth=args.depth, heads=3), 32, 10


def make_train_step(args: argparse.Namespace, model, mesh: jax.sharding.Mesh):
  """GSAM + AdamW with rho following the warmup-cosine lr, data-parallel over ``mesh``."""
  import optax

  import optax_gsam

  from benchmarks import harness

  lr = optax.warmup_cosine_decay_schedule(0.0, args.lr, max(1, args.steps // 10), args.steps)
  rho = optax_gsam.rho_from_lr(lr, args.rho_max, args.rho_min, num_steps=args.steps)
  tx = optax.chain(
    optax_gsam.gsam(rho, args.alpha, axis_name="data", sync_perturbation=args.sync_perturbation),
    optax.adamw(lr, weight_decay=1e-4),
  )

  def per_device_step(params, opt_state, batch):
    images, labels = batch
    loss_fn = lambda p: harness.cross_entropy(model.apply(p, images), labels)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params, loss_fn=loss_fn, value=loss)
    return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "data")

  return tx, optax_gsam.data_parallel(per_device_step, mesh, donate_argnums=(0, 1))


def run_steps(train_step, params, opt_state, batch, steps: int):
  """Runs ``steps`` steps: the final state, the first step's seconds, later steps' and losses."""
  times, losses = [], []
  for _ in range(steps):
    start = time.perf_counter()
    params, opt_state, loss = train_step(params, opt_state, batch)
    loss.block_until_ready()
    times.append(time.perf_counter() - start)
    losses.append(float(loss))
  return params, opt_state, times[0], times[1:], losses


def main(argv: list[str] | None = None) -> dict:
  args = parse_args(argv)
  start_runtime(args)
  import optax

  model, image_size, classes = make_model(args)
  devices = jax.devices()
  if args.global_batch % len(devices):
    raise ValueError(f"--global-batch {args.global_batch} must divide over {len(devices)} devices")
  mesh = jax.make_mesh((len(devices),), ("data",))
  batch_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  tx, train_step = make_train_step(args, model, mesh)
  batch = global_batch(batch_sharding, args.global_batch, image_size, classes)

  params = model.init(jax.random.key(0), np.zeros((1, image_size, image_size, 3), np.float32))
  # Replicated over the global mesh from the start, as the step returns them: one compilation.
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  params, opt_state = jax.device_put((params, tx.init(params)), replicated)
  params, opt_state, first_step_s, times, losses = run_steps(
    train_step, params, opt_state, batch, args.steps
  )
  if jax.process_index() == 0:
    for i, value in enumerate(losses):
      print(f"step {i + 1} loss {value:.6f}")

  result = {
    "processes": jax.process_count(),
    "devices": len(devices),
    "platform": devices[0].platform,
    "device_kind": devices[0].device_kind,
    "model": args.model,
    "global_batch": args.global_batch,
    "sync_perturbation": args.sync_perturbation,
    "compile_and_first_step_s": first_step_s,
    "median_step_s": float(np.median(times)) if times else None,
    "losses": losses,
    "surrogate_gap": float(optax.tree.get(opt_state, "surrogate_gap")),
  }
  if jax.process_index() == 0:
    print(json.dumps(result, indent=2))
    if args.out is not None:
      args.out.parent.mkdir(parents=True, exist_ok=True)
      args.out.write_text(json.dumps(result, indent=2))
  return result


if __name__ == "__main__":
  main()
