"""Flax integration: a Linen ``TrainState`` that forwards extra args to ``tx``.

GSAM and SAM need the loss at the perturbed weights, so their ``update`` takes
``loss_fn=`` (or ``value_and_grad_fn=``) and, for the surrogate-gap diagnostic,
``value=``. Flax Linen's ``TrainState.apply_gradients`` calls ``tx.update``
without extra arguments; :class:`TrainState` is a drop-in subclass that
forwards them. NNX's ``nnx.Optimizer.update(model, grads, **kwargs)`` already
forwards keyword arguments, but the transform calls ``loss_fn`` with the pure
parameter state, not a model; :func:`nnx_loss_fn` turns an NNX loss
``loss_fn(model, *args)`` into that function (see ``docs/flax.md`` for
complete train steps).

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

``loss_fn`` receives what ``tx.update`` receives as ``params``: ``state.params``,
or only ``state.params["params"]`` when the state holds an overwrite-with-gradient
(fp8) collection, which ``loss_fn`` then puts back itself.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from collections.abc import Callable
from typing import Any
from typing import ClassVar

import jax
import optax
from flax import nnx
from flax.training import train_state

from optax_gsam._src.calls.user_functions import UPDATE_KEYWORDS
from optax_gsam._src.calls.user_functions import MissingLossFunctionError
from optax_gsam._src.calls.user_functions import call_form_error

__all__ = ("TrainState", "nnx_loss_fn", "nnx_microbatch_loss_fn")

# How close (difflib ratio) a keyword must be to a known name to be suggested in the error:
# `batch_stat`/`batch_stats` is 0.95, `valu`/`value` 0.89, `stats`/`batch_stats` 0.62.
_SUGGESTION_CUTOFF = 0.6

_MISSING_LOSS_IN_APPLY_GRADIENTS = (
  "Pass exactly one of loss_fn (params -> loss) or value_and_grad_fn to update(): "
  "optax_gsam.flax.TrainState.apply_gradients(grads=...) was called without loss_fn, and tx "
  "(gsam/sam) needs the loss at the perturbed weights. Pass it with the gradients: "
  "state.apply_gradients(grads=grads, loss_fn=loss_fn, value=loss), where loss_fn(params) "
  "closes over the batch (and the dropout key, batch_stats) of the clean pass. In Flax's "
  "two-function form, where apply_model computes the gradients and update_model(state, grads) "
  "applies them, call state.apply_gradients(grads=grads, loss_fn=loss_fn, value=loss) inside "
  "apply_model and return the new state (a jitted apply_model cannot return loss_fn, a Python "
  "function; docs/flax.md)."
)


class TrainState(train_state.TrainState):
  """``flax.training.train_state.TrainState`` whose ``apply_gradients`` forwards extra args.

  ``state.apply_gradients(grads=g, loss_fn=..., value=..., **fields)`` runs
  ``tx.update(g, opt_state, params, loss_fn=..., value=...)``. Keyword
  arguments that name a field of the state (``batch_stats`` in a subclass, for
  instance) are replaced, exactly as in Flax; ``loss_fn``, ``value`` and the
  other ``forwarded_keywords`` are forwarded to ``tx.update``. A ``tx`` without extra-args support (a plain
  ``optax.sgd``) ignores them, so the same train step runs with or without GSAM.
  Everything else, ``create`` and the ``step`` counter included, is Flax's.

  A keyword that is neither a field nor in ``forwarded_keywords`` raises
  a ``TypeError``, as Flax's ``apply_gradients`` does for unknown fields:
  forwarded, nothing would read it (``stats=`` for ``batch_stats=``, ``valu=``
  for ``value=``) and the step would silently run without it. A transform of
  your own that reads another keyword is declared in a subclass,
  ``forwarded_keywords = (*TrainState.forwarded_keywords, "my_arg")``.

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

  #: Keywords forwarded to ``tx.update``: those gsam/sam/momentum_sam read, and optax's
  #: own extra arguments (``value``, ``grad``, ``value_fn`` of its line searches).
  forwarded_keywords: ClassVar[tuple[str, ...]] = (*UPDATE_KEYWORDS, "grad", "value_fn")

  @classmethod
  def create(
    cls, *, apply_fn: Any, params: Any, tx: optax.GradientTransformation, **kwargs: Any
  ) -> TrainState:
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
    """Applies ``grads`` with ``tx``, forwarding the loss function and value to ``tx.update``.

    Args:
      grads: gradients with the structure of ``params`` (the clean gradient
        when ``tx`` starts with :func:`optax_gsam.gsam`), or ``None`` when
        ``tx`` starts with a micro-batched :func:`optax_gsam.gsam`
        (``microbatches=k``), which accumulates the clean gradient itself
        over the micro-batches of ``batch=``.
      **kwargs: names of fields of the state are ``replace``-d in the result;
        the ``forwarded_keywords`` (``loss_fn``, ``value_and_grad_fn``,
        ``value``, ...) are passed to ``tx.update``.

    Returns:
      The new state, with ``step`` incremented and ``params``/``opt_state``
      updated.

    Raises:
      TypeError: when a keyword is neither a field of the state nor in
        ``forwarded_keywords`` (``batch_stat=`` for ``batch_stats=``,
        ``valu=`` for ``value=``): the error names the closest known one.
      ValueError: when ``tx`` needs a loss function (it starts with gsam/sam)
        and neither ``loss_fn`` nor ``value_and_grad_fn`` was passed.
    """
    field_names = {field.name for field in dataclasses.fields(self)}
    self._check_keywords(kwargs, field_names)
    fields = {name: value for name, value in kwargs.items() if name in field_names}
    extra_args = {name: value for name, value in kwargs.items() if name not in field_names}
    if grads is None:  # micro-batches: the transform takes the clean gradient itself
      return self._apply_without_clean_gradient(fields, extra_args)
    try:
      if not extra_args:
        return super().apply_gradients(grads=grads, **fields)
      tx = self.tx
      if not isinstance(tx, optax.GradientTransformationExtraArgs):
        tx = optax.with_extra_args_support(tx)
      # Flax's apply_gradients, run with a tx whose update has the extra args bound,
      # so Flax's own handling of params (overwrite-with-gradient included) is kept.
      bound = optax.GradientTransformation(tx.init, functools.partial(tx.update, **extra_args))
      new_state = super(TrainState, self.replace(tx=bound)).apply_gradients(grads=grads, **fields)
    except MissingLossFunctionError as error:
      # The hint of the core error sends users of Flax's TrainState here; they are here.
      raise MissingLossFunctionError(_MISSING_LOSS_IN_APPLY_GRADIENTS) from error
    return new_state.replace(tx=self.tx)

  def _apply_without_clean_gradient(self, fields: dict[str, Any], extra_args: dict[str, Any]):
    """``grads=None``: ``tx`` (gsam/sam with ``microbatches``) accumulates the clean gradient."""
    updates, opt_state = self.tx.update(None, self.opt_state, self.params, **extra_args)
    params = optax.apply_updates(self.params, updates)
    return self.replace(step=self.step + 1, params=params, opt_state=opt_state, **fields)

  def _check_keywords(self, kwargs: dict[str, Any], field_names: set[str]) -> None:
    """Every keyword is a field or a forwarded keyword; else a TypeError naming the closest."""
    forwarded = set(self.forwarded_keywords)
    for name in kwargs:
      if name in field_names or name in forwarded:
        continue
      known = sorted(field_names | forwarded)
      close = difflib.get_close_matches(name, known, n=1, cutoff=_SUGGESTION_CUTOFF)
      where = "field" if close and close[0] in field_names else "forwarded keyword"
      suggestion = f"; did you mean {close[0]}= (a {where})?" if close else "."
      raise TypeError(
        f"{type(self).__name__}.apply_gradients() got {name}=, which is neither a field of the "
        f"state nor a keyword that tx.update reads, so it would be ignored{suggestion} "
        f"Fields (replaced): {', '.join(sorted(field_names))}. Forwarded to tx.update: "
        f"{', '.join(self.forwarded_keywords)}; a transform of your own that reads another "
        "keyword is declared in a subclass: forwarded_keywords = "
        f"(*TrainState.forwarded_keywords, {name!r})."
      )


def _is_nnx_node(value: Any) -> bool:
  return isinstance(value, (nnx.Pytree, nnx.Variable))


_SNAPSHOT_AFTER_CLEAN_PASS = (
  "optax_gsam.flax.nnx_loss_fn was called after the clean pass: the loss changes {changed}, "
  "and they had not changed between the snapshot and this update, so the snapshot holds the "
  "state the clean pass left behind (or the clean pass did not run on the model itself, "
  "whose state then never advances). The perturbed pass would start from that state (the "
  "next dropout masks, the updated statistics or counters), which is not GSAM's step (at a "
  "tiny rho it is not the plain step). Call nnx_loss_fn before nnx.value_and_grad: "
  "perturbed_loss = nnx_loss_fn(loss_fn, model, *args), then the clean pass, then "
  "optimizer.update(model, grads, loss_fn=perturbed_loss, value=loss)."
)


def _non_param_leaves(objects: Any, is_param: Callable[..., bool]) -> list[Any]:
  _, _, *rest = nnx.split(objects, is_param, ...)
  return jax.tree.leaves(nnx.as_pure(rest[0]))


def _non_param_names(objects: Any, is_param: Callable[..., bool]) -> list[str]:
  """'path (VariableType)' for each leaf of :func:`_non_param_leaves`, in the same order."""
  _, _, *rest = nnx.split(objects, is_param, ...)
  is_variable = lambda x: isinstance(x, nnx.Variable)
  flat = jax.tree_util.tree_flatten_with_path(rest[0], is_leaf=is_variable)[0]

  def name(path: tuple) -> str:  # objects is (model, [NNX arguments]): name the object first
    if getattr(path[0], "key", None) == 0:
      return "model" + jax.tree_util.keystr(tuple(path[1:]))
    return "the NNX argument" + jax.tree_util.keystr(tuple(path[1:]))

  return [f"{name(path)} ({type(v).__name__})" for path, v in flat]


def _check_snapshot_precedes_clean_pass(
  params: Any, snapshot: Any, copies: Any, originals: Any, is_param: Callable[..., bool]
) -> None:
  """Raises when the loss mutates state that the clean pass left untouched since the snapshot.

  At trace time, by object identity: the loss just changed some leaves of the
  throw-away ``copies`` (an RNG counter, batch statistics); the clean pass, the
  same loss on ``originals``, changes the same leaves, so when the originals
  still hold the snapshot's arrays there, the snapshot was taken after it.
  A call with the model's own parameters (by hand, not the transform's call at
  the perturbed ones) is not checked.
  """
  own_params = jax.tree.leaves(nnx.as_pure(nnx.split(originals, is_param, ...)[1]))
  given = jax.tree.leaves(params)
  if len(given) == len(own_params) and all(a is b for a, b in zip(given, own_params, strict=True)):
    return
  before = jax.tree.leaves(snapshot)
  after, now = _non_param_leaves(copies, is_param), _non_param_leaves(originals, is_param)
  if not len(before) == len(after) == len(now):  # The loss made or dropped variables.
    return
  mutated = [i for i, leaf in enumerate(after) if leaf is not before[i]]
  if mutated and all(now[i] is before[i] for i in mutated):
    names = _non_param_names(copies, is_param)
    changed = "state" if len(names) != len(after) else ", ".join(names[i] for i in mutated)
    raise ValueError(_SNAPSHOT_AFTER_CLEAN_PASS.format(changed=changed))


def _variable_paths(state: Any) -> dict[str, str]:
  """'path' -> 'VariableType' (or the array's type) for each leaf of an NNX state."""
  is_variable = lambda x: isinstance(x, nnx.Variable)
  flat = jax.tree_util.tree_flatten_with_path(state, is_leaf=is_variable)[0]
  return {jax.tree_util.keystr(path): type(leaf).__name__ for path, leaf in flat}


def _filter_name(wrt: Any) -> str:
  """An NNX filter as written in code: ``nnx.Param`` rather than the class's repr."""
  if isinstance(wrt, type) and wrt.__module__.startswith("flax.nnx"):
    return f"nnx.{wrt.__name__}"
  return repr(wrt)


def _check_params_match_wrt(params: Any, split_params: Any, wrt: Any, helper: str) -> None:
  """Raises where the transform's params are not the ``wrt`` variables the helper split off.

  ``nnx.Optimizer(model, tx, wrt=...)`` hands the transform its own ``wrt``'s variables;
  a helper given another filter (the default ``nnx.Param`` where the optimizer has
  ``wrt=nnx.LoRAParam``) split the model differently, and ``nnx.merge`` would fail with
  a leaf count that names neither.
  """
  given, split = _variable_paths(params), _variable_paths(split_params)
  if len(given) == len(split):  # nnx.merge reads the leaves in order: only their number matters
    return
  missing = [f"{path} ({split[path]})" for path in split if path not in given]
  extra = [f"{path} ({given[path]})" for path in given if path not in split]
  found = "; ".join(
    f"{label}: {', '.join(paths[:4])}{' ...' if len(paths) > 4 else ''}"
    for label, paths in (("split but not given", missing), ("given but not split", extra))
    if paths
  )
  raise ValueError(
    f"{helper} split the model's parameters with wrt={_filter_name(wrt)} ({len(split)} "
    f"variables), but the "
    f"transform was given params of {len(given)} ({found}). Pass {helper} the wrt of the "
    f"nnx.Optimizer, the filter of what it updates: {helper}(loss_fn, model, ..., "
    "wrt=nnx.LoRAParam) for nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)."
  )


def _check_nnx_arguments(loss_fn: Any, model: Any) -> None:
  """The loss is callable and the model an NNX object, each named in the error."""
  if not callable(loss_fn):
    raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
  if not isinstance(model, nnx.Pytree):
    raise TypeError(
      "model must be an NNX object (the nnx.Module the optimizer updates), got "
      f"{type(model).__name__}. Linen and plain-JAX steps pass their own params -> loss "
      "function as loss_fn."
    )


def _check_microbatch_call(loss_fn: Callable[..., Any], args: tuple) -> None:
  """``loss_fn`` takes ``(model, microbatch, *args)``, as :func:`nnx_microbatch_loss_fn` calls it."""
  problem = call_form_error(loss_fn, 2 + len(args))
  if problem is None:
    return
  extra = ["key"] if len(args) == 1 else [f"arg{i}" for i in range(len(args))]
  call = ", ".join(["model", "microbatch", *extra])
  raise TypeError(
    f"nnx_microbatch_loss_fn's loss calls loss_fn({call}) once per micro-batch: a copy of the "
    "model, the micro-batch of batch= (its int32 index without batch=) and, with key=, the "
    f"micro-batch's PRNG key. loss_fn does not take these arguments ({problem}). Define "
    "loss_fn(model, microbatch), or loss_fn(model, microbatch, key) with key=, returning the "
    "loss of one micro-batch; a loss that closes over its batch goes with nnx_loss_fn, in a "
    "step without micro-batches."
  )


def nnx_loss_fn(
  loss_fn: Callable[..., Any],
  model: nnx.Module,
  /,
  *args: Any,
  wrt: Any = nnx.Param,
  **kwargs: Any,
) -> Callable[[Any], Any]:
  """An NNX loss ``loss_fn(model, *args, **kwargs)`` as the ``loss_fn`` GSAM calls.

  The transform calls ``loss_fn`` with the pure parameter state (what
  ``nnx.Optimizer.update`` passes it as ``params``), not with a model, and it
  calls it inside its own ``jax.value_and_grad``, a different trace level from
  the train step's. This helper snapshots everything the perturbed pass needs
  as graph definitions and pure arrays: ``model`` minus its ``wrt`` variables
  (batch statistics, RNG keys and counters) and every NNX object among
  ``args``/``kwargs`` (an ``nnx.Rngs`` passed to the model call, as in Flax's
  MNIST tutorial). The returned function rebuilds fresh copies from the
  snapshot with ``nnx.merge`` and the parameters it is given, then calls
  ``loss_fn``. So:

  * call it *before* the clean pass: the perturbed pass then starts from the
    RNG state the clean pass started from and draws the same dropout masks;
  * the perturbed pass mutates only the copies: the RNG counters advance once
    per step (by the clean pass) and batch statistics come from the clean pass
    only, exactly as in a step without GSAM;
  * it works under ``nnx.jit`` and with RNG state inside the model or passed
    as an argument. Mutating the original objects from the transform's trace
    (``nnx.clone(rngs)``, ``rngs.fork()`` or a bare ``nnx.split(rngs)``)
    fails with Flax's ``TraceContextError``.

  Other arguments (arrays, batches, Python values) are passed through as
  they are. Whatever ``loss_fn`` returns is returned: a scalar, or a
  ``(loss, aux)`` pair whose aux the transform drops.

  Args:
    loss_fn: ``loss_fn(model, *args, **kwargs)``, the loss of the train step
      (the function given to ``nnx.value_and_grad``).
    model: the ``nnx.Module`` whose parameters the optimizer updates.
    *args: the other positional arguments of ``loss_fn``, as in the clean pass.
    wrt: the filter of the parameters, the ``wrt`` of the ``nnx.Optimizer``
      (default ``nnx.Param``).
    **kwargs: the keyword arguments of ``loss_fn``.

  Returns:
    ``f(params) -> loss_fn(model_with_params, *args, **kwargs)``, to pass as
    ``optimizer.update(model, grads, loss_fn=f, value=loss)``.

  Raises:
    TypeError: when ``loss_fn`` is not callable or ``model`` is not an NNX
      object (a params pytree, say).
    ValueError: from the returned function, at trace time, when the snapshot
      was taken after the clean pass: the loss mutates state that is not a
      parameter (RNG counters, batch statistics, a variable of your own), and
      the model still holds the snapshot's values there. The message names
      each such variable by path and type.

  Example:
    >>> import jax.numpy as jnp, optax, optax_gsam
    >>> from flax import nnx
    >>> from optax_gsam.flax import nnx_loss_fn
    >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    >>> tx = optax.chain(optax_gsam.gsam(rho=0.05, alpha=0.3), optax.sgd(0.1))
    >>> optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    >>> def loss_fn(model, x, y):
    ...   return jnp.mean((model(x) - y) ** 2)
    >>> @nnx.jit
    ... def train_step(model, optimizer, x, y):
    ...   perturbed_loss = nnx_loss_fn(loss_fn, model, x, y)  # before the clean pass
    ...   loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    ...   optimizer.update(model, grads, loss_fn=perturbed_loss, value=loss)
    ...   return loss
    >>> loss = train_step(model, optimizer, jnp.ones((4, 3)), jnp.zeros((4, 1)))
    >>> int(optimizer.step[...])
    1
  """
  _check_nnx_arguments(loss_fn, model)
  leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=_is_nnx_node)
  node_at = [i for i, leaf in enumerate(leaves) if _is_nnx_node(leaf)]
  # Split the model and the NNX arguments together, so state they share stays shared.
  in_wrt = nnx.filterlib.to_predicate(wrt)

  def is_param(path, value):
    return path[0] == 0 and in_wrt(path[1:], value)

  originals = (model, [leaves[i] for i in node_at])
  graphdef, split_params, *others = nnx.split(originals, is_param, ...)
  # Pure arrays: nnx.merge makes new Variables at the trace level of the call.
  rest = nnx.as_pure(others[0])

  def perturbed_loss_fn(params):
    _check_params_match_wrt(params, split_params[0], wrt, "nnx_loss_fn")
    copy, nodes = nnx.merge(graphdef, nnx.State({0: params}), rest)
    call_leaves = list(leaves)
    for i, node in zip(node_at, nodes, strict=True):
      call_leaves[i] = node
    call_args, call_kwargs = jax.tree.unflatten(treedef, call_leaves)
    output = loss_fn(copy, *call_args, **call_kwargs)
    _check_snapshot_precedes_clean_pass(params, rest, (copy, nodes), originals, is_param)
    return output

  return perturbed_loss_fn


def nnx_microbatch_loss_fn(
  loss_fn: Callable[..., Any], model: nnx.Module, /, *, wrt: Any = nnx.Param
) -> tuple[Callable[..., tuple[Any, Any]], Any, Any]:
  """An NNX loss ``loss_fn(model, microbatch, ...)`` as a stateful loss of micro-batches.

  Splits ``model`` into its ``wrt`` parameters :math:`w` and the rest of its
  state :math:`s` (BatchNorm statistics, RNG keys and counters), and returns
  ``f(params, model_state, microbatch, *args) -> (loss, new_model_state)``,
  which rebuilds a copy of the model from both (``nnx.merge``), calls
  ``loss_fn(copy, microbatch, *args)`` and returns the copy's state after the
  call. With it, :func:`optax_gsam.accumulate_value_and_grad` runs the clean
  pass, the state passing through the micro-batches as through k small steps
  (each micro-batch draws the next dropout masks and is normalized with its own
  statistics), and the transform's perturbed pass starts again from :math:`s`,
  so micro-batch i draws the same masks in both passes. ``params`` keep their
  ``nnx.Param`` types, so the gradients are what ``nnx.Optimizer.update``
  takes::

    f, params, model_state = nnx_microbatch_loss_fn(loss_fn, model)
    (loss, new_state), grads = optax_gsam.accumulate_value_and_grad(
      f, params, batch, microbatches=k, model_state=model_state)
    optimizer.update(model, grads, loss_fn=f, batch=batch, model_state=model_state, value=loss)
    nnx.update(model, new_state)

  Args:
    loss_fn: ``loss_fn(model, microbatch, *args)``, returning a scalar loss or
      ``(loss, aux)`` (aux dropped).
    model: the ``nnx.Module`` whose parameters the optimizer updates.
    wrt: the filter of the parameters, the ``wrt`` of the ``nnx.Optimizer``.

  Returns:
    ``(f, params, model_state)``: the stateful loss, the ``wrt`` state of
    ``model`` and the pure arrays of the rest of its state.

  Raises:
    TypeError: when ``loss_fn`` is not callable or ``model`` is not an NNX object;
      from the returned function, when ``loss_fn`` cannot take ``(model,
      microbatch[, key])``.

  Example:
    >>> import jax.numpy as jnp, optax, optax_gsam
    >>> from flax import nnx
    >>> from optax_gsam.flax import nnx_microbatch_loss_fn
    >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    >>> tx = optax.chain(optax_gsam.sam(0.05, microbatches=2), optax.sgd(0.1))
    >>> optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    >>> def loss_fn(model, microbatch):
    ...   return jnp.mean(model(microbatch) ** 2)
    >>> @nnx.jit
    ... def train_step(model, optimizer, batch):
    ...   f, params, model_state = nnx_microbatch_loss_fn(loss_fn, model)
    ...   (loss, new_state), grads = optax_gsam.accumulate_value_and_grad(
    ...     f, params, batch, microbatches=2, model_state=model_state)
    ...   optimizer.update(model, grads, loss_fn=f, batch=batch, model_state=model_state)
    ...   nnx.update(model, new_state)
    ...   return loss
    >>> loss = train_step(model, optimizer, jnp.ones((4, 3)))
    >>> int(optimizer.step[...])
    1
  """
  _check_nnx_arguments(loss_fn, model)
  graphdef, split_params, *others = nnx.split(model, wrt, ...)

  def stateful_loss_fn(params: Any, model_state: Any, microbatch: Any, *args: Any):
    _check_microbatch_call(loss_fn, args)
    _check_params_match_wrt(params, split_params, wrt, "nnx_microbatch_loss_fn")
    copy = nnx.merge(graphdef, params, model_state)
    output = loss_fn(copy, microbatch, *args)
    loss = output[0] if isinstance(output, (tuple, list)) else output
    _, _, *new = nnx.split(copy, wrt, ...)
    return loss, nnx.as_pure(new[0])

  return stateful_loss_fn, split_params, nnx.as_pure(others[0])
