"""Trust, second round (issue 23): hostile inputs through the real entry points.

One test (or parametrized group) per family: each asserts the exit code, that no traceback was printed,
that the message names the culprit, and what is on disk afterwards (nothing partial). Argument errors
fail before anything compiles; models are tiny; subprocesses are synchronised on their own log lines,
never on sleeps.
"""

import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from maxtrain.cli import generate, launch, train
from maxtrain.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, NOT_RESTARTED
from maxtrain.monitor import mfu
from tiny import TINY_MODEL, cpu_env

REPO = Path(__file__).resolve().parent.parent
ENV = cpu_env(1)


def assert_exit(code, output, expected, *names):
  assert code == expected, output[-3000:]
  assert "Traceback" not in output, output[-3000:]
  for name in names:
    assert name in output, (name, output[-3000:])


def run_train(args, capsys):
  code = train.main(args)
  captured = capsys.readouterr()
  return code, captured.out + captured.err


def base(store, out, steps=2):
  return TINY_MODEL + [f"--config.data.path={store}", f"--config.output_dir={out}", f"--config.steps={steps}",
                       "--config.eval.every_steps=0"]


# ---- config files and output_dir --------------------------------------------------------------

@pytest.mark.parametrize("body", ["import sys\nsys.exit(0)\n", "import sys\nsys.exit(1)\n",
                                  "import sys\nsys.exit('bye')\n", "raise SystemExit\n",
                                  "import sys\ndef get_config():\n  sys.exit(0)\n"])
def test_config_file_that_exits_is_exit_2(tmp_path, capsys, body):
  path = tmp_path / "exits.py"
  path.write_text(body)
  code, output = run_train([f"--config={path}", f"--config.output_dir={tmp_path / 'run'}"], capsys)
  assert_exit(code, output, EXIT_BAD_INPUT, str(path), "sys.exit", "maxtrain: error:")
  assert len(output.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def test_empty_output_dir_is_refused_by_trainer_and_supervisor(store, tmp_path, capsys, monkeypatch):
  monkeypatch.chdir(tmp_path)
  code, output = run_train(base(store, ""), capsys)
  assert_exit(code, output, EXIT_BAD_INPUT, "config.output_dir=''", "current directory")
  code = launch.main(["--", *base(store, " ")])
  assert_exit(code, capsys.readouterr().err, EXIT_BAD_INPUT, "config.output_dir=' '")
  assert list(tmp_path.iterdir()) == []  # nothing written into the current directory


# ---- sizes refused before allocating ----------------------------------------------------------

@pytest.mark.parametrize("d_model", [32768, 10**9])
def test_model_larger_than_memory_is_refused_by_the_estimate(store, tmp_path, capsys, d_model):
  out = tmp_path / "run"
  code, output = run_train(base(store, out) + [f"--config.model.d_model={d_model}", "--config.model.num_heads=4",
                                                "--config.model.num_kv_heads=4"], capsys)
  assert_exit(code, output, EXIT_BAD_INPUT, "does not fit", "estimated peak", f"model.d_model={d_model}",
              "runtime.check_memory")
  assert "compiled" not in output and not out.exists()  # refused before the output dir, let alone a compile


# ---- index_data -------------------------------------------------------------------------------

def index_data(*args, timeout=120):
  # PYTHONIOENCODING=utf-8: a UTF-8 terminal, where printing a non-UTF-8 file name raw would fail.
  return subprocess.run([sys.executable, "tools/index_data.py", *args], cwd=REPO, capture_output=True, text=True,
                        env={**ENV, "PYTHONIOENCODING": "utf-8"}, timeout=timeout)


def test_index_data_non_utf8_file_name_and_symlink_loops(tmp_path):
  tree = tmp_path / "tree"
  (tree / "a" / "b").mkdir(parents=True)
  (tree / "a" / "b" / "deep.txt").write_text("deep file\n")
  (tree / "top.txt").write_text("top file\n")
  with open(os.path.join(os.fsencode(tree), b"caf\xe9.txt"), "wb") as f:  # Latin-1 name: not UTF-8
    f.write(b"latin-1 named\n")
  for link, target in (("a/loop", ".."), ("a/b/loop", "../.."), ("self", ".")):  # loops at every level
    (tree / link).symlink_to(target)
  proc = index_data("--input", f"{tree}/**", "--output", str(tmp_path / "out"), "--val-fraction=0.3")
  output = proc.stdout + proc.stderr
  assert_exit(proc.returncode, output, 0, "indexed 3 documents from 3 files")  # each file once, loops or not
  assert all((tmp_path / f"out.{split}.bin").exists() for split in ("train", "val"))
  (tree / "caf\udce9.txt").write_bytes(b"\xff not utf-8\n")  # the same name, now with undecodable text
  proc = index_data("--input", str(tree), "--output", str(tmp_path / "strict"), "--errors=strict")
  assert_exit(proc.returncode, proc.stdout + proc.stderr, EXIT_BAD_INPUT, "caf\\xe9.txt", "not valid UTF-8")
  assert not list(tmp_path.glob("strict*"))


# ---- convert from-hf --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  pytest.importorskip("transformers", reason="convert tests need the test extra: pip install -e '.[test]'")
  from hf_models import make_hf_model

  directory = tmp_path_factory.mktemp("hf") / "tiny"
  make_hf_model(directory, "gqa_untied", tokenizer=False)
  return directory


def hostile_copy(hf_dir: Path, to: Path, case: str) -> str:
  """A copy of the tiny HF model damaged per `case`; returns the culprit the error must name."""
  to.mkdir()
  config = json.loads((hf_dir / "config.json").read_text())
  weights = (hf_dir / "model.safetensors").read_bytes()
  culprit = {"string number": "hidden_size", "not a number": "hidden_size", "string theta": "rope_theta",
             "absurd header": "model.safetensors", "truncated tensor": "truncated"}[case]
  if case == "string number":
    config["hidden_size"] = str(config["hidden_size"])
  elif case == "not a number":
    config["hidden_size"] = "abc"
  elif case == "string theta":
    config["rope_theta"] = "1e4"
  elif case == "absurd header":
    weights = struct.pack("<Q", 2**62) + weights[8:]
  else:  # the header is fine, the data stops early: found mid-conversion, after files were written
    weights = weights[:len(weights) * 3 // 4]
  (to / "config.json").write_text(json.dumps(config))
  (to / "model.safetensors").write_bytes(weights)
  return culprit


@pytest.mark.parametrize("case", ["string number", "not a number", "string theta", "absurd header", "truncated tensor"])
def test_convert_from_hf_hostile_inputs_exit_2_and_leave_nothing(hf_dir, tmp_path, capsys, case):
  from maxtrain.cli import convert

  culprit = hostile_copy(hf_dir, tmp_path / "hf", case)
  capsys.readouterr()
  code = convert.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "out")])
  err = capsys.readouterr().err.strip()
  assert_exit(code, err, EXIT_BAD_INPUT, culprit, "maxtrain.convert: error:")
  assert len(err.splitlines()) == 1, err
  assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no output dir, no staging dir left


# ---- generate ---------------------------------------------------------------------------------

@pytest.mark.parametrize("flag,value", [("--temperature", "nan"), ("--temperature", "inf"), ("--temperature", "-1"),
                                        ("--top-p", "0"), ("--top-p", "1.5"), ("--top-p", "nan"), ("--top-k", "-1"),
                                        ("--max-new-tokens", "0")])
def test_generate_sampling_flags_out_of_range_exit_2_before_loading(tmp_path, capsys, flag, value):
  missing = tmp_path / "no-such-checkpoint"  # never opened: the flags are checked first
  code = generate.main(["--checkpoint", str(missing), "--prompt", "hi", f"{flag}={value}"])
  assert_exit(code, capsys.readouterr().err, EXIT_BAD_INPUT, f"{flag}=")


def test_generate_prompt_longer_than_max_seq_len_exit_2(hf_dir, tmp_path, capsys):
  from maxtrain.interop import hf_import

  hf_import.from_hf(hf_dir, tmp_path / "mt")  # max_position_embeddings=64 -> model.max_seq_len=64
  for prompt, new in (("x" * 70, 1), ("x" * 40, 40)):
    code = generate.main(["--checkpoint", str(tmp_path / "mt"), "--prompt", prompt, f"--max-new-tokens={new}"])
    captured = capsys.readouterr()
    assert_exit(code, captured.out + captured.err, EXIT_BAD_INPUT, "model.max_seq_len=64", "--max-new-tokens")


# ---- the supervisor's arguments ---------------------------------------------------------------

@pytest.mark.parametrize("arg", ["--backoff=-1", "--max-restarts=-1", "--window=0", "--window=-5", "--backoff=nan",
                                 "--max-backoff=-1", "--peer-grace=-1", "--processes=0"])
def test_launch_arguments_out_of_range_exit_2_at_parsing(store, tmp_path, capsys, arg):
  code = launch.main([arg, "--", *base(store, tmp_path / "run")])
  assert_exit(code, capsys.readouterr().err, EXIT_BAD_INPUT, arg.split("=")[0] + "=")
  assert not (tmp_path / "run").exists()  # refused before the output dir or any trainer


# ---- Ctrl-C during start-up -------------------------------------------------------------------

def test_ctrl_c_during_start_up_exits_130_and_is_not_restarted(store, tmp_path):
  out = tmp_path / "run"
  proc = subprocess.Popen([sys.executable, "-m", "maxtrain.train", *base(store, out)], cwd=REPO, env=ENV,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  seen = []
  for line in proc.stdout:  # the platform line comes before jax starts: well inside start-up
    seen.append(line)
    if "platform cpu:" in line:
      proc.send_signal(signal.SIGINT)
      break
  output = "".join(seen) + proc.stdout.read()
  # 130, or death by SIGINT (-2, which a shell also shows as 130 and the supervisor reads as 130): seen in 4 of
  # 23 runs after main() had handled the interrupt and returned 130, from the interpreter's exit (cause not found).
  assert_exit(launch.attempt_code([proc.wait(timeout=120)]), output, EXIT_INTERRUPTED, "interrupted (Ctrl-C)")
  assert "compiled" not in output and not (out / "checkpoints").exists()
  events = out / "events.jsonl"
  if events.exists():  # when the Ctrl-C came after the event log opened, its exit is recorded as such
    assert json.loads(events.read_text().splitlines()[-1])["code"] == EXIT_INTERRUPTED
  # The supervisor stops on it, also when the trainer died of the signal itself.
  assert EXIT_INTERRUPTED in NOT_RESTARTED and launch.attempt_code([-signal.SIGINT]) == EXIT_INTERRUPTED


def test_a_ctrl_c_swallowed_during_start_up_still_ends_the_run():
  """Python drops an exception raised inside a garbage-collection callback (jax registers one): a start-up
  Ctrl-C landing there used to vanish, and the run trained on to exit 0. The remembered one is raised again
  when the stop handler would be installed."""
  import gc

  from maxtrain.runtime.preemption import StopRequest, catch_start_up_interrupt

  def interrupted_collection(phase, info):
    if phase == "start":
      gc.callbacks.remove(interrupted_collection)
      os.kill(os.getpid(), signal.SIGINT)
      for _ in range(10_000):  # the handler runs at a bytecode boundary in here; its exception is dropped
        pass

  previous = signal.getsignal(signal.SIGINT)
  try:
    catch_start_up_interrupt()
    gc.callbacks.append(interrupted_collection)
    gc.collect()  # returns normally: the KeyboardInterrupt was printed as "ignored"
    with pytest.raises(KeyboardInterrupt):
      StopRequest().install()
    catch_start_up_interrupt()  # the next run in this process starts afresh
    StopRequest().install().uninstall()
  finally:
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_under_the_supervisor_is_not_a_crash(store, tmp_path):
  out = tmp_path / "run"
  proc = subprocess.Popen([sys.executable, "-m", "maxtrain.launch", "--backoff=0.01", "--", *base(store, out)],
                          cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True)
  seen = []
  for line in proc.stdout:
    seen.append(line)
    if "platform cpu:" in line:  # the trainer is starting
      os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole foreground group
      break
  output = "".join(seen) + proc.stdout.read()
  assert_exit(proc.wait(timeout=120), output, EXIT_INTERRUPTED, "attempt 0: exit 130 (interrupted (Ctrl-C))")
  assert "attempt 1" not in output and "restarting" not in output
  kinds = [json.loads(line)["kind"] for line in (out / "events.jsonl").read_text().splitlines()]
  assert "crash" not in kinds and kinds.count("restart") == 1


# ---- the optimizer ----------------------------------------------------------------------------

@pytest.mark.parametrize("overrides,key", [
    (["--config.optimizer.b2=1.0"], "config.optimizer.b2=1.0"),
    (["--config.optimizer.b2=1.5"], "config.optimizer.b2=1.5"),
    (["--config.optimizer.b1=-0.1"], "config.optimizer.b1=-0.1"),
    (["--config.optimizer.b1=1.0"], "config.optimizer.b1=1.0"),
    (["--config.optimizer.eps=0"], "config.optimizer.eps=0"),
    (["--config.optimizer.eps=-1e-8"], "config.optimizer.eps=-1e-08"),
    (["--config.optimizer.warmup_steps=50", "--config.optimizer.decay_steps=10"], "config.optimizer.warmup_steps=50"),
    (["--config.optimizer.warmup_steps=50", "--config.steps=10"], "longer than the run's LR schedule of 10 steps"),
])
def test_optimizer_settings_out_of_range_exit_2(store, tmp_path, capsys, overrides, key):
  code, output = run_train(base(store, tmp_path / "run") + overrides, capsys)
  assert_exit(code, output, EXIT_BAD_INPUT, key)
  assert "compiled" not in output and not (tmp_path / "run").exists()


def test_inherited_warmup_longer_than_a_short_run_is_said(store, tmp_path, capsys, caplog):
  """The default warmup (20) over a 2-step smoke run is legal, as every short test run trains, but not silent."""
  code, output = run_train(base(store, tmp_path / "run"), capsys)
  assert code == 0, output
  assert "optimizer.warmup_steps=20 > the schedule's 2 steps" in caplog.text


# ---- MFU: a contended peak is never the machine's peak -----------------------------------------

def test_contended_cpu_peak_is_remeasured_until_quiet(tmp_path):
  """The real matmul measurement; only its cpu_share reading is injected."""
  cache = tmp_path / "peak.json"

  def measurements():
    return next(iter(json.loads(cache.read_text()).values()))["measurements"]

  first = mfu.cpu_peak(cache, cpu_share=mfu.CONTENDED / 2)
  assert first.flops > 1e9 and first.contended and "measured now" in first.description
  best = first
  for expected in (2, 3, 4):  # contended again and again: never final, always measured again
    peak = mfu.cpu_peak(cache, cpu_share=mfu.CONTENDED / 2)
    assert peak.contended and measurements() == expected and peak.flops >= best.flops
    assert "contended: got 40% of the cores" in peak.description
    best = peak
  quiet = mfu.cpu_peak(cache, cpu_share=1.0)  # the machine is quiet now: the best of all is final
  assert not quiet.contended and quiet.flops >= best.flops and measurements() == 5
  again = mfu.cpu_peak(cache, cpu_share=mfu.CONTENDED / 2)  # from the cache: not measured again
  assert again == (quiet.flops, again.description, False) and "cached in" in again.description
  assert measurements() == 5 and "contended:" not in again.description


def test_mfu_line_says_when_the_peak_is_contended(tmp_path, caplog):
  import logging

  import numpy as np

  from maxtrain.monitor import events as ev
  from maxtrain.monitor.metrics import MetricsLogger

  caplog.set_level(logging.INFO, logger="maxtrain")
  with ev.EventLog(tmp_path / ev.FILENAME, 0) as events:
    for contended in (True, False):
      logger = MetricsLogger(tmp_path, events, total_steps=3, tokens_per_step=1000, flops_per_token=1e6,
                             peak_flops=1e12, peak_contended=contended)
      metrics = {"loss": np.float32(2.0), "grad_norm": np.float32(1.0), "lr": np.float32(1e-3)}
      caplog.clear()
      logger.first_step(1, metrics, 0.0)
      for step in (2, 3):
        logger.train(step, metrics)
      logger.close()
      lines = [r.getMessage() for r in caplog.records if "MFU" in r.getMessage()]
      assert lines and all(("contended peak" in line) == contended for line in lines), lines
