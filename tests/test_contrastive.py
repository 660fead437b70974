"""clip_loss/siglip_loss, dense and tiled, against float64 references written from the formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_gsam


def reference_clip(x, y, t):
  """Symmetric InfoNCE, the B x B matrix in full (CLIP paper, Fig. 3 pseudocode)."""
  logits = jnp.exp(t) * x @ y.T
  labels = jnp.arange(x.shape[0])
  log_p_rows = logits - jax.scipy.special.logsumexp(logits, axis=1, keepdims=True)
  log_p_cols = logits - jax.scipy.special.logsumexp(logits, axis=0, keepdims=True)
  return -0.5 * (jnp.mean(log_p_rows[labels, labels]) + jnp.mean(log_p_cols[labels, labels]))


def reference_siglip(x, y, t, b):
  """-1/B sum_ij log sigmoid(z_ij (e^t x_i.y_j + b)), z = 2 I - 1 (SigLIP paper, Alg. 1)."""
  logits = jnp.exp(t) * x @ y.T + b
  z = 2.0 * jnp.eye(x.shape[0]) - 1.0
  return -jnp.sum(jnp.log(jax.nn.sigmoid(z * logits))) / x.shape[0]


def make_pairs(batch, dim=6, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(batch, dim))
  y = x + 0.7 * rng.normal(size=(batch, dim))
  x /= np.linalg.norm(x, axis=1, keepdims=True)
  y /= np.linalg.norm(y, axis=1, keepdims=True)
  return x, y


def package_loss(kind, tile_size, axis_name=None):
  if kind == "clip":
    return lambda x, y, s: optax_gsam.clip_loss(
      x, y, s[0], tile_size=tile_size, axis_name=axis_name
    )
  return lambda x, y, s: optax_gsam.siglip_loss(
    x, y, s[0], s[1], tile_size=tile_size, axis_name=axis_name
  )


def reference_loss(kind):
  if kind == "clip":
    return lambda x, y, s: reference_clip(x, y, s[0])
  return lambda x, y, s: reference_siglip(x, y, s[0], s[1])


CASES = [
  dict(kind=kind, batch=batch, tile_size=tile)
  for kind in ("clip", "siglip")
  for batch, tile in [(13, None), (13, 1), (13, 4), (13, 32), (16, 8)]
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_matches_float64_reference(case):
  with jax.enable_x64(True):
    x, y = make_pairs(case["batch"])
    scalars = jnp.array([np.log(8.0), -3.0])
    args = (jnp.asarray(x), jnp.asarray(y), scalars)
    value, grads = jax.jit(
      jax.value_and_grad(package_loss(case["kind"], case["tile_size"]), (0, 1, 2))
    )(*args)
    ref_value, ref_grads = jax.jit(jax.value_and_grad(reference_loss(case["kind"]), (0, 1, 2)))(
      *args
    )
    assert value.dtype == jnp.float64
    np.testing.assert_allclose(value, ref_value, rtol=1e-12)
    for g, r in zip(grads, ref_grads, strict=True):
      np.testing.assert_allclose(g, r, rtol=1e-10, atol=1e-14)


def test_tiled_clip_is_stable_for_large_logits():
  # Logit scale e^5 ~ 148: exp() of the raw logits would overflow float32.
  x, y = (jnp.asarray(a, jnp.float32) for a in make_pairs(40, seed=3))
  tiled = jax.value_and_grad(lambda x, y, t: optax_gsam.clip_loss(x, y, t, tile_size=7), (0, 1, 2))
  value, grads = jax.jit(tiled)(x, y, jnp.float32(5.0))
  with jax.enable_x64(True):
    ref_value, ref_grads = jax.jit(jax.value_and_grad(reference_clip, (0, 1, 2)))(
      x.astype(jnp.float64), y.astype(jnp.float64), jnp.float64(5.0)
    )
  assert np.isfinite(value)
  np.testing.assert_allclose(value, ref_value, rtol=1e-4)
  for g, r in zip(grads, ref_grads, strict=True):
    np.testing.assert_allclose(g, r, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("kind", ["clip", "siglip"])
@pytest.mark.parametrize("tile_size", [None, 2])
def test_axis_name_gives_global_batch_loss(kind, tile_size):
  num_devices, local = 8, 3
  mesh = jax.make_mesh((num_devices,), ("data",))
  with jax.enable_x64(True):
    x, y = make_pairs(num_devices * local, seed=4)
    scalars = jnp.array([np.log(5.0), -2.0])
    loss = package_loss(kind, tile_size, axis_name="data")

    def per_device(x, y, s):
      return jax.value_and_grad(loss, (0, 1, 2))(x, y, s)

    sharded = NamedSharding(mesh, P("data"))
    replicated = NamedSharding(mesh, P())
    fn = jax.jit(
      jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(P("data"), P("data"), P()),
        out_specs=(P(), (P("data"), P("data"), P())),
      )
    )
    value, grads = fn(
      jax.device_put(jnp.asarray(x), sharded),
      jax.device_put(jnp.asarray(y), sharded),
      jax.device_put(scalars, replicated),
    )
    ref_value, ref_grads = jax.jit(jax.value_and_grad(reference_loss(kind), (0, 1, 2)))(
      jnp.asarray(x), jnp.asarray(y), scalars
    )
    np.testing.assert_allclose(value, ref_value, rtol=1e-12)
    for g, r in zip(grads, ref_grads, strict=True):
      np.testing.assert_allclose(g, r, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_tiled_memory_is_linear_in_batch(kind):
  batch, dim, tile = 2048, 16, 64
  x = jax.ShapeDtypeStruct((batch, dim), jnp.float32)
  s = jax.ShapeDtypeStruct((2,), jnp.float32)

  def temp_bytes(tile_size):
    fn = jax.jit(jax.grad(package_loss(kind, tile_size), (0, 1, 2)))
    return fn.lower(x, x, s).compile().memory_analysis().temp_size_in_bytes

  dense, tiled = temp_bytes(None), temp_bytes(tile)
  assert dense >= batch * batch * 4  # at least one B x B float32 matrix
  assert tiled < 8 * tile * batch * 4 + 16 * batch * dim * 4, (dense, tiled)
  assert tiled < dense / 4


def test_bfloat16_inputs_give_float32_loss():
  x, y = (jnp.asarray(a, jnp.bfloat16) for a in make_pairs(8))
  assert optax_gsam.clip_loss(x, y, 1.0, tile_size=3).dtype == jnp.float32
  assert optax_gsam.siglip_loss(x, y, 1.0, 0.0, tile_size=3).dtype == jnp.float32


@pytest.mark.parametrize(
  "call, match",
  [
    (lambda x: optax_gsam.clip_loss(x, x, 1.0, tile_size=0), "tile_size"),
    (lambda x: optax_gsam.siglip_loss(x, x, 1.0, 0.0, tile_size=2.5), "tile_size"),
    (lambda x: optax_gsam.clip_loss(x, x[:3], 1.0), "same shape"),
    (lambda x: optax_gsam.clip_loss(x[0], x[0], 1.0), "image_embeddings"),
    (lambda x: optax_gsam.clip_loss(x, x, jnp.ones(2)), "logit_scale"),
    (lambda x: optax_gsam.siglip_loss(x, x, 1.0, jnp.ones(2)), "logit_bias"),
  ],
)
def test_invalid_arguments_raise(call, match):
  with pytest.raises(ValueError, match=match):
    call(jnp.ones((4, 3)))
