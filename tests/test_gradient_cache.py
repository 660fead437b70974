"""cached_value_and_grad against full-batch autodiff of losses written here with plain jnp."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_gsam


def mlp(p, x):
  return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]


def normalize(z):
  return z / jnp.linalg.norm(z, axis=-1, keepdims=True)


def embed_two_towers(params, batch):
  """Two towers (image, text) in one function: two leaves of one pytree."""
  return {
    "image": normalize(mlp(params["image"], batch["image"])),
    "text": normalize(mlp(params["text"], batch["text"])),
  }


def clip_reference(params, reps):
  """Symmetric InfoNCE with a learnable temperature, the B x B matrix in full."""
  logits = jnp.exp(params["t"]) * reps["image"] @ reps["text"].T
  diagonal = jnp.diagonal(logits)
  rows = jax.scipy.special.logsumexp(logits, axis=1) - diagonal
  cols = jax.scipy.special.logsumexp(logits, axis=0) - diagonal
  return 0.5 * (jnp.mean(rows) + jnp.mean(cols))


def make_params(seed=0, dtype=jnp.float64, image_dim=7, text_dim=5, hidden=9, out=4):
  rng = np.random.default_rng(seed)

  def tower(d):
    return {
      "w1": jnp.asarray(rng.normal(size=(d, hidden)) / np.sqrt(d), dtype),
      "b1": jnp.asarray(rng.normal(size=(hidden,)) * 0.1, dtype),
      "w2": jnp.asarray(rng.normal(size=(hidden, out)) / np.sqrt(hidden), dtype),
    }

  return {"image": tower(image_dim), "text": tower(text_dim), "t": jnp.asarray(np.log(4.0), dtype)}


def make_batch(size, seed=1, dtype=jnp.float64, image_dim=7, text_dim=5):
  rng = np.random.default_rng(seed)
  return {
    "image": jnp.asarray(rng.normal(size=(size, image_dim)), dtype),
    "text": jnp.asarray(rng.normal(size=(size, text_dim)), dtype),
  }


def full_batch(params, batch, loss=clip_reference, embed=embed_two_towers, has_aux=False):
  """The reference: one autodiff graph over the whole batch."""
  fn = jax.value_and_grad(lambda p, b: loss(p, embed(p, b)), has_aux=has_aux)
  return jax.jit(fn)(params, batch)


def assert_trees_close(actual, expected, rtol=1e-10, atol=1e-14):
  chex.assert_trees_all_close(actual, expected, rtol=rtol, atol=atol)


def packaged_clip(tile_size):
  return lambda p, r: optax_gsam.clip_loss(r["image"], r["text"], p["t"], tile_size=tile_size)


CASES = [
  dict(batch=16, chunk=4, loss="reference"),
  dict(batch=16, chunk=16, loss="reference"),
  dict(batch=13, chunk=4, loss="reference"),
  dict(batch=13, chunk=1, loss="reference"),
  dict(batch=8, chunk=8, loss="reference"),
  dict(batch=13, chunk=5, loss="tiled"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_matches_full_batch_autodiff_float64(case):
  with jax.enable_x64(True):
    params, batch = make_params(), make_batch(case["batch"])
    loss = clip_reference if case["loss"] == "reference" else packaged_clip(tile_size=3)
    fn = optax_gsam.cached_value_and_grad(embed_two_towers, loss, chunk_size=case["chunk"])
    value, grads = jax.jit(fn)(params, batch)
    ref_value, ref_grads = full_batch(params, batch)
    np.testing.assert_allclose(value, ref_value, rtol=1e-12)
    assert_trees_close(grads, ref_grads)
    assert abs(float(grads["t"])) > 1e-6  # the loss-only parameter gets its gradient
    assert jax.tree.map(lambda g: g.dtype, grads) == jax.tree.map(lambda p: p.dtype, params)


def test_has_aux_returns_the_aux_of_the_whole_batch():
  def loss(p, reps):
    return clip_reference(p, reps), {"reps": reps, "scale": jnp.exp(p["t"])}

  with jax.enable_x64(True):
    params, batch = make_params(), make_batch(11)
    fn = optax_gsam.cached_value_and_grad(embed_two_towers, loss, chunk_size=3, has_aux=True)
    (value, aux), grads = jax.jit(fn)(params, batch)
    (ref_value, ref_aux), ref_grads = full_batch(params, batch, loss=loss, has_aux=True)
    np.testing.assert_allclose(value, ref_value, rtol=1e-12)
    assert_trees_close(aux, ref_aux)
    assert_trees_close(grads, ref_grads)


def test_towers_with_their_own_chunk_sizes_and_example_counts():
  # Dense retrieval: each query has 3 passages (1 positive, 2 hard negatives).
  towers = {
    "query": lambda p, x: normalize(mlp(p["image"], x)),
    "passage": lambda p, x: normalize(mlp(p["text"], x)),
  }

  def retrieval_loss(p, reps):
    logits = jnp.exp(p["t"]) * reps["query"] @ reps["passage"].T
    positives = 3 * jnp.arange(logits.shape[0])
    return jnp.mean(
      jax.scipy.special.logsumexp(logits, axis=1) - logits[jnp.arange(logits.shape[0]), positives]
    )

  with jax.enable_x64(True):
    params = make_params()
    rng = np.random.default_rng(5)
    batch = {
      "query": jnp.asarray(rng.normal(size=(7, 7))),
      "passage": jnp.asarray(rng.normal(size=(21, 5))),
    }

    def embed_all(p, b):
      return {name: f(p, b[name]) for name, f in towers.items()}

    ref_value, ref_grads = full_batch(params, batch, loss=retrieval_loss, embed=embed_all)
    for chunk_size in ({"query": 2, "passage": 8}, 4):
      fn = optax_gsam.cached_value_and_grad(towers, retrieval_loss, chunk_size=chunk_size)
      value, grads = jax.jit(fn)(params, batch)
      np.testing.assert_allclose(value, ref_value, rtol=1e-12)
      assert_trees_close(grads, ref_grads)


# Dropout. Integer-valued data and weights keep every sum exact in float32, so
# equality with the reference is bitwise and any key mismatch between the
# forward pass and the backward re-computation changes the gradient.


def integer_problem(size=13, seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.integers(-1, 2, size=(size, 6)), jnp.float32)
  params = {"w": jnp.asarray(rng.integers(-1, 2, size=(6, 3)), jnp.float32), "s": jnp.float32(1.0)}
  return params, x


def dropout_embed(p, x, key):
  mask = jax.random.bernoulli(key, 0.5, x.shape)
  return jnp.where(mask, x, 0.0) @ p["w"]


def per_example_dropout_embed(p, x, keys):
  return jax.vmap(lambda xi, ki: dropout_embed(p, xi, ki))(x, keys)


def coupled_loss(p, reps):
  """Couples the examples, so the loss gradient depends on every forward representation."""
  gram = reps @ reps.T
  return 0.5 * p["s"] * jnp.sum(gram * gram[::-1]), reps


@pytest.mark.parametrize("chunk_size", [4, 5, 13])
def test_dropout_keys_are_replayed_bitwise(chunk_size):
  params, x = integer_problem()
  key = jax.random.key(42)
  fn = optax_gsam.cached_value_and_grad(
    dropout_embed, coupled_loss, chunk_size=chunk_size, has_aux=True
  )
  (value, reps), grads = jax.jit(fn)(params, x, key)

  # Reference: the documented keys, fold_in(key, chunk number), one full-batch graph.
  def embed_with_chunk_keys(p, x):
    starts = range(0, x.shape[0], chunk_size)
    return jnp.concatenate(
      [
        dropout_embed(p, x[s : s + chunk_size], jax.random.fold_in(key, i))
        for i, s in enumerate(starts)
      ]
    )

  (ref_value, ref_reps), ref_grads = full_batch(
    params, x, loss=coupled_loss, embed=embed_with_chunk_keys, has_aux=True
  )
  np.testing.assert_array_equal(reps, ref_reps)
  np.testing.assert_array_equal(value, ref_value)
  jax.tree.map(np.testing.assert_array_equal, grads, ref_grads)
  # The masks matter: another key gives another gradient.
  _, other = jax.jit(fn)(params, x, jax.random.key(7))
  assert not np.array_equal(other["w"], grads["w"])


def test_per_example_keys_do_not_depend_on_chunk_size():
  params, x = integer_problem()
  key = jax.random.key(3)
  keys = jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.arange(x.shape[0]))
  (_, ref_reps), ref_grads = full_batch(
    params,
    x,
    loss=coupled_loss,
    embed=lambda p, b: per_example_dropout_embed(p, b, keys),
    has_aux=True,
  )
  for chunk_size in (1, 4, 13):
    fn = optax_gsam.cached_value_and_grad(
      per_example_dropout_embed,
      coupled_loss,
      chunk_size=chunk_size,
      has_aux=True,
      per_example_keys=True,
    )
    (_, reps), grads = jax.jit(fn)(params, x, key)
    np.testing.assert_array_equal(reps, ref_reps)
    jax.tree.map(np.testing.assert_array_equal, grads, ref_grads)


def test_bfloat16_params_accumulate_in_float32():
  # 512 chunks each contribute 2.0 to the gradient of w. Summed in bfloat16
  # the total stalls at 512 (512 + 2 rounds back to 512); in float32 it is 1024.
  params = {"w": jnp.ones((1,), jnp.bfloat16)}
  x = jnp.ones((1024, 1), jnp.bfloat16)
  fn = optax_gsam.cached_value_and_grad(
    lambda p, x: x * p["w"], lambda p, r: jnp.sum(r.astype(jnp.float32)), chunk_size=2
  )
  _, grads = jax.jit(fn)(params, x)
  assert grads["w"].dtype == jnp.bfloat16
  assert float(grads["w"][0]) == 1024.0


def test_bfloat16_two_tower_model_is_close_to_float64():
  with jax.enable_x64(True):
    params64, batch64 = make_params(), make_batch(32)
    _, ref_grads = full_batch(params64, batch64)
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params64)
  batch = jax.tree.map(lambda b: b.astype(jnp.bfloat16), batch64)
  fn = optax_gsam.cached_value_and_grad(embed_two_towers, packaged_clip(8), chunk_size=4)
  _, grads = jax.jit(fn)(params, batch)
  flat = [np.asarray(g, np.float64).ravel() for g in jax.tree.leaves(grads)]
  ref_flat = [np.asarray(r).ravel() for r in jax.tree.leaves(ref_grads)]
  error = np.linalg.norm(np.concatenate(flat) - np.concatenate(ref_flat))
  assert error < 0.05 * np.linalg.norm(np.concatenate(ref_flat))


@pytest.mark.parametrize("tiled", [False, True])
def test_axis_name_equals_single_device_global_batch(tiled):
  num_devices, local = 8, 5
  mesh = jax.make_mesh((num_devices,), ("data",))
  loss = packaged_clip(2) if tiled else clip_reference
  with jax.enable_x64(True):
    params, batch = make_params(), make_batch(num_devices * local)
    fn = optax_gsam.cached_value_and_grad(embed_two_towers, loss, chunk_size=2, axis_name="data")
    sharded = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P())))
    value, grads = sharded(
      jax.device_put(params, NamedSharding(mesh, P())),
      jax.device_put(batch, NamedSharding(mesh, P("data"))),
    )
    ref_value, ref_grads = full_batch(params, batch)
    np.testing.assert_allclose(value, ref_value, rtol=1e-12)
    assert_trees_close(grads, ref_grads)


def test_axis_name_per_example_keys_under_pmap_equal_single_device():
  num_devices, local = 8, 2
  params, x = integer_problem(size=num_devices * local, seed=2)
  key = jax.random.key(11)
  kwargs = dict(chunk_size=1, has_aux=True, per_example_keys=True)
  single = optax_gsam.cached_value_and_grad(per_example_dropout_embed, coupled_loss, **kwargs)
  (ref_value, _), ref_grads = single(params, x, key)
  sharded = optax_gsam.cached_value_and_grad(
    per_example_dropout_embed, coupled_loss, axis_name="data", **kwargs
  )
  (value, _), grads = jax.pmap(sharded, axis_name="data", in_axes=(None, 0, None))(
    params, x.reshape(num_devices, local, -1), key
  )
  np.testing.assert_array_equal(value, np.full(num_devices, ref_value))
  jax.tree.map(
    lambda g, r: np.testing.assert_array_equal(g, np.broadcast_to(r, g.shape)), grads, ref_grads
  )


def test_composes_with_gsam_as_value_and_grad_fn():
  with jax.enable_x64(True):
    params, batch = make_params(), make_batch(12)
    tx = optax.chain(optax_gsam.gsam(rho=0.1, alpha=0.4), optax.sgd(0.5))
    cached = optax_gsam.cached_value_and_grad(embed_two_towers, clip_reference, chunk_size=5)

    def full_loss(p):
      return clip_reference(p, embed_two_towers(p, batch))

    @jax.jit
    def cached_step(p, state):
      value, grads = cached(p, batch)
      updates, state = tx.update(
        grads, state, p, value_and_grad_fn=lambda q: cached(q, batch), value=value
      )
      return optax.apply_updates(p, updates), state

    @jax.jit
    def full_step(p, state):
      value, grads = jax.value_and_grad(full_loss)(p)
      updates, state = tx.update(grads, state, p, loss_fn=full_loss, value=value)
      return optax.apply_updates(p, updates), state

    p_cached = p_full = params
    s_cached = s_full = tx.init(params)
    for _ in range(3):
      p_cached, s_cached = cached_step(p_cached, s_cached)
      p_full, s_full = full_step(p_full, s_full)
    assert_trees_close(p_cached, p_full)
    np.testing.assert_allclose(
      optax.tree.get(s_cached, "surrogate_gap"), optax.tree.get(s_full, "surrogate_gap"), rtol=1e-9
    )


def test_encoder_memory_is_flat_in_batch_size():
  # A wide encoder: its activations, not the representations, dominate memory.
  dim, hidden, chunk = 64, 1024, 32
  params = {
    "w1": jax.ShapeDtypeStruct((dim, hidden), jnp.float32),
    "b1": jax.ShapeDtypeStruct((hidden,), jnp.float32),
    "w2": jax.ShapeDtypeStruct((hidden, 8), jnp.float32),
    "t": jax.ShapeDtypeStruct((), jnp.float32),
  }

  def embed(p, x):
    return {"image": mlp(p, x), "text": mlp(p, x[:, ::-1])}

  loss = packaged_clip(chunk)

  def temp_bytes(batch, cached):
    x = jax.ShapeDtypeStruct((batch, dim), jnp.float32)
    if cached:
      fn = optax_gsam.cached_value_and_grad(embed, loss, chunk_size=chunk)
    else:
      fn = jax.value_and_grad(lambda p, b: loss(p, embed(p, b)))
    return jax.jit(fn).lower(params, x).compile().memory_analysis().temp_size_in_bytes

  small, large = temp_bytes(256, True), temp_bytes(4096, True)
  full_small, full_large = temp_bytes(256, False), temp_bytes(4096, False)
  per_example = (large - small) / (4096 - 256)
  full_per_example = (full_large - full_small) / (4096 - 256)
  assert full_per_example > 2 * hidden * 4  # full batch keeps every activation
  # Cached: only the representations, their gradients and a tile row of logits grow with B.
  assert per_example < 512, (small, large)
  assert large < full_large / 10


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(chunk_size=0), "chunk_size"),
    (dict(chunk_size=2.0), "chunk_size"),
    (dict(chunk_size=True), "chunk_size"),
    (dict(chunk_size=2, has_aux=1), "has_aux"),
    (dict(chunk_size=2, per_example_keys="yes"), "per_example_keys"),
    (dict(chunk_size=2, axis_name=None, loss_fn=3), "loss_fn"),
    (dict(chunk_size=2, embed_fn=(mlp, 3)), "embed_fn"),
    (dict(chunk_size=(2, 3, 4), embed_fn=(mlp, mlp)), "chunk_size"),
    (dict(chunk_size={"a": 0}, embed_fn={"a": mlp}), "chunk_size"),
  ],
)
def test_invalid_arguments_raise_eagerly(kwargs, match):
  kwargs = {"embed_fn": embed_two_towers, "loss_fn": clip_reference, **kwargs}
  with pytest.raises(ValueError, match=match):
    optax_gsam.cached_value_and_grad(kwargs.pop("embed_fn"), kwargs.pop("loss_fn"), **kwargs)


def test_mismatched_batch_raises():
  fn = optax_gsam.cached_value_and_grad(embed_two_towers, clip_reference, chunk_size=2)
  params = make_params(dtype=jnp.float32)
  batch = {"image": jnp.ones((4, 7)), "text": jnp.ones((5, 5))}
  with pytest.raises(ValueError, match="axis 0"):
    fn(params, batch)


linear = lambda p, x: x @ p["w"]


sum_loss = lambda p, r: jnp.sum(r)


def test_chunk_size_larger_than_the_batch_is_an_error():
  p = {"w": jnp.ones((3, 2))}
  fn = optax_gsam.cached_value_and_grad(linear, sum_loss, chunk_size=8)
  with pytest.raises(ValueError, match=r"chunk_size=8 is larger than the batch, which has 5"):
    fn(p, jnp.ones((5, 3)))
  value, _ = fn(p, jnp.ones((8, 3)))  # chunk_size equal to the batch: one chunk
  assert float(value) == 8 * 2 * 3
  towers = optax_gsam.cached_value_and_grad(
    {"query": linear, "doc": linear},
    lambda p, r: jnp.sum(r["query"]) + jnp.sum(r["doc"]),
    chunk_size=4,
  )
  with pytest.raises(
    ValueError, match=r"chunk_size=4 is larger than the batch of tower \['query'\]"
  ):
    towers(p, {"query": jnp.ones((3, 3)), "doc": jnp.ones((12, 3))})


def test_chunk_size_larger_than_the_local_shard_is_an_error(data_mesh):
  mesh = data_mesh
  fn = optax_gsam.cached_value_and_grad(linear, sum_loss, chunk_size=4, axis_name="data")
  sharded = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P())))
  # 16 examples over 8 devices: 2 per shard, fewer than chunk_size.
  with pytest.raises(ValueError, match=r"chunk_size=4 .* has 2 examples \(the local shard"):
    sharded(
      jax.device_put({"w": jnp.ones((3, 2))}, NamedSharding(mesh, P())),
      jax.device_put(jnp.ones((16, 3)), NamedSharding(mesh, P("data"))),
    )


def test_batch_whose_leaves_disagree_on_axis_0_is_an_error():
  p = {"w": jnp.ones((3, 2))}
  embed = lambda q, b: b["x"] @ q["w"] + b["y"]
  fn = optax_gsam.cached_value_and_grad(embed, sum_loss, chunk_size=2)
  with pytest.raises(ValueError, match=r"leading sizes \['4', '6'\]"):
    fn(p, {"x": jnp.ones((4, 3)), "y": jnp.ones((6, 1))})
  with pytest.raises(ValueError, match=r"examples on axis 0.*None"):
    fn(p, {"x": jnp.ones((4, 3)), "y": jnp.float32(1.0)})
  towers = optax_gsam.cached_value_and_grad(
    {"a": embed}, lambda q, r: jnp.sum(r["a"]), chunk_size=2
  )
  with pytest.raises(ValueError, match=r"batch of tower \['a'\].*leading sizes"):
    towers(p, {"a": {"x": jnp.ones((4, 3)), "y": jnp.ones((3, 1))}})


def embed(params, x):
  return jnp.tanh(x @ params["w1"]) @ params["w2"]


def temperature_contrastive_loss(params, reps):
  logits = params["t"] * reps @ reps.T
  return jnp.mean(jax.nn.logsumexp(logits, axis=1) - jnp.diagonal(logits))


@settings(max_examples=6, deadline=None, derandomize=True)
@given(
  data=st.data(),
  batch=st.integers(1, 12),
  features=st.integers(1, 4),
  hidden=st.integers(1, 5),
  seed=st.integers(0, 2**16),
)
def test_cached_gradient_equals_the_full_batch_gradient(data, batch, features, hidden, seed):
  chunk_size = data.draw(st.integers(1, batch), label="chunk_size")
  rng = np.random.default_rng(seed)
  with jax.enable_x64(True):
    params = {
      "w1": jnp.asarray(rng.normal(size=(features, hidden))),
      "w2": jnp.asarray(rng.normal(size=(hidden, 3))),
      "t": jnp.asarray(rng.uniform(0.5, 2.0)),
    }
    x = jnp.asarray(rng.normal(size=(batch, features)))
    value, grads = optax_gsam.cached_value_and_grad(
      embed, temperature_contrastive_loss, chunk_size=chunk_size
    )(params, x)
    ref_value, ref_grads = jax.value_and_grad(
      lambda p: temperature_contrastive_loss(p, embed(p, x))
    )(params)
    np.testing.assert_allclose(value, ref_value, rtol=1e-12)
    jax.tree.map(
      lambda g, r: np.testing.assert_allclose(g, r, rtol=1e-10, atol=1e-12), grads, ref_grads
    )
    assert optax.tree.allclose(grads, ref_grads, rtol=1e-10, atol=1e-12)
