"""Data-parallel train steps: shard_map on a mesh, and device emulation with vmap.

``gsam(..., axis_name=...)`` runs inside a per-device context. These helpers
build that context around a per-device train step ``step(params, opt_state,
batch, ...)`` so that the same step runs on a mesh of real devices (one host or
a pod) or, for studying m-sharpness, on one device.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Hashable
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import AxisType
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optax_gsam._src.core.validation import check_positive_int


def _check_argnums(name: str, argnums: Sequence[int]) -> tuple[int, ...]:
  argnums = tuple(argnums)
  if not argnums or not all(isinstance(i, int) and i >= 0 for i in argnums):
    raise ValueError(f"{name} must be a non-empty sequence of argument indices, got {argnums!r}.")
  return argnums


def _check_mesh(mesh: Any) -> None:
  if not isinstance(mesh, Mesh):
    raise ValueError(
      f"mesh must be a jax.sharding.Mesh, e.g. jax.make_mesh((jax.device_count(),), ('data',)); "
      f"got {mesh!r}."
    )


def _replica_axes(mesh: Mesh, axis_name: Any) -> tuple[Hashable, ...]:
  """``axis_name`` as a tuple of mesh axes; each must be an axis of ``mesh``, named once."""
  axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
  missing = [a for a in axes if a not in mesh.axis_names]
  if missing or not axes or len(set(axes)) != len(axes):
    raise ValueError(
      f"axis_name={axis_name!r} is not an axis of the mesh {mesh.axis_names}: name one of its "
      "axes, or a tuple of distinct ones (the replica axes the perturbation is separate over)."
    )
  return axes


def _check_not_manual(mesh: Mesh, axes: tuple[Hashable, ...]) -> None:
  """A Manual axis means the step is already inside a ``shard_map`` over it."""
  types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
  if any(types[a] == AxisType.Manual for a in axes):
    raise ValueError(
      f"The mesh axes {axes!r} are Manual: data_parallel is being called inside a "
      "shard_map over them. Call data_parallel outside any shard_map, on the global mesh "
      "(e.g. jax.make_mesh((n,), ('data',)))."
    )


def _placer(mesh: Mesh, axes: tuple[Hashable, ...]) -> Callable[[Any, NamedSharding], Any]:
  """How to place an input inside ``jit``: by the type of the mesh axes it is split over.

  ``jax.reshard`` takes Explicit axes only (``jax.make_mesh``'s default); a mesh
  built as ``Mesh(devices, names)`` has Auto axes, which take
  ``jax.lax.with_sharding_constraint``.
  """
  types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
  if all(types[a] == AxisType.Explicit for a in axes):
    return jax.reshard
  return jax.lax.with_sharding_constraint


def data_parallel(
  step_fn: Callable[..., Any],
  mesh: Mesh,
  *,
  axis_name: Hashable = "data",
  batch_argnums: Sequence[int] = (2,),
  donate_argnums: Sequence[int] = (),
  out_specs: Any = None,
) -> Callable[..., Any]:
  """``jax.jit(jax.shard_map(step_fn))`` for a per-device data-parallel train step.

  The arguments at ``batch_argnums`` are split along their leading (batch)
  axis over ``axis_name``; every other argument (params, optimizer state, PRNG
  keys) is replicated. Inside, ``step_fn`` sees its device's shard and runs
  ``tx.update`` of a transform built with the same ``axis_name``; the transform
  averages the gradient, so params and optimizer state come out replicated.
  Average any per-device metric with ``jax.lax.pmean`` before returning it, or
  pass ``out_specs``.

  This is how per-device perturbation (the GSAM paper's m-sharpness) is written
  in a ``jit``-on-a-mesh trainer: under plain ``jax.jit`` with sharded arrays
  gradients are global, so the perturbation is necessarily synchronized.

  **Perturbation groups.** On a mesh with more axes than ``axis_name`` names
  (e.g. ``("replica", "fsdp")`` with ``axis_name="replica"``), the
  ``shard_map`` is over the replica axes only and the other axes stay with
  ``jax.jit``: inside ``step_fn`` the parameters keep the layout the caller
  gave them over those axes (FSDP, tensor parallelism), the batch is one
  replica group's, and the transform (built with the same ``axis_name``)
  perturbs each group with its own gradient. Inputs are then not placed: give
  params, state and batch the shardings they train with (the batch split over
  the replica axes, e.g. ``P(("replica", "fsdp"))``). See docs/sharded.md.

  The ``shard_map`` runs with ``check_vma=False``. With JAX's default
  (``check_vma=True``), ``jax.grad`` with respect to a replicated input returns
  the gradient already summed over the axis, so the transform would see the
  global gradient, not the device's own. In a hand-written ``shard_map`` with
  ``check_vma=True``, differentiate with respect to
  ``jax.lax.pvary(params, axis_name)`` to get the local gradient.

  Args:
    step_fn: ``step(params, opt_state, batch, ...)`` for one device's shard.
    mesh: a ``jax.sharding.Mesh`` with an axis called ``axis_name``; on a pod,
      the global mesh over ``jax.devices()``. Its axes may be Explicit
      (``jax.make_mesh``'s default) or Auto (``Mesh(np.array(devices), ("data",))``).
    axis_name: the mesh axis the batch is split over (the replica axis), or a
      tuple of such axes.
    batch_argnums: positions of the batch-sharded arguments.
    donate_argnums: forwarded to ``jax.jit`` (e.g. ``(0, 1)`` for params and
      optimizer state).
    out_specs: the outputs' partition specs; ``None`` (default) replicates all.

  Returns:
    The jitted data-parallel step, taking global arrays.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax, optax_gsam
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> tx = optax.chain(optax_gsam.gsam(0.05, 0.1, axis_name="data"), optax.sgd(0.1))
    >>> def step(w, opt_state, batch):
    ...   loss_fn = lambda w: jnp.mean((batch @ w - 1.0) ** 2)
    ...   loss, grads = jax.value_and_grad(loss_fn)(w)
    ...   updates, opt_state = tx.update(grads, opt_state, w, loss_fn=loss_fn, value=loss)
    ...   return optax.apply_updates(w, updates), opt_state, jax.lax.pmean(loss, "data")
    >>> train_step = optax_gsam.data_parallel(step, mesh, axis_name="data")
    >>> w = jnp.zeros(3)
    >>> batch = jnp.ones((8 * jax.device_count(), 3))
    >>> w, opt_state, loss = train_step(w, tx.init(w), batch)
  """
  _check_mesh(mesh)
  replica_axes = _replica_axes(mesh, axis_name)
  _check_not_manual(mesh, replica_axes)
  batch_argnums = _check_argnums("batch_argnums", batch_argnums)
  # Every axis of the mesh is a replica axis: inputs are placed here, so callers may pass host
  # or unsharded arrays. With other axes, those stay with jit and the inputs keep the layout
  # the caller gave them over those axes (the model's FSDP or tensor-parallel shardings).
  place = _placer(mesh, replica_axes) if len(replica_axes) == len(mesh.axis_names) else None

  def wrapped(*args):
    in_specs = tuple(P(axis_name) if i in batch_argnums else P() for i in range(len(args)))
    if place is not None:
      args = tuple(
        jax.tree.map(lambda x, spec=spec: place(x, NamedSharding(mesh, spec)), a)
        for a, spec in zip(args, in_specs, strict=True)
      )
    sharded = jax.shard_map(
      step_fn,
      mesh=mesh,
      in_specs=in_specs,
      out_specs=P() if out_specs is None else out_specs,
      axis_names=set(replica_axes),
      check_vma=False,
    )
    return sharded(*args)

  return jax.jit(wrapped, donate_argnums=tuple(donate_argnums))


def emulate_devices(
  step_fn: Callable[..., Any],
  num_devices: int,
  *,
  axis_name: Hashable = "data",
  batch_argnums: Sequence[int] = (2,),
) -> Callable[..., Any]:
  """Runs a per-device train step for ``num_devices`` virtual devices on one device.

  Each argument at ``batch_argnums`` is split into ``num_devices`` equal
  groups along its leading axis, and ``step_fn`` is ``jax.vmap``-ed over the
  groups with ``axis_name`` bound, so its collectives (``jax.lax.pmean`` inside
  ``gsam(..., axis_name=axis_name)``) average over groups exactly as over
  devices. It reproduces what ``num_devices`` devices compute, on one CPU or
  GPU: the way to study the m-sharpness trade-off without a pod.

  Memory: ``vmap`` holds every group's activations and gradients at once, so
  peak memory is about that of the whole batch plus ``num_devices`` gradient
  copies. When that is too much, use ``gsam(..., microbatches=G,
  perturb_each_microbatch=True)``, which scans over the groups sequentially
  with one group's memory. The ``lax.cond`` of a cheap-step policy (e.g.
  ``every_k_policy(k)``) stays a conditional here, since the optimizer state
  (its predicate) is not batched.

  All outputs must be the same on every group (average metrics with
  ``jax.lax.pmean``); they are returned once, without a group axis.

  Args:
    step_fn: ``step(params, opt_state, batch, ...)`` for one device's shard.
    num_devices: the number of virtual devices (groups).
    axis_name: the axis name the transforms inside ``step_fn`` use.
    batch_argnums: positions of the batch arguments to split.

  Returns:
    A function with ``step_fn``'s signature taking the whole batch.
  """
  check_positive_int("num_devices", num_devices)
  batch_argnums = _check_argnums("batch_argnums", batch_argnums)

  def split(x):
    if x.shape[0] % num_devices:
      raise ValueError(
        f"The batch size {x.shape[0]} is not divisible by num_devices={num_devices}."
      )
    return x.reshape(num_devices, x.shape[0] // num_devices, *x.shape[1:])

  def wrapped(*args):
    args = tuple(jax.tree.map(split, a) if i in batch_argnums else a for i, a in enumerate(args))
    in_axes = tuple(0 if i in batch_argnums else None for i in range(len(args)))
    vmapped = jax.vmap(
      step_fn, in_axes=in_axes, out_axes=None, axis_name=axis_name, axis_size=num_devices
    )
    return vmapped(*args)

  return wrapped
