"""optax_gsam.flax.nnx_loss_fn and the NNX steps of docs/flax.md.

As in tests/test_flax.py, the two passes are compared at a tiny rho: the GSAM
update is then the plain update to O(rho) exactly when the perturbed pass sees
the clean pass's dropout masks and inputs; a negative control shows the test can fail.
"""

import functools

import chex
import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _flax_common import TX_GSAM
from _flax_common import TX_PLAIN
from _flax_common import TX_TINY
from _flax_common import data
from _flax_common import max_tree_diff
from flax import nnx

import optax_gsam
from optax_gsam.flax import nnx_loss_fn
from optax_gsam.flax import nnx_microbatch_loss_fn


class NNXNet(nnx.Module):
  def __init__(self, rngs):
    self.dense1 = nnx.Linear(4, 8, rngs=rngs)
    self.norm = nnx.BatchNorm(8, momentum=0.5, rngs=rngs)
    self.dropout = nnx.Dropout(0.5, rngs=rngs)
    self.dense2 = nnx.Linear(8, 3, rngs=rngs)

  def __call__(self, x):
    return self.dense2(self.dropout(nnx.relu(self.norm(self.dense1(x)))))


def cross_entropy(model, x, y):
  return optax.softmax_cross_entropy(model(x), y).mean()


@nnx.jit
def nnx_gsam_step(model, optimizer, x, y):
  """The docs' NNX step, RNG state inside the model."""
  perturbed_loss = nnx_loss_fn(cross_entropy, model, x, y)  # before the clean pass
  loss, grads = nnx.value_and_grad(cross_entropy)(model, x, y)
  optimizer.update(model, grads, loss_fn=perturbed_loss, value=loss)
  return loss


@nnx.jit
def nnx_gsam_step_split_late(model, optimizer, x, y):
  """A wrong step: snapshotting after the clean pass gives the next dropout mask and new stats."""
  loss, grads = nnx.value_and_grad(cross_entropy)(model, x, y)
  perturbed_loss = nnx_loss_fn(cross_entropy, model, x, y)
  optimizer.update(model, grads, loss_fn=perturbed_loss, value=loss)
  return loss


@nnx.jit
def nnx_gsam_step_other_mask(model, optimizer, x, y):
  """A wrong step nnx_loss_fn cannot see: the RNG advances between the snapshot and the clean pass."""
  perturbed_loss = nnx_loss_fn(cross_entropy, model, x, y)
  model.dropout.rngs()  # one extra draw: the clean pass uses the next key
  loss, grads = nnx.value_and_grad(cross_entropy)(model, x, y)
  optimizer.update(model, grads, loss_fn=perturbed_loss, value=loss)
  return loss


@nnx.jit
def nnx_plain_step(model, optimizer, x, y):
  loss, grads = nnx.value_and_grad(cross_entropy)(model, x, y)
  optimizer.update(model, grads)
  return loss


def nnx_pair(tx):
  model = NNXNet(nnx.Rngs(0, dropout=1))
  return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def test_nnx_perturbed_pass_sees_clean_rng_and_stats_are_clean():
  x, y = data()
  gsam_model, gsam_opt = nnx_pair(TX_TINY)
  plain_model, plain_opt = nnx_pair(TX_PLAIN)
  for _ in range(2):
    nnx_gsam_step(gsam_model, gsam_opt, x, y)
    nnx_plain_step(plain_model, plain_opt, x, y)
    for kind in (nnx.Param, nnx.BatchStat, nnx.RngCount):
      chex.assert_trees_all_close(
        nnx.state(gsam_model, kind), nnx.state(plain_model, kind), rtol=1e-5, atol=1e-5
      )
  # Negative control: a perturbed pass with another dropout mask changes the tiny-rho step.
  wrong_model, wrong_opt = nnx_pair(TX_TINY)
  right_model, right_opt = nnx_pair(TX_TINY)
  nnx_gsam_step_other_mask(wrong_model, wrong_opt, x, y)
  right_model.dropout.rngs()  # the same clean pass as the wrong step's
  nnx_gsam_step(right_model, right_opt, x, y)
  params = (nnx.state(wrong_model, nnx.Param), nnx.state(right_model, nnx.Param))
  assert max_tree_diff(*params) > 1e-3


def test_nnx_batch_stats_and_rng_advance_once_with_perturbation():
  x, y = data()
  model, optimizer = nnx_pair(TX_GSAM)
  reference = NNXNet(nnx.Rngs(0, dropout=1))
  before = nnx.as_pure(nnx.state(model, nnx.Param))
  loss = nnx_gsam_step(model, optimizer, x, y)
  # The clean pass alone, on a copy of the initial model.
  expected_loss = cross_entropy(reference, x, y)
  assert float(loss) == pytest.approx(float(expected_loss), rel=1e-6)
  chex.assert_trees_all_close(
    nnx.state(model, nnx.BatchStat), nnx.state(reference, nnx.BatchStat), rtol=1e-6, atol=1e-7
  )
  assert int(model.dropout.rngs.count[...]) == int(reference.dropout.rngs.count[...]) == 1
  assert max_tree_diff(before, nnx.as_pure(nnx.state(model, nnx.Param))) > 1e-4
  assert float(optax.tree.get(optimizer.opt_state, "surrogate_gap")) != 0.0


# --- NNX with `rngs` passed to the model call (Flax's NNX MNIST tutorial) ----------------------


# One object for every model: the tutorial builds a new partial per model, and a static attribute
# that compares by identity makes nnx.jit compile again for each model instance.
AVG_POOL = functools.partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))


class MnistCNN(nnx.Module):
  """The CNN of Flax's NNX MNIST tutorial, shrunk to 8x8 images: dropout gets `rngs` in the call."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 4, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm1 = nnx.BatchNorm(4, rngs=rngs)
    self.dropout1 = nnx.Dropout(rate=0.5)
    self.conv2 = nnx.Conv(4, 8, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm2 = nnx.BatchNorm(8, rngs=rngs)
    self.avg_pool = AVG_POOL
    self.linear1 = nnx.Linear(32, 16, rngs=rngs)
    self.dropout2 = nnx.Dropout(rate=0.5)
    self.linear2 = nnx.Linear(16, 10, rngs=rngs)

  def __call__(self, x, rngs: nnx.Rngs | None = None):
    x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
    x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
    x = x.reshape(x.shape[0], -1)
    x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
    return self.linear2(x)


def mnist_loss_fn(model, rngs, batch):
  logits = model(batch["image"], rngs)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
  return loss, logits


def mnist_metrics():
  return nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))


@nnx.jit
def mnist_plain_step(model, optimizer, metrics, rngs, batch):
  """The tutorial's train_step, unchanged."""
  grad_fn = nnx.value_and_grad(mnist_loss_fn, has_aux=True)
  (loss, logits), grads = grad_fn(model, rngs, batch)
  metrics.update(loss=loss, logits=logits, labels=batch["label"])
  optimizer.update(model, grads)


@nnx.jit
def mnist_gsam_step(model, optimizer, metrics, rngs, batch):
  """The tutorial's train_step converted with docs/flax.md: one added line, one changed."""
  perturbed_loss = nnx_loss_fn(mnist_loss_fn, model, rngs, batch)  # before the clean pass
  grad_fn = nnx.value_and_grad(mnist_loss_fn, has_aux=True)
  (loss, logits), grads = grad_fn(model, rngs, batch)
  metrics.update(loss=loss, logits=logits, labels=batch["label"])
  optimizer.update(model, grads, loss_fn=perturbed_loss, value=loss)


@nnx.jit
def mnist_gsam_step_snapshot_late(model, optimizer, metrics, rngs, batch):
  """A wrong step: the snapshot after the clean pass holds the advanced RNG counter."""
  grad_fn = nnx.value_and_grad(mnist_loss_fn, has_aux=True)
  (loss, logits), grads = grad_fn(model, rngs, batch)
  metrics.update(loss=loss, logits=logits, labels=batch["label"])
  perturbed_loss = nnx_loss_fn(mnist_loss_fn, model, rngs, batch)
  optimizer.update(model, grads, loss_fn=perturbed_loss, value=loss)


@nnx.jit
def mnist_gsam_step_other_rngs(model, optimizer, metrics, rngs, batch):
  """A wrong step: the perturbed pass draws from another RNG stream."""
  perturbed_loss = nnx_loss_fn(mnist_loss_fn, model, nnx.Rngs(99), batch)
  grad_fn = nnx.value_and_grad(mnist_loss_fn, has_aux=True)
  (loss, logits), grads = grad_fn(model, rngs, batch)
  metrics.update(loss=loss, logits=logits, labels=batch["label"])
  optimizer.update(model, grads, loss_fn=perturbed_loss, value=loss)


def mnist_batch(n=16):
  return {
    "image": jax.random.uniform(jax.random.key(20), (n, 8, 8, 1)),
    "label": jax.random.randint(jax.random.key(21), (n,), 0, 10),
  }


def mnist_setup(tx):
  model = MnistCNN(rngs=nnx.Rngs(0))
  model.train()
  return model, nnx.Optimizer(model, tx, wrt=nnx.Param), mnist_metrics(), nnx.Rngs(7)


def test_nnx_rngs_argument_step_equals_plain_step_at_tiny_rho():
  """Tiny rho: the GSAM step is the plain step iff the perturbed pass redraws the clean masks."""
  batch = mnist_batch()
  gsam = mnist_setup(TX_TINY)
  plain = mnist_setup(TX_PLAIN)
  for _ in range(2):
    mnist_gsam_step(*gsam, batch)
    mnist_plain_step(*plain, batch)
    (g_model, _, g_metrics, g_rngs), (p_model, _, p_metrics, p_rngs) = gsam, plain
    for kind in (nnx.Param, nnx.BatchStat):
      chex.assert_trees_all_close(
        nnx.state(g_model, kind), nnx.state(p_model, kind), rtol=1e-5, atol=1e-5
      )
    # The RNG advanced exactly as in the plain step: once per draw of the clean pass.
    assert int(g_rngs.default.count[...]) == int(p_rngs.default.count[...])
    assert float(g_metrics.compute()["loss"]) == pytest.approx(
      float(p_metrics.compute()["loss"]), rel=1e-6
    )
  assert int(p_rngs.default.count[...]) == 4  # two dropout layers, two steps
  # Negative control: other masks in the perturbed pass, so the update differs.
  wrong = mnist_setup(TX_TINY)
  right = mnist_setup(TX_TINY)
  mnist_gsam_step_other_rngs(*wrong, batch)
  mnist_gsam_step(*right, batch)
  assert max_tree_diff(nnx.state(wrong[0], nnx.Param), nnx.state(right[0], nnx.Param)) > 1e-4


def test_nnx_loss_fn_redraws_the_clean_masks_and_leaves_state_alone():
  batch = mnist_batch()

  @nnx.jit
  def clean_and_replayed(model, rngs):
    perturbed_loss = nnx_loss_fn(mnist_loss_fn, model, rngs, batch)
    (_, logits), _ = nnx.value_and_grad(mnist_loss_fn, has_aux=True)(model, rngs, batch)
    params = nnx.as_pure(nnx.state(model, nnx.Param))
    # The function the transform gets, called by hand at the clean weights: same masks, same
    # logits. Its dropout draws and batch statistics stay in throw-away copies.
    _, replayed_logits = perturbed_loss(params)
    _, next_logits = nnx_loss_fn(mnist_loss_fn, model, rngs, batch)(params)
    return logits, replayed_logits, next_logits

  model, _, _, rngs = mnist_setup(TX_PLAIN)
  reference, _, _, reference_rngs = mnist_setup(TX_PLAIN)
  logits, replayed, next_logits = clean_and_replayed(model, rngs)
  np.testing.assert_allclose(replayed, logits, rtol=1e-6, atol=1e-6)
  assert float(jnp.max(jnp.abs(next_logits - logits))) > 1e-3  # the next draw differs
  # One clean pass on a copy of the initial model: the same statistics and RNG counter.
  mnist_loss_fn(reference, reference_rngs, batch)
  assert int(rngs.default.count[...]) == int(reference_rngs.default.count[...]) == 2
  chex.assert_trees_all_close(
    nnx.state(model, nnx.BatchStat), nnx.state(reference, nnx.BatchStat), rtol=1e-6, atol=1e-7
  )


SNAPSHOTS_THAT_FAIL = {
  "closure": lambda rngs: rngs,
  "clone": nnx.clone,
  "fork": lambda rngs: rngs.fork(),
  "bare_split": lambda rngs: nnx.merge(*nnx.split(rngs)),
}


class RngsArgumentNet(nnx.Module):
  """The smallest model with the tutorial's call: dropout takes `rngs` in the call."""

  def __init__(self, rngs: nnx.Rngs):
    self.linear = nnx.Linear(4, 3, rngs=rngs)
    self.dropout = nnx.Dropout(rate=0.5)

  def __call__(self, x, rngs: nnx.Rngs | None = None):
    return self.dropout(self.linear(x), rngs=rngs)


def rngs_argument_loss(model, rngs):
  x, y = data()
  return optax.softmax_cross_entropy(model(x, rngs), y).mean()


@nnx.jit
def rngs_argument_fixed_step(model, optimizer, rngs):
  perturbed_loss = nnx_loss_fn(rngs_argument_loss, model, rngs)
  loss, grads = nnx.value_and_grad(rngs_argument_loss)(model, rngs)
  optimizer.update(model, grads, loss_fn=perturbed_loss, value=loss)


@pytest.mark.parametrize("snapshot", SNAPSHOTS_THAT_FAIL)
def test_nnx_rngs_without_pure_state_fail_as_the_docs_say(snapshot):
  """docs/flax.md: these ways of giving the perturbed pass `rngs` fail under nnx.jit."""

  @nnx.jit
  def step(model, optimizer, rngs):
    perturbed_rngs = SNAPSHOTS_THAT_FAIL[snapshot](rngs)
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)
    rest = nnx.as_pure(rest)

    def perturbed_loss(params):
      return rngs_argument_loss(nnx.merge(graphdef, params, rest), perturbed_rngs)

    loss, grads = nnx.value_and_grad(rngs_argument_loss)(model, rngs)
    optimizer.update(model, grads, loss_fn=perturbed_loss, value=loss)

  model = RngsArgumentNet(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, TX_GSAM, wrt=nnx.Param)
  with pytest.raises(flax.errors.TraceContextError, match="different trace level"):
    step(model, optimizer, nnx.Rngs(1))
  # The same step with nnx_loss_fn runs, and the RNG advances once (one dropout draw).
  rngs = nnx.Rngs(1)
  rngs_argument_fixed_step(model, optimizer, rngs)
  assert int(rngs.default.count[...]) == 1


def test_nnx_loss_fn_shares_state_between_model_and_arguments():
  """An argument that is also inside the model is rebuilt once, so both see one RNG stream."""
  model = NNXNet(nnx.Rngs(0, dropout=1))
  stream = model.dropout.rngs
  x, y = data()
  captured = {}

  def spy(m, rngs_stream, x, y):
    captured["same"] = m.dropout.rngs is rngs_stream
    return cross_entropy(m, x, y)

  params = nnx.as_pure(nnx.state(model, nnx.Param))
  nnx_loss_fn(spy, model, stream, x, y)(params)
  assert captured["same"]


@pytest.mark.parametrize("bad_model", [{"w": jnp.ones(2)}, jnp.ones(2)])
def test_nnx_loss_fn_rejects_a_params_tree(bad_model):
  with pytest.raises(TypeError, match="NNX object"):
    nnx_loss_fn(cross_entropy, bad_model)
  with pytest.raises(TypeError, match="callable"):
    nnx_loss_fn("loss", NNXNet(nnx.Rngs(0)))


def test_nnx_microbatch_loss_of_the_wrong_arity_names_the_call_form():
  """A loss of the model alone used to raise Python's bare '<lambda>() takes 1 positional
  argument but 2 were given' from inside optax_gsam/flax.py."""
  model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
  batch = jnp.ones((4, 4))
  of_model = lambda m: jnp.mean(m(batch) ** 2)
  f, params, state = nnx_microbatch_loss_fn(of_model, model)
  with pytest.raises(
    TypeError,
    match=r"calls loss_fn\(model, microbatch\) once per micro-batch.*does not take these "
    r"arguments \(too many positional arguments\)\. Define loss_fn\(model, microbatch\)",
  ):
    optax_gsam.accumulate_value_and_grad(f, params, batch, microbatches=2, model_state=state)
  of_microbatch = lambda m, microbatch: jnp.mean(m(microbatch) ** 2)
  f, params, state = nnx_microbatch_loss_fn(of_microbatch, model)
  with pytest.raises(TypeError, match=r"calls loss_fn\(model, microbatch, key\)"):
    optax_gsam.accumulate_value_and_grad(
      f, params, batch, microbatches=2, model_state=state, key=jax.random.key(0)
    )
  # The right form runs; a TypeError raised inside it is the loss's own, left as it is.
  optax_gsam.accumulate_value_and_grad(f, params, batch, microbatches=2, model_state=state)
  f, params, state = nnx_microbatch_loss_fn(lambda m, b: m(b) + "x", model)
  with pytest.raises(TypeError) as error:
    optax_gsam.accumulate_value_and_grad(f, params, batch, microbatches=2, model_state=state)
  assert "nnx_microbatch_loss_fn" not in str(error.value)


def test_nnx_loss_fn_called_after_the_clean_pass_raises():
  x, y = data()
  model, optimizer = nnx_pair(TX_TINY)
  with pytest.raises(ValueError, match=r"nnx_loss_fn was called after the clean pass.*before"):
    nnx_gsam_step_split_late(model, optimizer, x, y)
  with pytest.raises(ValueError, match="nnx_loss_fn was called after the clean pass"):
    mnist_gsam_step_snapshot_late(*mnist_setup(TX_TINY), mnist_batch())
  # A model whose loss mutates nothing: the order does not matter, and nothing is raised.
  linear = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
  linear_optimizer = nnx.Optimizer(linear, TX_GSAM, wrt=nnx.Param)
  nnx_gsam_step_split_late(linear, linear_optimizer, x, y)
  assert int(linear_optimizer.step[...]) == 1


class CallCounter(nnx.Variable):
  """A user variable that is neither an RNG counter nor a batch statistic."""


class CountingLinear(nnx.Module):
  def __init__(self):
    self.linear = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    self.calls = CallCounter(jnp.zeros((), jnp.int32))

  def __call__(self, x):
    self.calls.value += 1
    return self.linear(x)


def test_nnx_loss_fn_after_the_clean_pass_names_the_variable_that_changed():
  x, y = data()
  model = CountingLinear()
  optimizer = nnx.Optimizer(model, TX_GSAM, wrt=nnx.Param)
  with pytest.raises(
    ValueError, match=r"the loss changes model\['calls'\] \(CallCounter\), and"
  ) as error:
    nnx_gsam_step_split_late(model, optimizer, x, y)
  assert "RNG counters or batch statistics" not in str(error.value)


# --- rho_from_lr inside a trace: Flax's abstract restore -------------------------------------


class LoRANet(nnx.Module):
  def __init__(self, rngs):
    self.hidden = nnx.LoRA(4, 2, 8, base_module=nnx.Linear(4, 8, rngs=rngs), rngs=rngs)
    self.out = nnx.LoRA(8, 2, 3, base_module=nnx.Linear(8, 3, rngs=rngs), rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.relu(self.hidden(x)))


def test_a_loss_helper_without_the_optimizers_wrt_names_wrt():
  """nnx.Optimizer(wrt=nnx.LoRAParam) hands the transform the adapters only; a helper left at
  wrt=nnx.Param split the base weights off too, and the error names wrt=, not a leaf count."""
  x, y = jnp.ones((4, 4)), jax.nn.one_hot(jnp.arange(4) % 3, 3)
  diff = nnx.DiffState(0, nnx.LoRAParam)

  def step(model, optimizer, **wrt):
    perturbed = nnx_loss_fn(cross_entropy, model, x, y, **wrt)
    loss, grads = nnx.value_and_grad(cross_entropy, argnums=diff)(model, x, y)
    optimizer.update(model, grads, loss_fn=perturbed, value=loss)

  model = LoRANet(nnx.Rngs(0))
  optimizer = nnx.Optimizer(
    model, optax.chain(optax_gsam.sam(0.05), optax.sgd(0.1)), wrt=diff.filter
  )
  with pytest.raises(ValueError, match=r"wrt=nnx.Param.*base_module.*wrt=nnx.LoRAParam"):
    nnx.jit(step)(model, optimizer)
  nnx.jit(functools.partial(step, wrt=nnx.LoRAParam))(model, optimizer)  # the fix works

  def micro_loss(model, microbatch):
    return jnp.mean(model(microbatch) ** 2)

  def micro_step(model, optimizer):
    f, _, model_state = nnx_microbatch_loss_fn(micro_loss, model)  # wrt left at nnx.Param
    params = nnx.state(model, nnx.LoRAParam)
    optimizer.update(model, params, loss_fn=f, batch=x, model_state=model_state)

  micro = nnx.Optimizer(
    model, optax.chain(optax_gsam.sam(0.05, microbatches=2), optax.sgd(0.1)), wrt=nnx.LoRAParam
  )
  with pytest.raises(ValueError, match=r"nnx_microbatch_loss_fn\(loss_fn, model, \.\.\., wrt="):
    nnx.jit(micro_step)(model, micro)


class LoRALinearNet(nnx.Module):
  def __init__(self, rngs):
    self.hidden = nnx.LoRALinear(512, 1024, lora_rank=8, rngs=rngs)
    self.out = nnx.LoRALinear(1024, 1024, lora_rank=8, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.relu(self.hidden(x)))


def integer_cross_entropy(model, x, y):  # the loss of docs/fine_tuning.md's NNX LoRA step
  return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def _lora_step_peak(first):
  """The compiled peak of a donated NNX LoRA step under nnx.Optimizer(wrt=nnx.LoRAParam)."""
  model = LoRALinearNet(nnx.Rngs(0))
  tx = optax.adamw(1e-2) if first is None else optax.chain(first, optax.adamw(1e-2))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)
  graphdef, state = nnx.split((model, optimizer))
  diff = nnx.DiffState(0, nnx.LoRAParam)

  def step(state, x, y):
    model, optimizer = nnx.merge(graphdef, state)
    perturbed = nnx_loss_fn(integer_cross_entropy, model, x, y, wrt=nnx.LoRAParam)
    loss, grads = nnx.value_and_grad(integer_cross_entropy, argnums=diff)(model, x, y)
    if first is None:
      optimizer.update(model, grads)
    else:
      optimizer.update(model, grads, loss_fn=perturbed, value=loss)
    return nnx.state((model, optimizer))

  # Four examples: the activations then weigh less than the adapters (112 KiB), so one more
  # adapter-sized buffer shows (at 64 examples an activation-sized buffer that AdamW's step
  # holds and sam's frees sooner hides it). At one example AdamW's step never materializes
  # its gradient (its weight gradients fuse into the moment updates) while sam's needs the
  # clean and the perturbed one: 2.8 adapter-sized buffers over AdamW there.
  x, y = jnp.ones((4, 512)), jnp.arange(4) % 1024
  memory = jax.jit(step, donate_argnums=0).lower(state, x, y).compile().memory_analysis()
  peak = memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
  trained = sum(v.size * v.dtype.itemsize for v in jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
  return peak + memory.temp_size_in_bytes, trained


# Compiled memory is the compiler's: the figures below are jaxlib 0.10.2's. At the declared floor
# (0.10.0, tools/check_floors.sh) XLA packs the same program into 2.0 and 2.7 adapter buffers.
@pytest.mark.skipif(
  jax.__version_info__ < (0, 10, 2), reason="compiled memory measured with jaxlib 0.10.2"
)
def test_lora_adapters_cost_at_most_the_trained_leaves_buffers_the_maths_needs():
  """Over AdamW, in trained-leaf buffers: the perturbed adapters and the clean gradient (2),
  the perturbed adapters alone without diagnostics (1); the base weights' size never enters."""
  base, trained = _lora_step_peak(None)
  over = {
    name: (_lora_step_peak(tx)[0] - base) / trained
    for name, tx in [
      ("sam", optax_gsam.sam(0.05)),
      ("gsam", optax_gsam.gsam(0.05, 0.3)),
      ("sam diagnostics=False", optax_gsam.sam(0.05, diagnostics=False)),
    ]
  }
  # Measured: sam 1.86, gsam 1.87, sam diagnostics=False 0.58.
  assert over["sam"] <= 2 and over["gsam"] <= 2 and over["sam diagnostics=False"] <= 1, over
