"""Guards: the in-graph NaN/spike logic against NumPy, and end-to-end NaN skip, rollback and abort."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtrain.optim.masking import keep_if
from maxtrain.program import guards
from maxtrain.cli import train
from maxtrain.errors import EXIT_ABORTED
from maxtrain.monitor.events import read_events
from test_checkpoint import TINY, assert_bitwise_equal, flat, restore_raw


def test_check_matches_numpy():
  window, warmup, zscore = 4, 3, 3.0
  g = guards.init(window)
  check = jax.jit(lambda g, loss: guards.check(g, loss, jnp.float32(1.0), zscore=zscore, warmup=warmup))
  recorded, skipped = [], 0
  for loss in [5.0, 4.9, 4.95, 4.8, np.nan, 4.7, 9.0, 4.75, np.inf, 4.72]:
    g, skip, m = check(g, jnp.float32(loss))
    hist = np.array(recorded[-window:], np.float64)
    finite = np.isfinite(loss)
    z = (loss - hist.mean()) / max(hist.std(), 1e-6 * max(abs(hist.mean()), 1.0)) if len(hist) else 0.0
    spike = finite and len(recorded) >= warmup and z > zscore
    assert bool(skip) == (not finite or spike), loss
    assert int(m["spike"]) == spike and int(m["nonfinite"]) == (not finite)
    if finite and len(hist):
      np.testing.assert_allclose(float(m["loss_zscore"]), z, rtol=1e-4)
    if finite and not spike:
      recorded.append(loss)
    skipped += int(not finite or spike)
    assert int(m["skipped_steps"]) == skipped
  assert skipped == 3  # nan, the 9.0 spike, inf
  old, new = {"a": jnp.ones(3)}, {"a": jnp.zeros(3)}
  assert np.array_equal(keep_if(jnp.bool_(True), old, new)["a"], np.ones(3))
  assert np.array_equal(keep_if(jnp.bool_(False), old, new)["a"], np.zeros(3))


def base_args(store, out):
  return TINY + ["--config.mesh.fsdp=8", f"--config.data.path={store}", f"--config.output_dir={out}",
                 "--config.guards.spike_warmup=3", "--config.guards.spike_zscore=50"]


def kinds(out):
  return [r["kind"] for r in read_events(out / "events.jsonl")]


def test_nan_step_is_skipped_and_training_continues(store, tmp_path):
  out = tmp_path / "run"
  args = base_args(store, out) + ["--config.steps=6", "--config.checkpoint.every_steps=1",
                                  "--config.checkpoint.max_to_keep=0", "--config.faults.nan_at_step=3"]
  assert train.main(args) == 0
  before, after, later = (restore_raw(out / "checkpoints", s) for s in (2, 3, 4))
  assert_bitwise_equal({"p": before["params"], "o": before["opt_state"]}, {"p": after["params"], "o": after["opt_state"]})
  assert not np.array_equal(flat(after["params"])["embed"], flat(later["params"])["embed"])  # step 4 updates
  assert int(flat(after)["guard/skipped"]) == 1 and int(flat(after)["step"]) == 3
  assert "nan_skip" in kinds(out) and "rollback" not in kinds(out)
  assert np.isfinite(json.loads((out / "summary.json").read_text())["final_eval_loss"])


def test_nan_with_max_consecutive_bad_1_rolls_back(store, tmp_path):
  out = tmp_path / "run"
  args = base_args(store, out) + ["--config.steps=8", "--config.checkpoint.every_steps=2",
                                  "--config.faults.nan_at_step=5", "--config.guards.max_consecutive_bad=1"]
  assert train.main(args) == 0
  rollback = next(r for r in read_events(out / "events.jsonl") if r["kind"] == "rollback")
  assert rollback["from_step"] == 5 and rollback["to_step"] == 4
  assert json.loads((out / "summary.json").read_text())["steps"] == 8


def test_spike_rollback_then_abort(store, tmp_path, capsys):
  out = tmp_path / "rollback"
  args = base_args(store, out) + ["--config.steps=10", "--config.checkpoint.every_steps=2",
                                  "--config.faults.spike_at_step=7", "--config.guards.spike_action=rollback"]
  assert train.main(args) == 0
  records = read_events(out / "events.jsonl")
  spike = next(r for r in records if r["kind"] == "spike")
  assert spike["step"] == 7 and spike["zscore"] > 50
  rollback = next(r for r in records if r["kind"] == "rollback")
  assert rollback["from_step"] == 7 and rollback["to_step"] == 6
  summary = json.loads((out / "summary.json").read_text())
  assert summary["steps"] == 10 and np.isfinite(summary["final_eval_loss"])

  out = tmp_path / "abort"
  args = base_args(store, out) + ["--config.steps=10", "--config.faults.spike_at_step=7",
                                  "--config.guards.spike_action=abort"]
  capsys.readouterr()
  assert train.main(args) == EXIT_ABORTED
  err = capsys.readouterr().err
  assert "aborted: loss spike at step 7" in err and "z-score" in err


def guard_flags(nonfinite=False, spike=False, consecutive_bad=0, loss=1.0, zscore=0.0, nonfinite_update=False):
  """A step's guard metrics as the jitted step returns them (arrays), before the host reads them."""
  return {"nonfinite": np.bool_(nonfinite), "nonfinite_update": np.bool_(nonfinite_update), "spike": np.bool_(spike),
          "loss_zscore": np.float32(zscore), "consecutive_bad": np.int32(consecutive_bad), "loss": np.float32(loss)}


def test_guard_policy_reads_flags_one_step_late_and_keeps_the_budget(tmp_path):
  """The loop's guard component on its own: step n's flags are read after step n+1 (the last at once),
  a rollback forgets the unread step after the fault, the budget and spike_action=abort stop the run."""
  from maxtrain import config as config_lib
  from maxtrain.errors import Aborted
  from maxtrain.loop.rollback import GuardPolicy, Rollback
  from maxtrain.monitor.events import EventLog

  cfg = config_lib.load(["--config.guards.max_consecutive_bad=2", "--config.guards.max_rollbacks=1"]).guards
  with EventLog(tmp_path / "events.jsonl", attempt=0) as events:
    policy = GuardPolicy(cfg, events, rollbacks_used=0)
    assert policy.after_step(1, guard_flags(nonfinite=True, consecutive_bad=1), last=False) is None
    assert read_events(tmp_path / "events.jsonl") == []  # step 1 is not read before step 2 is dispatched
    assert policy.after_step(2, guard_flags(nonfinite=True, consecutive_bad=2), last=False) is None
    assert [(r["kind"], r["step"]) for r in read_events(tmp_path / "events.jsonl")] == [("nan_skip", 1)]
    # Step 2's flags (2 in a row) are read after step 3: roll back to before step 1; step 3 is forgotten.
    rollback = policy.after_step(3, guard_flags(nonfinite=True, consecutive_bad=3), last=False)
    assert rollback == Rollback(step=2, first_bad=1, reason="2 non-finite steps in a row") and policy.rollbacks == 1
    assert policy.after_step(4, guard_flags(), last=True) is None  # the last step is read at once
    assert [r["step"] for r in read_events(tmp_path / "events.jsonl")] == [1, 2]
    # The budget (one rollback) is used up: the next fault stops the run.
    policy.after_step(5, guard_flags(nonfinite=True, consecutive_bad=1), last=False)
    with pytest.raises(Aborted, match="guards.max_rollbacks=1"):
      policy.after_step(6, guard_flags(nonfinite=True, consecutive_bad=2), last=True)
    # A budget counted before this process (with the checkpoints) counts from the start.
    assert GuardPolicy(cfg, events, rollbacks_used=1).rollbacks == 1
    abort = config_lib.load(["--config.guards.spike_action=abort"]).guards
    with pytest.raises(Aborted, match="loss spike at step 7"):
      GuardPolicy(abort, events, 0).after_step(7, guard_flags(spike=True, loss=9.0, zscore=12.0), last=True)
