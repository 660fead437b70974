"""The README's demo runs end to end (shortened) and prints its table."""

import math

from optax_gsam import demo


def test_demo_runs_and_prints_table(capsys):
  rows = demo.main(["--epochs", "2", "--seeds", "1", "--no-progress"])
  out = capsys.readouterr().out
  assert "optimizer" in out and "gsam" in out and "step time / base" in out
  assert [r["optimizer"] for r in rows] == ["base", "sam", "gsam"]
  for row in rows:
    assert 0.1 < row["test_accuracy_mean"] <= 1.0  # better than chance after two epochs
    assert math.isfinite(row["final_loss"])
  assert rows[0]["step_time_ratio"] == 1.0
  assert rows[2]["surrogate_gap"] is not None


def test_label_noise_changes_the_stated_share():
  clean = demo.load_digits(0.0, 0)
  noisy = demo.load_digits(0.4, 0)
  share = (clean.y_train != noisy.y_train).mean()
  assert 0.35 < share < 0.45
  assert (clean.y_test == noisy.y_test).all()
