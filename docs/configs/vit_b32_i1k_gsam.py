"""GSAM ViT-B/32 on ImageNet-1k: the paper's row, as a big_vision config for optax_gsam.

Table 1 of Zhuang et al. (ICLR 2022), ViT-B/32 with GSAM: batch 4096, 300 epochs,
Adam with peak lr 3e-3, 10k warmup steps, linear decay to 1% of the peak,
rho from 0.6 down to 0.1 with the learning rate, alpha 0.6.

Only the fields that optax_gsam.big_vision reads, and those that define the run, are
here; the input pipeline and evaluators are big_vision's
(big_vision/configs/proj/gsam/vit_i1k_gsam_no_aug.py). Differences from that file:

* ``config.gsam`` has no lr_max/lr_min: gsam_from_config derives them from
  ``config.lr`` and ``config.schedule`` (absolute values, 3e-3 and 3e-5).
* ``train_split`` is the full ``train`` split (NUM_TRAIN_EXAMPLES images), as in the
  paper; big_vision's file holds out 1% as minival (``train[:99%]``).
* ``wd=0.001`` is big_vision's decoupled weight decay, which its optimizer scales by
  the relative schedule but not by lr; the paper's 0.3 was multiplied by lr
  (0.3 * 3e-3 = 0.0009).

Usage::

  config = get_config()
  total_steps = optax_gsam.big_vision.num_train_steps(config, NUM_TRAIN_EXAMPLES)
  gsam_tx = optax_gsam.big_vision.gsam_from_config(config, total_steps)
"""

import ml_collections

# ImageNet-1k (ILSVRC-2012) train split.
NUM_TRAIN_EXAMPLES = 1_281_167


def get_config() -> ml_collections.ConfigDict:
  """The paper's GSAM ViT-B/32 training config."""
  config = ml_collections.ConfigDict()

  config.dataset = "imagenet2012"
  config.train_split = "train"
  config.num_classes = 1000
  config.loss = "sigmoid_xent"
  config.batch_size = 4096
  config.num_epochs = 300

  config.model_name = "vit"
  config.model = dict(variant="B/32", rep_size=False, pool_type="gap")
  config.init_head_bias = -10.0

  config.grad_clip_norm = 1.0
  config.optax_name = "scale_by_adam"
  config.optax = dict(mu_dtype="float32")

  config.lr = 3e-3
  config.wd = 1e-3
  config.schedule = dict(warmup_steps=10_000, decay_type="linear", linear_end=0.01)

  # rho follows the absolute lr: 0.6 at the peak (3e-3), 0.1 at the end (3e-5).
  config.gsam = dict(rho_max=0.6, rho_min=0.1, alpha=0.6)
  return config
