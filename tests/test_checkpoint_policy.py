"""The checkpoint policy (maxtrain/checkpoint/policy.py) with plain values: cadence, the tier choice across
processes, the preemption plan's costs, and what each `checkpoint.resume` request allows. No files, no devices:
the end-to-end behaviour is test_tiers.py's, test_checkpoint.py's and test_trust_*.py's."""

import math

import pytest

from maxtrain.checkpoint import policy
from maxtrain.errors import UserError


def test_cadence_interval_auto_is_young_daly_in_steps():
  mtbf = (400.0, 1, 100.0)
  d = policy.cadence_interval("auto", "local", [0.25, 0.75], mtbf, step_s=0.5, every_minutes=0.0, prior_minutes=5.0)
  assert d["interval_s"] == pytest.approx(math.sqrt(2 * 0.5 * 400.0))  # mean cost 0.5 s: 20 s
  assert d["interval_steps"] == 40 and d["cost_s"] == 0.5 and d["failures"] == 1
  assert "C=0.5000s (mean blocking of 2 saves)" in d["why"] and "prior 5 min" in d["why"]
  # A tiny interval is still one step; no step timed yet: no decision.
  assert policy.cadence_interval("auto", "local", [1e-9], mtbf, 10.0, 0.0, 5.0)["interval_steps"] == 1
  assert policy.cadence_interval("auto", "local", [0.5], mtbf, float("nan"), 0.0, 5.0) is None


def test_cadence_interval_every_minutes_is_durable_only():
  d = policy.cadence_interval("fixed", "durable", [], (60.0, 0, 0.0), step_s=2.0, every_minutes=1.5, prior_minutes=1)
  assert (d["interval_s"], d["interval_steps"], d["why"]) == (90.0, 45, "checkpoint.every_minutes=1.5")
  assert policy.cadence_interval("fixed", "local", [], (60.0, 0, 0.0), 2.0, 1.5, 1) is None
  # auto before a save of the tier was measured: the configured minutes still apply.
  assert policy.cadence_interval("auto", "durable", [], (60.0, 0, 0.0), 2.0, 1.5, 1)["interval_steps"] == 45


def test_is_due_and_the_median_step():
  assert [s for s in range(1, 13) if policy.is_due(s, 4, None, False)] == [4, 8, 12]
  assert [s for s in range(1, 13) if policy.is_due(s, 4, 7, False)] == [4, 7, 8, 12]  # a decided step too
  assert [s for s in range(1, 13) if policy.is_due(s, 4, 7, True)] == [7]  # measured auto replaces every_steps
  assert [s for s in range(1, 13) if policy.is_due(s, 0, None, False)] == []
  assert policy.median_step_s([3.0, 1.0, 100.0]) == 3.0  # a save in the window does not skew it
  assert math.isnan(policy.median_step_s([]))


def test_observed_mtbf_counts_each_failed_attempt_once():
  records = [{"wall": 10.0, "attempt": 0, "kind": "job_start"}, {"wall": 20.0, "attempt": 0, "kind": "crash"},
             {"wall": 21.0, "attempt": 0, "kind": "hang"}, {"wall": 30.0, "attempt": 1, "kind": "preemption"}]
  assert policy.observed_mtbf(records, 50.0, 110.0, {"crash", "hang"}) == ((100.0 + 50.0) / 2, 1, 100.0)
  assert policy.observed_mtbf(records, 50.0, 110.0, {"crash", "hang", "preemption"})[1] == 2


def test_mean_save_cost_includes_the_upload_when_mirrored():
  assert policy.mean_save_s([1.0, 3.0]) == 2.0
  assert policy.mean_save_s([1.0, 3.0], [0.5, 1.5]) == 3.0
  assert policy.mean_save_s([1.0], []) is None  # mirrored, but no upload measured yet: unknown, not cheap
  assert policy.mean_save_s([]) is None


def scan(usable=(), corrupt=(), intact=()):
  return {"usable": list(usable), "corrupt": list(corrupt), "intact": list(intact)}


def test_local_decision_moves_corrupt_steps_once_a_good_one_is_chosen():
  lists = [scan([4, 6], [8], [4, 6]), scan([4, 6], [], [4, 6, 8])]
  d = policy.local_decision(lists, [8], durable_step=2, before=None, verified=True, start_over_if_corrupt=False)
  assert (d.choice.tier, d.choice.step, d.move_aside, d.refuse, d.start_over) == ("local", 6, [8], False, False)
  # A rollback before step 7: step 8 is not this search's business.
  d = policy.local_decision(lists, [8], 2, before=7, verified=True, start_over_if_corrupt=False)
  assert (d.choice.step, d.move_aside) == (6, [])


def test_local_decision_refuses_when_nothing_is_intact_anywhere():
  lists = [scan([], [6, 8], []), scan([], [8], [])]
  d = policy.local_decision(lists, [6, 8], None, None, True, start_over_if_corrupt=False)
  assert d.refuse and d.move_aside == [] and d.choice.tier is None
  d = policy.local_decision(lists, [6, 8], None, None, True, start_over_if_corrupt=True)
  assert not d.refuse and d.start_over and d.move_aside == [8, 6]  # newest first
  # A durable step to fall back on: not a case of all-corrupt, the corrupt local steps are moved aside.
  d = policy.local_decision(lists, [6, 8], 4, None, True, start_over_if_corrupt=False)
  assert (d.choice.tier, d.refuse, d.start_over, d.move_aside) == ("durable", False, False, [8, 6])
  # Another process holds an intact (say, other-layout) step: not all-corrupt either.
  d = policy.local_decision([scan([], [8], []), scan([], [], [8])], [8], None, None, True, False)
  assert not d.refuse and d.move_aside == [8]


def test_resume_requests():
  assert policy.parse_resume("auto") == policy.ResumeRequest("auto")
  assert policy.parse_resume("never").kind == "never"
  assert policy.parse_resume("12") == policy.ResumeRequest("step", step=12)
  assert policy.parse_resume("./run/checkpoints/12") == policy.ResumeRequest("path", path="./run/checkpoints/12")


def test_what_a_resume_request_allows():
  policy.check_fresh_start([], "/ck")
  with pytest.raises(UserError, match=r"resume=never but /ck already holds checkpoints at steps \[2, 4\]"):
    policy.check_fresh_start([2, 4], "/ck")
  with pytest.raises(UserError, match=r"checkpoint.local_dir=/l holds this run's local steps \[3\]"):
    policy.check_fresh_start([3], "/ck", local_key="checkpoint.local_dir=/l")
  policy.check_explicit_step(4, [2, 4], "/ck")
  with pytest.raises(UserError, match=r"no complete checkpoint at step 3 in /ck; found steps \[2, 4\]"):
    policy.check_explicit_step(3, [2, 4], "/ck")
  with pytest.raises(UserError, match="found steps none"):
    policy.check_explicit_step(3, [], "/ck")


def test_branching():
  assert policy.branch_steps(4, [], branch=False, where="/ck") == []
  with pytest.raises(UserError, match=r"holds newer steps \[6, 8\].*continue from step 8"):
    policy.branch_steps(4, [6, 8], branch=False, where="/ck")
  assert policy.branch_steps(4, [6, 8], branch=True, where="/ck") == [6, 8]
  with pytest.raises(UserError, match="branching an s3:// checkpoint directory is not supported"):
    policy.branch_steps(4, [6], branch=True, where="s3://b/r", remote=True)
  with pytest.raises(UserError, match=r"checkpoint.local_dir=/l holds this run's newer local steps \[6\]"):
    policy.branch_steps(4, [6], branch=False, where="s3://b/r", remote=True, local_key="checkpoint.local_dir=/l")
  assert policy.branch_steps(4, [6], True, "s3://b/r", remote=True, local_key="checkpoint.local_dir=/l") == [6]


def test_all_corrupt_durable_steps():
  policy.check_some_good(True, [(8, "bad")], False, "/ck")
  policy.check_some_good(False, [], False, "/ck")  # nothing at all: a fresh start
  policy.check_some_good(False, [(8, "bad")], True, "/ck")  # start_over_if_corrupt
  with pytest.raises(UserError, match=r"no checkpoint verifies \(steps \[8, 6\]; newest: bad8\)"):
    policy.check_some_good(False, [(8, "bad8"), (6, "bad6")], False, "/ck")
