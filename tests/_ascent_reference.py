"""Float64 references of replicated GSAM and SAM with any ascent direction, from the formulas.

Numpy only, with the problem's hand-written gradient: nothing here goes through
the package or JAX's autodiff. A *replica* is a device or a micro-batch
perturbed along its own gradient; :func:`reference_run` averages their outputs
and their direction states, as per-device and per-micro-batch perturbation do.

Everything the transform can vary is a parameter of :func:`reference_run`: the
method (``alpha``: GSAM's weight, 0 for SAM), the direction, the number of
ascent steps, the mask and the replicas. A new direction is one entry of
:data:`DIRECTIONS`: its numpy formula and the ``gsam``/``sam`` keywords that
select it; tests/test_ascent.py then checks it in every layout.
"""

import jax.numpy as jnp
import numpy as np

import optax_gsam

NUM_DEVICES, PER_DEVICE = 8, 4
RHO, ALPHA, LR = 0.15, 0.4, 0.1
SIGMA, DECAY, THETA = 0.8, 0.7, 0.4


def make_data(seed=0, d=5, k=3, n=NUM_DEVICES * PER_DEVICE):
  rng = np.random.default_rng(seed)
  x, t = rng.normal(size=(n, d)), rng.normal(size=(n, k))
  params = {"b": rng.normal(size=(k,)) * 0.3, "w": rng.normal(size=(d, k)) * 0.7}
  return params, x, t


def loss_jax(p, x, t):
  z = x @ p["w"] + p["b"]
  return jnp.mean(jnp.logaddexp(0.0, z) * t) + 0.25 * jnp.sum(p["w"] ** 4)


def grad_np(vec, x, t, k=3):
  """The gradient of ``loss_jax`` at the flat vector [b, w], by hand."""
  b, w = vec[:k], vec[k:].reshape(-1, k)
  z = x @ w + b
  s = t / (1.0 + np.exp(-z)) / z.size
  return np.concatenate([s.sum(axis=0), (x.T @ s + w**3).ravel()])


def flat(tree):
  return np.concatenate([np.ravel(tree["b"]), np.ravel(tree["w"])])


# Each reference direction: (gradient, state, weights) -> (unit direction, state), numpy.
def sam_dir(g, s, w):
  return g / np.linalg.norm(g), s


def gsam_adaptive_dir(g, s, w):
  return np.abs(w) * g / np.linalg.norm(g), s


def asam_dir(g, s, w):
  return w**2 * g / np.linalg.norm(np.abs(w) * g), s


def friendly_dir(g, m, w):
  m = DECAY * m + (1 - DECAY) * g
  d = g - SIGMA * m
  return d / np.linalg.norm(d), m


def vasso_dir(g, d, w):
  d = (1 - THETA) * d + THETA * g
  return d / np.linalg.norm(d), d


# name -> (the numpy formula, the keywords of gsam/sam that select the direction).
DIRECTIONS = {
  "sam": (sam_dir, dict()),
  "gsam-adaptive": (gsam_adaptive_dir, dict(ascent=optax_gsam.adaptive_ascent("gsam"))),
  "asam": (asam_dir, dict(ascent=optax_gsam.adaptive_ascent("asam"))),
  "friendly": (friendly_dir, dict(ascent=optax_gsam.friendly_ascent(SIGMA, DECAY))),
  "vasso": (vasso_dir, dict(ascent=optax_gsam.vasso_ascent(THETA))),
}

# method -> alpha, the weight of GSAM's surrogate-gap term (SAM: g = g_p).
METHODS = {"gsam": ALPHA, "sam": 0.0}


def reference_output(w, x, t, direction, state, steps=1, mask=None, alpha=ALPHA):
  """One replica's GSAM gradient (minimize_fp) after ``steps`` ascent steps, and its state.

  ``alpha=0`` is SAM: the output is :math:`g_p`, the gradient at the perturbed point.

  The direction's state advances once, from the clean gradient; every ascent
  step applies the direction at the state of the step's start.
  """
  mask = np.ones_like(w) if mask is None else mask
  g_c = grad_np(w, x, t)
  epsilon, g = np.zeros_like(w), g_c
  _, next_state = direction(g_c * mask, state, w)
  for _ in range(steps):
    unit, _ = direction(g * mask, state, w)
    epsilon = epsilon + RHO / steps * unit * mask
    g = grad_np(w + epsilon, x, t)
  g_p = g
  if alpha == 0:
    return g_p, next_state
  return g_p - alpha * (g_c - g_c @ g_p / (g_p @ g_p) * g_p), next_state


def reference_run(params, x, t, direction, steps=1, mask=None, shards=1, num_steps=3, alpha=ALPHA):
  """``num_steps`` SGD steps of per-replica GSAM (SAM at ``alpha=0``), states averaged.

  ``shards`` replicas split the batch in equal parts (1: the whole batch);
  ``mask`` is a 0/1 vector over the flat params (``None``: every entry).
  """
  w, state = flat(params), np.zeros(flat(params).size)
  size = len(x) // shards
  for _ in range(num_steps):
    outs, states = [], []
    for i in range(shards):
      part = slice(i * size, (i + 1) * size)
      out, new = reference_output(w, x[part], t[part], direction, state, steps, mask, alpha)
      outs.append(out)
      states.append(new)
    state = np.mean(states, axis=0)
    w = w - LR * np.mean(outs, axis=0)
  return w
