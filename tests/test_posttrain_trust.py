"""Post-training inputs checked like pretraining's (issue 37, cases 4 and 5), through the real entry
points: a reward that calls sys.exit or raises KeyboardInterrupt is a crash (exit 1, restarted by the
supervisor like any crash), never a finish; SFT data carry their identity in the checkpoint, so a resume
on an edited file or another `post.data` is exit 2 naming the file (post.resume_new_data goes on, with an
event); every data error names file:line (non-UTF-8 bytes, a lone surrogate, a too-long example); and a
checkpoint resumed in another mode is exit 2 naming both modes (case 9; GRPO's in test_posttrain.py)."""

import json
import subprocess
import sys

import pytest

from maxtrain.cli import train
from maxtrain.data import arithmetic
from maxtrain.monitor.events import read_events
from test_checkpoint import REPO
from tiny import TINY_MODEL, cpu_env

REWARDS = '''
import sys


def exits(prompt, completion, meta):
  sys.exit(0)


def interrupts(prompt, completion, meta):
  raise KeyboardInterrupt
'''

RL = ["--config=configs/grpo.py", *TINY_MODEL, "--config.data.seq_len=16", "--config.post.prompts_per_step=4",
      "--config.post.group_size=4", "--config.data.batch_size=8", "--config.post.eval_prompts=0",
      "--config.eval.every_steps=0", "--config.steps=2"]


def assert_clean(code, output, expected, *named):
  assert code == expected, output[-3000:]
  assert "Traceback" not in output, output[-3000:]
  for text in named:
    assert text in output, (text, output[-3000:])


def test_a_reward_that_exits_is_a_crash_under_the_supervisor(tmp_path):
  (tmp_path / "hostile_rewards.py").write_text(REWARDS)
  out = tmp_path / "run"
  env = cpu_env(1, PYTHONPATH=f"{tmp_path}:{REPO}")
  proc = subprocess.run([sys.executable, "-m", "maxtrain.launch", "--max-restarts=0", "--backoff=0.01", "--", *RL,
                         "--config.post.reward=hostile_rewards:exits", f"--config.output_dir={out}"],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  output = proc.stdout + proc.stderr
  assert_clean(proc.returncode, output, 1, "config.post.reward='hostile_rewards:exits' raised SystemExit(0)",
               "attempt 0: exit 1", "giving up")
  records = read_events(out / "events.jsonl")
  ends = [(r["kind"], r["code"]) for r in records if r["kind"] in ("crash", "exit")]
  assert ends[:2] == [("crash", 1), ("exit", 1)] and set(ends) == {("crash", 1), ("exit", 1)}  # + the supervisor's
  assert not (out / "summary.json").exists()  # it did not finish


def interrupts(prompt, completion, meta):
  raise KeyboardInterrupt


def test_a_reward_that_raises_keyboard_interrupt_is_a_crash(tmp_path, capsys):
  code = train.main(RL + ["--config.post.reward=test_posttrain_trust:interrupts", f"--config.output_dir={tmp_path}"])
  assert_clean(code, capsys.readouterr().err, 1, "maxtrain: crash: config.post.reward='test_posttrain_trust:"
               "interrupts' raised KeyboardInterrupt()")


def lines(examples):
  return "".join(json.dumps({"prompt": e["prompt"], "response": e["response"]}) + "\n" for e in examples)


SFT = [f"--config={REPO / 'configs/sft.py'}", *TINY_MODEL, "--config.post.eval_prompts=0", "--config.eval.every_steps=0",
       "--config.checkpoint.every_steps=2", "--config.log_every=2"]


def test_sft_resumed_on_other_data_is_exit_2_naming_it(tmp_path, capsys):
  data, other = tmp_path / "train.jsonl", tmp_path / "other.jsonl"
  examples = arithmetic.examples("train")
  data.write_text(lines(examples[:200]))
  other.write_text(lines(examples[200:400]))
  out = tmp_path / "run"
  args = SFT + [f"--config.output_dir={out}"]
  assert train.main(args + [f"--config.post.data={data}", "--config.steps=4"]) == 0
  capsys.readouterr()
  data.write_text(lines(examples[500:550]) + data.read_text())  # 50 lines prepended
  code = train.main(args + [f"--config.post.data={data}", "--config.steps=6"])
  assert_clean(code, capsys.readouterr().err, 2, f"{data} changed since (size", "post.resume_new_data=true")
  code = train.main(args + [f"--config.post.data={other}", "--config.steps=6"])
  assert_clean(code, capsys.readouterr().err, 2, f"it read {data}, this run reads {other} (config.post.data)")
  # A checkpoint of one mode resumed in another (case 9): named both, before any data is read.
  code = train.main([*TINY_MODEL, f"--config.output_dir={out}", "--config.steps=6"])
  assert_clean(code, capsys.readouterr().err, 2, "was written by a SFT (post.mode='sft') run, but this run is "
               "pretraining (post.mode='')")
  # Said so: it goes on from the checkpoint's position, on the record.
  assert train.main(args + [f"--config.post.data={data}", "--config.steps=6", "--config.post.resume_new_data=true"]) == 0
  change = [r for r in read_events(out / "events.jsonl") if r["kind"] == "data_change"]
  assert len(change) == 1 and change[0]["step"] == 4 and str(data) in change[0]["change"]


@pytest.mark.parametrize("line,expected", [
    (b'{"prompt": "1+1=", "response": "caf\xe9"}', "bad.jsonl:2: not UTF-8 (byte 0xE9 at column 36)"),
    (b'{"prompt": "\\ud800", "response": "2"}', "bad.jsonl:2: field 'prompt' holds a lone surrogate '\\ud800'"),
    (json.dumps({"prompt": "1+" * 40 + "1=", "response": "41"}).encode(), "bad.jsonl:2: the example is 85 tokens (prompt 82, response 2 + EOS)"),
])
def test_sft_data_errors_name_file_and_line(tmp_path, capsys, line, expected):
  path = tmp_path / "bad.jsonl"
  good = lines(arithmetic.examples("train")[:40]).encode().split(b"\n")
  path.write_bytes(b"\n".join(good[:1] + [line] + good[1:]))
  code = train.main(SFT + [f"--config.post.data={path}", f"--config.output_dir={tmp_path / 'out'}"])
  assert_clean(code, capsys.readouterr().err, 2, expected)
