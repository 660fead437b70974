"""Type aliases of optax_gsam's public signatures.

The arguments of :func:`optax_gsam.gsam`, :func:`optax_gsam.cached_value_and_grad`
and the contrastive losses are annotated with these names, so that code calling
them can be annotated with the same ones:

>>> import optax_gsam
>>> from optax_gsam.typing import Adaptive
>>> def make_tx(kind: Adaptive = None):
...   ascent = None if kind is None else optax_gsam.adaptive_ascent(kind)
...   return optax_gsam.gsam(rho=0.05, alpha=0.3, ascent=ascent)
>>> tx = make_tx("asam")
"""

from collections.abc import Callable
from collections.abc import Hashable
from typing import Any
from typing import Literal
from typing import TypeAlias

import jax
import optax

__all__ = ("Adaptive", "AxisName", "DecideFn", "EmbedFn", "EmbeddingLossFn")

Adaptive: TypeAlias = Literal["gsam", "asam"] | None
"""Which adaptive perturbation :func:`optax_gsam.adaptive_ascent` and
:func:`optax_gsam.perturbation` use, ``"gsam"`` (the GSAM
paper's ``|w|`` scaling) or ``"asam"`` (ASAM's), or ``None`` for the plain one."""

AxisName: TypeAlias = Hashable | tuple[Hashable, ...] | None
"""A data-parallel axis name as ``jax.lax.pmean`` takes it (one name or a tuple
of names), or ``None`` on a single device."""

# The jax and optax names are forward references: the docs then show them by their public names
# (evaluated, jax.Array prints as jaxlib._jax.Array and optax.Params as its expansion).
DecideFn: TypeAlias = Callable[
  [Any, "jax.Array", "jax.Array | None"], tuple["jax.Array | bool", Any]
]
"""The ``decide`` field of a :class:`optax_gsam.SharpnessPolicy`:
``(policy_state, count, grad_sq_norm) -> (due, new_policy_state)``, where
``grad_sq_norm`` is :math:`\\|g_c\\|^2` or ``None`` and ``due`` says whether the
full step is taken."""

EmbedFn: TypeAlias = Callable[..., Any]
"""An embedding function of :func:`optax_gsam.cached_value_and_grad`:
``embed_fn(params, chunk)`` or, with a key, ``embed_fn(params, chunk, key)``,
returning a pytree of per-example representations."""

EmbeddingLossFn: TypeAlias = Callable[["optax.Params", Any], Any]
"""The loss of :func:`optax_gsam.cached_value_and_grad`:
``loss_fn(params, representations)``, a scalar or ``(loss, aux)`` with
``has_aux=True``."""
