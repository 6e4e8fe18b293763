"""Two checkpoint tiers (checkpoint.local_dir + checkpoint.dir): which step a run resumes from, agreed by
every process, bitwise like the run that never stopped; the cadence's decisions; config errors.

End to end through `maxtrain.launch` with kill -9 (faults.kill_at_step); the tier choice and the
Young/Daly arithmetic also as plain functions."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from maxtrain import config as config_lib
from maxtrain.checkpoint import cadence, policy
from maxtrain.config.sections import checkpoint as validate  # the checkpoint section, checked beside its keys
from maxtrain.errors import UserError
from maxtrain.monitor import goodput
from maxtrain.monitor.events import read_events
from test_checkpoint import assert_bitwise_equal, losses, restore_raw, s3_server  # noqa: F401 - a fixture
from s3_proxy import S3Proxy
from tiny import TINY_MODEL, cpu_env

REPO = Path(__file__).resolve().parent.parent
TINY = TINY_MODEL + ["--config.eval.every_steps=0", "--config.log_every=1"]
# A NaN at step 10 is seen at step 11 (the flags are read a step late), after the durable save of step 10: the
# rollback to local step 8 abandons that step 10, and the new timeline saves its own step 10.
TIERS = ["--config.steps=20", "--config.checkpoint.every_steps=10", "--config.checkpoint.local_every_steps=2",
         "--config.faults.nan_at_step=10", "--config.guards.max_consecutive_bad=1"]


def launch(launcher_args, train_args, devices=8) -> subprocess.CompletedProcess:
  env = cpu_env(devices)
  return subprocess.run([sys.executable, "-m", "maxtrain.launch", "--backoff=0.1", *launcher_args, "--", *train_args],
                        capture_output=True, text=True, env=env, timeout=600, cwd=REPO)


def attempt_codes(result) -> list[str]:
  return [line.split("exit ")[1].split()[0] for line in result.stderr.splitlines()
          if line.startswith("maxtrain.launch: attempt")]


def restores(out: Path) -> list[tuple[int, str, int]]:
  return [(r["process"], r["tier"], r["step"]) for r in read_events(out / "events.jsonl") if r["kind"] == "restore"]


def test_choice_across_tiers():
  both = policy.choose([[14, 16], [14, 16]], 10)
  assert (both.tier, both.step) == ("local", 16) and "on all 2 processes" in both.reason
  half = policy.choose([[14, 16], [14]], 10)  # process 1's step 16 is half written: 14, the newest they share
  assert (half.tier, half.step) == ("local", 14)
  lost = policy.choose([[14, 16], []], 10)  # process 1's local tier is gone: the durable step
  assert (lost.tier, lost.step) == ("durable", 10) and "process 1 has none" in lost.reason
  assert policy.choose([[10]], 10).tier == "durable"  # a tie: the durable copy survives the node
  assert (policy.choose([[14, 16]], 10, before=15).step, policy.choose([[14, 16]], 10, before=11).tier) == (14, "durable")
  assert policy.choose([[]], None).tier is None


def test_config_errors(tmp_path):
  def check(**changes):
    cfg = config_lib.base_config()
    for key, value in changes.items():
      cfg.checkpoint[key] = value
    with pytest.raises(UserError) as e:
      validate(cfg.checkpoint)
    return str(e.value)

  assert "same place" in check(dir=str(tmp_path / "c"), local_dir=str(tmp_path / "c"), local_every_steps=2)
  assert "same place" in check(dir=str(tmp_path / "c"), local_dir=str(tmp_path / "c/local"), local_every_steps=2)
  assert "local_every_steps=-2" in check(local_every_steps=-2)
  assert "every_minutes=-1" in check(every_minutes=-1.0)
  assert "preemption_grace_s=-30" in check(preemption_grace_s=-30.0)
  assert "cadence='sometimes'" in check(cadence="sometimes")
  assert "never be written" in check(local_dir=str(tmp_path / "l"))


def test_same_dir_exits_2_before_training(tmp_path, capsys):
  # checkpoint.dir="" resolves to <output_dir>/checkpoints: a local_dir there is the same place. In this process:
  # that exit 2 is never restarted is the supervisor's (test_supervisor.py).
  from maxtrain.cli import train

  code = train.main(TINY + [f"--config.output_dir={tmp_path}", "--config.checkpoint.local_every_steps=2",
                            f"--config.checkpoint.local_dir={tmp_path / 'checkpoints'}"])
  err = capsys.readouterr().err
  assert code == 2, err[-2000:]
  assert "checkpoint.local_dir" in err and "same place" in err
  assert not [r for r in read_events(tmp_path / "events.jsonl") if r["kind"] in ("compile_start", "first_step")]


def test_young_daly_and_observed_mtbf():
  assert policy.young_daly_s(0.5, 400.0) == pytest.approx(20.0)
  records = [{"wall": 100.0, "attempt": 0, "kind": "job_start"}, {"wall": 130.0, "attempt": 0, "kind": "crash"},
             {"wall": 131.0, "attempt": 0, "kind": "crash", "process": -1},  # the supervisor's record of the same
             {"wall": 140.0, "attempt": 1, "kind": "hang"}]
  mtbf, failures, span = cadence.observed_mtbf(records, prior_s=60.0, now_wall=160.0)
  assert (failures, span) == (2, 60.0) and mtbf == pytest.approx((60.0 + 60.0) / 3)
  assert cadence.observed_mtbf([], 60.0, 0.0) == (60.0, 0, 0.0)


@pytest.fixture(scope="module")
def reference(store, tmp_path_factory):
  """The uninterrupted run: its losses and final state."""
  out = tmp_path_factory.mktemp("uninterrupted")
  result = launch([], TINY + TIERS + [f"--config.data.path={store}", f"--config.output_dir={out}",
                                      f"--config.checkpoint.local_dir={out / 'local'}"])
  assert result.returncode == 0, result.stderr[-3000:]
  return losses(out), restore_raw(out / "checkpoints", 20), out


def abandoned(out: Path) -> list[tuple[int, list[int], str]]:
  """The checkpoint_abandoned events, each checked against the directories it names."""
  records = [r for r in read_events(out / "events.jsonl") if r["kind"] == "checkpoint_abandoned"]
  for r in records:
    assert all(Path(p).name.split(".abandoned-")[0] in map(str, r["durable_steps"]) and
               (Path(p) / "maxtrain_manifest.json").exists() for p in r["moved_to"])
  return [(r["step"], r["durable_steps"], r["reason"]) for r in records]


@pytest.mark.slow
def test_kill_resumes_from_the_newest_tier_bitwise(store, tmp_path, reference):
  """Also: the rollback's abandoned durable step 10 is moved aside, never resumed (run b resumes from the new
  timeline's step 10; before, the new step 10 was skipped as "already saved" and b took the abandoned one)."""
  ref_losses, ref_state, ref_out = reference
  # Killed after step 17: local saves at 2, 4, ..., 16; durable at 10 (twice). The supervisor restarts it.
  local = tmp_path / "local"
  args = TINY + TIERS + [f"--config.data.path={store}", f"--config.checkpoint.local_dir={local}",
                         "--config.faults.kill_at_step=17"]
  a = tmp_path / "a"
  result = launch(["--max-restarts=1"], args + [f"--config.output_dir={a}"])
  assert result.returncode == 0 and attempt_codes(result) == ["-9", "0"], result.stderr[-3000:]
  assert restores(a) == [(0, "local", 16)]
  assert "resume: local step 16 is complete and verified on all 1 processes" in result.stderr
  scalars = EventAccumulator(str(ref_out / "tensorboard"))  # (a kill -9 loses the writer's unflushed records)
  scalars.Reload()
  for phase in ("device_to_host_s", "serialise_s", "write_s", "manifest_s", "save_s"):
    assert [e.step for e in scalars.Scalars(f"checkpoint/local/{phase}")] == [2, 4, 6, 8, 12, 14, 16, 18]
  for phase in ("device_to_host_s", "write_s", "manifest_s"):
    assert [e.step for e in scalars.Scalars(f"checkpoint/durable/{phase}")] == [10, 10, 20]  # 10 again: the rollback
  section = goodput.compute(read_events(a / "events.jsonl"))["checkpoints"]
  assert section["tiers"]["local"]["saves"] == 8 and section["tiers"]["local"]["restores"] == 1
  assert [(f["last_step"], f["restored_step"], f["restored_tier"]) for f in section["failures"]] == [(17, 16, "local")]
  # The same kill with the node's local disk lost before the restart: the durable step 10.
  b = tmp_path / "b"
  result = launch(["--max-restarts=0"], args + [f"--config.output_dir={b}", f"--config.checkpoint.local_dir={b / 'l'}"])
  assert attempt_codes(result) == ["-9"], result.stderr[-3000:]
  assert "durable checkpoint steps [10] are newer than the restored step 8" in result.stderr
  shutil.rmtree(b / "l")
  result = launch([], args + [f"--config.output_dir={b}", f"--config.checkpoint.local_dir={b / 'l'}"])
  assert result.returncode == 0, result.stderr[-3000:]
  assert restores(b) == [(0, "durable", 10)] and "resume: durable step 10: the local tier holds no usable step" in result.stderr
  for out in (ref_out, a, b):
    assert abandoned(out) == [(8, [10], "rolled back from step 10")]
  for out in (a, b):
    assert_bitwise_equal(restore_raw(out / "checkpoints", 20), ref_state)
    got = losses(out)
    assert sorted(got) == list(range(1, 21))
    assert [got[s] for s in range(1, 21)] == [ref_losses[s] for s in range(1, 21)]  # bitwise: equal floats


@pytest.mark.slow
def test_two_processes_agree_when_one_local_step_is_half_written(store, tmp_path):
  """2 processes x 4 devices (fsdp inside each, across both), killed after step 5; process 1's local step
  4 is then cut in half (its node lost the tail of the file): both resume from local step 2, the newest
  step both hold whole (and promote it to the durable tier together)."""
  local = tmp_path / "local"
  args = TINY_MODEL + ["--config.eval.every_steps=0", "--config.log_every=2", "--config.mesh.fsdp=4",
                       "--config.mesh.dcn_fsdp=2", "--config.steps=6", "--config.checkpoint.every_steps=10",
                       "--config.checkpoint.local_every_steps=2", f"--config.checkpoint.local_dir={local}",
                       f"--config.data.path={store}", f"--config.output_dir={tmp_path}",
                       "--config.runtime.shutdown_timeout_s=60", "--config.faults.kill_at_step=5"]
  # (On a loaded machine one process may compile half a minute after the other: the trainer's barrier after
  # compiling keeps the first step's gloo context, which waits 30 s for a peer, from timing out.)
  result = launch(["--processes=2", "--max-restarts=0", "--peer-grace=60"], args, devices=4)
  assert "(processes, in exit order: -9, -9)" in result.stderr, result.stderr[-3000:]
  assert sorted(os.listdir(local)) == ["process_0", "process_1"]
  state = local / "process_1" / "4" / "state.bin"
  with open(state, "r+b") as f:
    f.truncate(state.stat().st_size // 2)
  result = launch(["--processes=2", "--max-restarts=0", "--peer-grace=60"], args, devices=4)
  assert result.returncode == 0, result.stderr[-3000:]
  assert sorted(restores(tmp_path)) == [(0, "local", 2), (1, "local", 2)]
  assert "process_1/4 is corrupt: state.bin: size" in result.stderr
  # Process 0's whole step 4 belonged to the abandoned run: deleted, then saved anew at 4.
  assert "local checkpoint steps [4] are newer than the restored step 2" in result.stderr
  for step in (2, 6):  # local step 2 promoted by both processes' collective save; the run finished
    assert (tmp_path / "checkpoints" / str(step) / "maxtrain_manifest.json").exists()


def test_every_minutes_is_one_decision_for_all_processes(tmp_path):
  """checkpoint.every_minutes with 2 processes on a real coordination service (jax's, in this process):
  the processes measure different step times, yet save at the same steps: process 0 decides, the other
  reads its decision (the durable save is collective: a disagreement would hang it)."""
  import socket
  import threading

  from jax._src.lib import _jax

  from maxtrain.monitor.events import EventLog
  from maxtrain.runtime.kv import KeyValue

  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{s.getsockname()[1]}"
  service = _jax.get_distributed_runtime_service(address, 2, heartbeat_timeout=60, shutdown_timeout=5)
  clients = [_jax.get_distributed_runtime_client(address, i, init_timeout=60, heartbeat_timeout=60,
                                                 use_compression=True) for i in range(2)]
  ck = config_lib.base_config().checkpoint
  ck.every_steps, ck.every_minutes = 0, 0.05  # 3 s: 12 steps at process 0's 0.25 s, 30 at process 1's 0.1 s
  due = {}

  def process(index, step_times):
    clients[index].connect()
    with EventLog(tmp_path / f"events{index}.jsonl", index) as events:
      c = cadence.Cadence(ck, events, KeyValue(clients[index], index, 2), index)
      c.observe(1)
      c._step_times = step_times
      due[index] = [s for s in range(2, 60) if c.due("durable", s) and c.saved("durable", s, cost_s=0.1) is None]

  def together(target, *args_per_process):
    threads = [threading.Thread(target=target, args=args) for args in args_per_process]
    for t in threads:
      t.start()
    for t in threads:
      t.join(timeout=120)

  together(process, (0, [0.25] * 3), (1, [0.1] * 3))
  together(lambda client: client.shutdown(), *[(c,) for c in clients])  # a barrier: both at once
  service.shutdown()
  assert due == {0: [15, 27, 39, 51], 1: [15, 27, 39, 51]}
  decided = [r for r in read_events(tmp_path / "events0.jsonl") if r["kind"] == "checkpoint_cadence"]
  assert [r["interval_steps"] for r in decided][:2] == [12, 12] and not read_events(tmp_path / "events1.jsonl")


def test_stalled_bucket_falls_behind_while_training_goes_on(store, tmp_path, s3_server, monkeypatch, caplog):
  from maxtrain.cli import train

  host, port = os.environ["AWS_ENDPOINT_URL"].removeprefix("http://").split(":")
  proxy = S3Proxy((host, int(port)), b"/ckpts/stall/", "stall")
  monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
  try:
    code = train.main(TINY + ["--config.mesh.fsdp=8", f"--config.data.path={store}", f"--config.output_dir={tmp_path}",
                              "--config.steps=10", "--config.checkpoint.dir=s3://ckpts/stall",
                              "--config.checkpoint.every_steps=2", "--config.checkpoint.local_every_steps=1",
                              f"--config.checkpoint.local_dir={tmp_path / 'local'}",
                              "--config.checkpoint.max_durable_lag=1", "--config.checkpoint.s3_read_timeout_s=2",
                              "--config.checkpoint.s3_max_attempts=1", "--config.faults.nan_at_step=8",
                              "--config.guards.max_consecutive_bad=1"])
  finally:
    proxy.close()
  assert code == 0 and proxy.hits >= 1
  records = read_events(tmp_path / "events.jsonl")
  behind = [r for r in records if r["kind"] == "checkpoint_behind"]
  assert behind and behind[0]["pending"] == 2 and behind[0]["max_durable_lag"] == 1
  # Training went on, saving to the local tier after the durable one fell behind.
  local = [r["step"] for r in records if r["kind"] == "checkpoint_save_end" and r["tier"] == "local"]
  assert [s for s in local if s > behind[0]["step"]] and max(r["step"] for r in records if r["kind"] == "steps") == 10
  assert not [r for r in records if r["kind"] == "checkpoint_upload"]  # nothing reached the bucket
  # The NaN at step 8 rolled back to local step 7, newer than the durable tier's 6.
  rollback = next(r for r in records if r["kind"] == "rollback")
  assert (rollback["from_step"], rollback["to_step"]) == (8, 7) and "rollback: local step 7" in caplog.text
  # Its durable step 8, saved before the NaN was seen, waited for upload: set aside, its upload never completed.
  assert abandoned(tmp_path) == [(7, [8], "rolled back from step 8")]


def test_an_abandoned_s3_step_is_moved_aside_and_its_upload_cancelled(s3_server, tmp_path):
  import threading

  from maxtrain.checkpoint.remote import S3Mirror

  def objects(prefix):
    return sorted(o["Key"] for o in s3_server.list_objects_v2(Bucket="ckpts", Prefix=prefix).get("Contents", []))

  mirror = S3Mirror("s3://ckpts/run")
  for step in (2, 4, 6):
    (tmp_path / str(step) / "sub").mkdir(parents=True)
    (tmp_path / str(step) / "a.bin").write_bytes(bytes([step]) * 10)
    (tmp_path / str(step) / "sub" / "b").write_text(str(step))
  for step in (2, 4):
    mirror.upload(tmp_path / str(step), step, keep=[2, 4, 6]).result()
  assert mirror.move_aside(4, "4.abandoned-T") == "s3://ckpts/run/4.abandoned-T" and mirror.complete_steps() == [2]
  assert objects("run/4") == ["run/4.abandoned-T/_MAXTRAIN_COMPLETE", "run/4.abandoned-T/a.bin", "run/4.abandoned-T/sub/b"]
  assert s3_server.get_object(Bucket="ckpts", Key="run/4.abandoned-T/a.bin")["Body"].read() == bytes([4]) * 10
  gate = threading.Event()
  mirror._pool.submit(gate.wait)  # the uploader is busy: step 6 waits in the queue
  upload = mirror.upload(tmp_path / "6", 6, keep=[2, 6])
  assert mirror.cancel_after(4) == [6]
  gate.set()
  assert upload.result() == 0.0 and mirror.complete_steps() == [2] and objects("run/6") == []
  mirror.close()


def test_every_minutes_becomes_steps_at_the_warmup_and_each_save(tmp_path):
  from maxtrain.monitor.events import EventLog

  ck = config_lib.base_config().checkpoint
  ck.every_steps, ck.every_minutes = 0, 0.05  # 3 s
  with EventLog(tmp_path / "events.jsonl", 0) as events:
    c = cadence.Cadence(ck, events)
    c.observe(1)  # a fresh attempt's first step: the decision comes at its third, step 3
    c._step_times = [0.25, 0.2, 0.3]  # median 0.25 s a step: 3 s is 12 steps
    assert not c.due("durable", 2) and not c.due("durable", 3)
    assert [s for s in range(4, 40) if c.due("durable", s)] == [15]
    c.saved("durable", 15, cost_s=0.1)
    assert c.next["durable"] == 27 and c.next["local"] is None
  decisions = [r for r in read_events(tmp_path / "events.jsonl") if r["kind"] == "checkpoint_cadence"]
  assert [(r["step"], r["interval_steps"], r["next_step"]) for r in decisions] == [(3, 12, 15), (15, 12, 27)]
  assert decisions[0]["interval_s"] == 3.0 and decisions[0]["step_time_s"] == 0.25


@pytest.mark.slow
def test_auto_cadence_under_crashes_at_a_known_rate(store, tmp_path):
  """cadence=auto in a supervised run killed (kill -9) after every 12 steps of an attempt, twice: each local
  interval is sqrt(2 C M) from the logged save cost C and the M the event history gives, and the goodput
  report's lost work per failure is the steps recomputed."""
  prior_min, every = 0.2, 12
  result = launch(["--max-restarts=3"], TINY + [
      f"--config.data.path={store}", f"--config.output_dir={tmp_path}", "--config.steps=30", "--config.mesh.fsdp=1",
      "--config.checkpoint.cadence=auto", "--config.checkpoint.every_steps=0", "--config.checkpoint.local_every_steps=2",
      f"--config.checkpoint.local_dir={tmp_path / 'local'}", f"--config.checkpoint.mtbf_prior_minutes={prior_min}",
      f"--config.faults.kill_every_steps={every}", "--config.faults.kill_times=2"], devices=1)
  assert result.returncode == 0 and attempt_codes(result) == ["-9", "-9", "0"], result.stderr[-3000:]
  records = read_events(tmp_path / "events.jsonl")
  decisions = [r for r in records if r["kind"] == "checkpoint_cadence" and r["tier"] == "local"]
  assert {r["attempt"] for r in decisions} == {0, 1, 2}
  first_wall = min(r["wall"] for r in records)
  for r in decisions:
    assert r["failures"] == r["attempt"]  # every earlier attempt was killed
    assert r["mtbf_s"] == pytest.approx((r["span_s"] + prior_min * 60) / (r["failures"] + 1))
    start = min(x["wall"] for x in records if x["attempt"] == r["attempt"] and x["process"] == 0)
    assert start - first_wall <= r["span_s"] <= r["wall"] - first_wall  # measured as the attempt started
    saves = [x["blocking_s"] for x in records if x["kind"] == "checkpoint_blocked" and x.get("tier") == "local"
             and x["attempt"] == r["attempt"] and x["step"] <= r["step"]]
    assert r["cost_s"] == pytest.approx(sum(saves) / len(saves))
    assert r["interval_s"] == pytest.approx(policy.young_daly_s(r["cost_s"], r["mtbf_s"]))
    assert r["interval_steps"] * r["step_time_s"] == pytest.approx(r["interval_s"], rel=0.2) or r["interval_steps"] == 1
  report = goodput.compute(records)
  failures = report["checkpoints"]["failures"]
  restored = [r["step"] for r in records if r["kind"] == "restore"]
  assert [f["last_step"] for f in failures] == [every, restored[0] + every]
  assert [f["restored_step"] for f in failures] == restored
  for f in failures:  # the newest local save the killed attempt finished
    saved = [r["step"] for r in records if r["kind"] == "checkpoint_save_end" and r["attempt"] == f["attempt"]]
    assert f["restored_step"] == max(saved) and f["recomputed_steps"] == f["last_step"] - f["restored_step"]
    assert f["expected_steps"] > 0 and f["actual_s"] >= 0
  assert sum(f["recomputed_steps"] for f in failures) == report["steps"]["lost"]


def test_preemption_plan_fits_the_grace_period():
  plan = policy.preemption_plan(10.0, {"durable": 4.0, "local": 0.5})
  assert (plan.tiers, plan.skipped) == (["local", "durable"], [])
  plan = policy.preemption_plan(4.2, {"durable": 4.0, "local": 0.5})  # 3.7 s left after the local save
  assert (plan.tiers, plan.skipped) == (["local"], ["durable"]) and "durable takes 4.00s, 3.70s left" in plan.why
  assert policy.preemption_plan(5.0, {"durable": 4.0}).tiers == ["durable"]
  plan = policy.preemption_plan(-1.0, {"durable": 4.0, "local": 0.5})  # nothing fits: the fastest anyway
  assert (plan.tiers, plan.skipped) == (["local"], ["durable"]) and "none fits" in plan.why
  assert policy.preemption_plan(0.1, {"durable": None, "local": None}).tiers == ["local", "durable"]  # not measured
  # Half a millisecond left: the measured local save does not fit, so neither does the durable one, assumed slower.
  plan = policy.preemption_plan(0.0005, {"durable": None, "local": 0.024})
  assert (plan.tiers, plan.skipped) == (["local"], ["durable"]) and "none fits" in plan.why
  assert policy.preemption_plan(None, {"durable": 4.0, "local": 9.0}).tiers == ["durable", "local"]  # measured order


def test_preemption_saves_the_tiers_the_grace_period_fits_and_resume_promotes(store, tmp_path):
  """A real SIGTERM after step 3 (faults.sigterm_at_step). With a long grace period both tiers save step 3,
  the local one first (complete before the durable one starts); with a grace period already over, only the
  local one (the fastest: the only chance to keep the step). The run resumed from that local step promotes
  it to the durable tier in the background: bitwise the durable step 3 the other run saved directly."""
  from maxtrain.checkpoint import manifest
  from maxtrain.cli import train

  def run(out, grace, steps=6):
    return train.main(TINY + ["--config.mesh.fsdp=8", f"--config.data.path={store}", f"--config.output_dir={out}",
                              f"--config.steps={steps}", "--config.checkpoint.every_steps=0",
                              "--config.checkpoint.local_every_steps=2", f"--config.checkpoint.local_dir={out / 'l'}",
                              "--config.faults.sigterm_at_step=3", f"--config.checkpoint.preemption_grace_s={grace}"])

  def at_3(out):
    return [r for r in read_events(out / "events.jsonl") if r["step"] == 3]

  both, local_only = tmp_path / "both", tmp_path / "local_only"
  assert run(both, 600) == 75
  plan = next(r for r in at_3(both) if r["kind"] == "checkpoint_preemption")
  assert plan["tiers"] == ["local", "durable"] and plan["skipped"] == [] and 0 < plan["remaining_s"] <= 600
  assert plan["cost_s"]["local"] is not None  # the local save of step 2 was measured
  saved = [(r["kind"], r.get("tier", "durable")) for r in at_3(both) if r["kind"] in ("checkpoint_blocked",
                                                                                       "checkpoint_save_end")]
  assert saved[:2] == [("checkpoint_blocked", "local"), ("checkpoint_save_end", "local")]
  assert ("checkpoint_save_end", "durable") in saved[2:]
  assert (both / "l" / "process_0" / "3" / "maxtrain_manifest.json").exists()

  assert run(local_only, 0.001) == 75  # a millisecond of grace: less than the local save takes, or over already
  plan = next(r for r in at_3(local_only) if r["kind"] == "checkpoint_preemption")
  assert plan["tiers"] == ["local"] and plan["skipped"] == ["durable"]
  assert plan["remaining_s"] < plan["cost_s"]["local"] and plan["cost_s"]["durable"] is None
  assert "none fits: local, the fastest, is tried anyway" in plan["why"]
  assert (local_only / "l" / "process_0" / "3" / "maxtrain_manifest.json").exists()
  assert not (local_only / "checkpoints" / "3").exists()

  assert run(local_only, 0.001, steps=4) == 0  # resumes from local step 3, promotes it, trains step 4
  records = read_events(local_only / "events.jsonl")
  assert [(r["tier"], r["step"]) for r in records if r["kind"] == "restore"] == [("local", 3)]
  promoted = [r for r in records if r["kind"] == "checkpoint_save_start" and r.get("promoted_from") == "local"]
  assert [r["step"] for r in promoted] == [3]
  assert manifest.verify(local_only / "checkpoints" / "3").verified
  assert_bitwise_equal(restore_raw(local_only / "checkpoints", 3), restore_raw(both / "checkpoints", 3))


def test_local_tier_round_trip_rotation_and_abandoned_steps(tmp_path):
  """Also: a run rotates, abandons and verifies only its own steps; another run's in the same folder are left
  alone (a step number it saves again moves theirs aside); local_max_to_keep=0 keeps all."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec

  from maxtrain.checkpoint import manifest
  from maxtrain.checkpoint.local import LocalTier, LocalUnusable

  mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  shardings = {"w": NamedSharding(mesh, PartitionSpec("a", None)), "s": NamedSharding(mesh, PartitionSpec())}
  ours = {"output_dir": "/runs/a", "checkpoint_dir": "/runs/a/checkpoints", "config_hash": "h"}

  def save(tier, steps):
    for step in steps:
      state = {"w": jax.device_put(jnp.arange(32.0).reshape(8, 4) * step, shardings["w"]),
               "s": jax.device_put(jnp.int32(step), shardings["s"])}
      tier.save(step, state, {"next": step}, {"mesh": {"a": 4, "b": 2}, "process_count": 1, "identity": tier.identity})
    tier.wait()
    return state

  tier = LocalTier(str(tmp_path), 0, keep=3, identity=ours)
  state = save(tier, (2, 4, 6, 8))
  assert tier.steps() == [4, 6, 8]  # keep=3
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
  round_trip = tier.restore(tier.path(6), abstract, shardings)
  restored, data = round_trip.state, round_trip.data_state
  assert data == {"next": 6} and int(restored["s"]) == 6 and restored["w"].sharding == shardings["w"]
  np.testing.assert_array_equal(np.asarray(restored["w"]), np.arange(32.0).reshape(8, 4) * 6)
  other = {"w": NamedSharding(mesh, PartitionSpec(None, "b")), "s": shardings["s"]}
  with pytest.raises(LocalUnusable):  # another layout: these shards were not saved
    tier.restore(tier.path(6), abstract, other)
  assert tier.drop_after(4) == [6, 8] and tier.steps() == [4]  # a resume to 4 abandoned them
  scan = tier.scan({"a": 4, "b": 2}, 1, verify=True)
  assert (scan.usable, scan.corrupt, scan.skipped) == ([4], {}, {})
  assert tier.scan({"a": 8, "b": 1}, 1, verify=True).usable == []
  tier.close()
  # Another run on the same folder (the first one is gone): keeps all its own steps, never touches step 4's
  # owner's files but step 4's number, which it saves too (the other run's step moved aside, never deleted).
  theirs = {**ours, "output_dir": "/runs/b", "checkpoint_dir": "/runs/b/checkpoints"}
  tier = LocalTier(str(tmp_path), 0, keep=0, identity=theirs)
  scan = tier.scan({"a": 4, "b": 2}, 1, verify=True)
  assert scan.usable == [] and "another run's (output_dir /runs/a" in scan.skipped[4]
  save(tier, (1, 2, 3))
  assert tier.own_steps() == [1, 2, 3] and tier.steps() == [1, 2, 3, 4]  # keep=0: all kept; 4 is the other run's
  save(tier, (4,))
  assert tier.own_steps() == [1, 2, 3, 4] and len(list((tmp_path / "process_0").glob("4.other-run-*"))) == 1
  state_file = tier.path(4) / "state.bin"  # checkpoint.verify=False restores unchecked: a cut file is still exit 2
  os.truncate(state_file, state_file.stat().st_size // 2)
  with pytest.raises(manifest.CorruptCheckpoint, match="state.bin: .* bytes, but its index needs .* [(]truncated[)]"):
    tier.restore(tier.path(4), abstract, shardings)
  assert tier.drop_after(1) == [2, 3, 4]
  tier.close()


def test_a_restored_step_is_its_directory_not_the_update_counter(tmp_path):
  """A GRPO round makes ppo_epochs x minibatches optimizer updates, so its state's counter is a multiple of the
  step directory's number (here 4x). A restore reports the directory's step: promoting local step 3 writes durable
  step 3 (not 12, which resume=auto would take next time), and restoring durable step 1 abandons steps 2 and 3
  (the counter, 4, is above neither)."""
  import dataclasses

  import jax

  from maxtrain.checkpoint.identity import RunIdentity
  from maxtrain.checkpoint.schedule import Checkpoints
  from maxtrain.models.llama import ModelConfig
  from maxtrain.monitor.events import EventLog
  from maxtrain.monitor.metrics import MetricsLogger
  from maxtrain.optim import optimizer as optim
  from maxtrain.program import state as state_lib
  from maxtrain.sharding.mesh import make_mesh

  per_step, out = 4, tmp_path / "out"
  flags = TINY + [f"--config.output_dir={out}", f"--config.checkpoint.local_dir={tmp_path / 'l'}",
                  "--config.checkpoint.local_every_steps=1"]
  cfg = config_lib.load(flags)
  mesh = make_mesh({"fsdp": 1}, jax.devices()[:1])
  spec = state_lib.spec(ModelConfig.from_config(cfg.model), optim.make(cfg.optimizer, 4).tx, mesh, seed=0)
  state, shape = state_lib.initialize(spec, mesh), dict(mesh.shape)

  def checkpoints(resume: str) -> Checkpoints:
    cfg.checkpoint.resume = resume
    return Checkpoints(cfg, out, events, metrics, mesh_shape=shape, state_spec=spec)

  def at(step: int):
    return dataclasses.replace(state, step=jax.numpy.int32(step * per_step))

  with EventLog(out / "events.jsonl") as events:
    metrics = MetricsLogger(out, events, total_steps=4, tokens_per_step=1, flops_per_token=1.0, peak_flops=1.0)
    ck = checkpoints("auto")
    ck.save(1, at(1), {}, shape, RunIdentity(), sync=True)  # durable 1, local 2 and 3 (a preemption's)
    for step in (2, 3):
      ck.save_local(step, at(step), {}, shape, RunIdentity(), sync=True)
    ck.close()

    ck = checkpoints("auto")
    restored = ck.restore(ck.resolve_resume(), spec)
    assert (ck.resumed.tier, restored.step, int(restored.state.step)) == ("local", 3, 12)
    ck.promote(restored, RunIdentity())
    ck.close()
    assert ck.store.steps() == [1, 3]

    ck = checkpoints(str(out / "checkpoints" / "1"))  # an explicit path: its newer steps are another timeline
    assert ck.restore(ck.resolve_resume(), spec).step == 1
    assert ck.store.steps() == [1] and ck.local.steps() == []
    ck.close()
    metrics.close()
  records = read_events(out / "events.jsonl")
  abandoned = [r for r in records if r["kind"] == "checkpoint_abandoned"]
  assert [(r["step"], r["durable_steps"], r["local_steps"]) for r in abandoned] == [(1, [3], [2, 3])]
  # in the step unit of every other event (goodput discards the steps after it, the report counts the recomputed)
  assert [(r["tier"], r["step"]) for r in records if r["kind"] == "restore"] == [("local", 3), ("durable", 1)]
