"""Flax integration: a Linen ``TrainState`` that forwards extra args to ``tx``.

GSAM and SAM need the loss at the perturbed weights, so their ``update`` takes
``loss_fn=`` (or ``value_and_grad_fn=``) and, for the surrogate-gap diagnostic,
``value=``. Flax Linen's ``TrainState.apply_gradients`` calls ``tx.update``
without extra arguments; :class:`TrainState` is a drop-in subclass that
forwards them. NNX needs no helper: ``nnx.Optimizer.update(model, grads,
**kwargs)`` already forwards keyword arguments (see ``docs/flax.md`` for a
complete NNX train step).

Three rules make the perturbed pass consistent with the clean one; the guide
``docs/flax.md`` shows each in code:

* Mutable collections (``batch_stats``): the clean pass runs with
  ``mutable=["batch_stats"]`` and its new statistics are stored in the state;
  the ``loss_fn`` given to the transform drops the statistics of the perturbed
  pass, so they never reach the state.
* Dropout: ``loss_fn`` closes over the same dropout key as the clean pass, so
  both passes draw the same mask.
* Mixup and other input randomness: mix once, before the clean pass, and close
  ``loss_fn`` over the mixed batch.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import optax
from flax.training import train_state

__all__ = ("TrainState",)


class TrainState(train_state.TrainState):
  """``flax.training.train_state.TrainState`` whose ``apply_gradients`` forwards extra args.

  ``state.apply_gradients(grads=g, loss_fn=..., value=..., **fields)`` runs
  ``tx.update(g, opt_state, params, loss_fn=..., value=...)``. Keyword
  arguments that name a field of the state (``batch_stats`` in a subclass, for
  instance) are replaced, exactly as in Flax; every other keyword argument is
  forwarded to ``tx.update``. A ``tx`` without extra-args support (a plain
  ``optax.sgd``) ignores them, so the same train step runs with or without GSAM.
  Everything else, ``create`` and the ``step`` counter included, is Flax's.

  Subclass it to add collections, as with Flax's class:

    >>> from typing import Any
    >>> import optax_gsam.flax
    >>> class BatchNormState(optax_gsam.flax.TrainState):
    ...   batch_stats: Any

  Example:
    >>> import jax, jax.numpy as jnp, optax, optax_gsam
    >>> import flax.linen as nn
    >>> from optax_gsam.flax import TrainState
    >>> model = nn.Dense(1)
    >>> x, y = jnp.ones((4, 3)), jnp.zeros((4, 1))
    >>> state = TrainState.create(
    ...   apply_fn=model.apply,
    ...   params=model.init(jax.random.key(0), x)["params"],
    ...   tx=optax.chain(optax_gsam.gsam(rho=0.05, alpha=0.3), optax.sgd(0.1)),
    ... )
    >>> def loss_fn(params):
    ...   return jnp.mean((state.apply_fn({"params": params}, x) - y) ** 2)
    >>> loss, grads = jax.value_and_grad(loss_fn)(state.params)
    >>> state = state.apply_gradients(grads=grads, loss_fn=loss_fn, value=loss)
    >>> int(state.step)
    1

  References:
    Zhuang et al., `Surrogate Gap Guided Sharpness-Aware Minimization
    <https://openreview.net/forum?id=edONMAnhLu->`_, ICLR 2022.
  """

  @classmethod
  def create(cls, *, apply_fn: Any, params: Any, tx: optax.GradientTransformation, **kwargs: Any):
    """Flax's ``TrainState.create``, with ``tx`` checked first.

    Raises:
      ValueError: when ``tx`` is not an optax ``GradientTransformation`` (an
        object with callable ``init`` and ``update``), e.g. the factory
        ``optax.sgd`` instead of ``optax.sgd(lr)``.
    """
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
      hint = " (a factory: call it, e.g. optax.sgd(0.1))" if callable(tx) else ""
      raise ValueError(
        "tx must be an optax.GradientTransformation, an object with init and update such as "
        f"optax.chain(optax_gsam.gsam(...), optax.sgd(lr)); got {tx!r}{hint}."
      )
    return super().create(apply_fn=apply_fn, params=params, tx=tx, **kwargs)

  def apply_gradients(self, *, grads: Any, **kwargs: Any) -> TrainState:
    """Applies ``grads`` with ``tx``, forwarding the non-field kwargs to ``tx.update``.

    Args:
      grads: gradients with the structure of ``params`` (the clean gradient
        when ``tx`` starts with :func:`optax_gsam.gsam`).
      **kwargs: names of fields of the state are ``replace``-d in the result;
        all others (``loss_fn``, ``value_and_grad_fn``, ``value``, ...) are
        passed to ``tx.update``.

    Returns:
      The new state, with ``step`` incremented and ``params``/``opt_state``
      updated.
    """
    field_names = {field.name for field in dataclasses.fields(self)}
    fields = {name: value for name, value in kwargs.items() if name in field_names}
    extra_args = {name: value for name, value in kwargs.items() if name not in field_names}
    if not extra_args:
      return super().apply_gradients(grads=grads, **fields)
    tx = self.tx
    if not isinstance(tx, optax.GradientTransformationExtraArgs):
      tx = optax.with_extra_args_support(tx)
    # Flax's apply_gradients, run with a tx whose update has the extra args bound,
    # so Flax's own handling of params (overwrite-with-gradient included) is kept.
    bound = optax.GradientTransformation(tx.init, functools.partial(tx.update, **extra_args))
    new_state = super(TrainState, self.replace(tx=bound)).apply_gradients(grads=grads, **fields)
    return new_state.replace(tx=self.tx)
