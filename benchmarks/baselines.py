"""The reference steps the benchmarks measure the package against, built one way everywhere."""

from __future__ import annotations

import optax


def contrib_sam(base: optax.GradientTransformation, rho: float) -> optax.GradientTransformation:
  """``optax.contrib.sam`` in opaque mode: its adversary is the normalized gradient times rho.

  Its ``update`` takes ``grad_fn=`` (params, step) -> gradient, as the scripts call it.
  """
  adversary = optax.chain(optax.contrib.normalize(), optax.sgd(rho))
  return optax.contrib.sam(base, adversary, opaque_mode=True)
