"""SFT data and loss: the loss counts response tokens only (the step's per-token loss, plain and
chunked, against a NumPy reference with a mask built from the text), packing, chat rendering, and
exit 2 on bad examples (missing fields, a response longer than seq_len) from the entry point."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxtrain import config as config_lib
from maxtrain.cli import train
from maxtrain.data import arithmetic, sft
from maxtrain.data.tokenizer import ByteTokenizer
from maxtrain.errors import UserError
from maxtrain.program import build, state as state_lib, step as step_lib
from tiny import TINY_MODEL

REPO = Path(__file__).resolve().parent.parent
TOK = ByteTokenizer()
EXAMPLES = [("17+25=", "42"), ("3+4=", "7"), ("Q: hello\nA:", " world"), ("99+99=", "198")]


def packed(seq_len=32):
  return sft.pack([sft.encode(TOK, p, r, seq_len, "test") for p, r in EXAMPLES], seq_len)


def test_pack_segments_positions_and_response_mask():
  rows = packed()
  assert len(rows) == 2  # 8 + 5 + 17 positions, then 9: greedy in order
  row = rows[0]
  seg, pos, mask, tgt = row["segment_ids"], row["positions"], row["loss_mask"], row["targets"]
  # Example 0 ("17+25=" + "42" + EOS): 8 positions, targets 1..8; only "4", "2", EOS are trained.
  assert list(seg[:8]) == [1] * 8 and list(pos[:8]) == list(range(8))
  assert list(mask[:8]) == [0, 0, 0, 0, 0, 1, 1, 1]
  assert TOK.decode(tgt[5:7]) == "42" and tgt[7] == TOK.eos_id
  assert list(seg[8:13]) == [2] * 5 and pos[8] == 0
  # The padding after the last example that fits: its own segment, no loss.
  assert seg[-1] == seg.max() and mask[-1] == 0
  text_targets = TOK.decode(np.concatenate([r["targets"][r["loss_mask"] > 0] for r in rows]))
  assert text_targets == "42" + "7" + " world" + "198"


def test_chat_messages_render_prompt_and_response():
  ex = sft.parse_example({"messages": [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+1="},
                                       {"role": "assistant", "content": "2"}]}, "f:1")
  assert ex["prompt"] == "<|system|>\nAdd.\n<|user|>\n1+1=\n<|assistant|>\n" and ex["response"] == "2"
  with pytest.raises(UserError, match="f:1.*'assistant'"):
    sft.parse_example({"messages": [{"role": "user", "content": "hi"}]}, "f:1")


def test_bad_examples_are_user_errors(tmp_path):
  path = tmp_path / "d.jsonl"
  path.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n" + json.dumps({"prompt": "a"}) + "\n")
  with pytest.raises(UserError, match=r"d.jsonl:2: missing .*\['response'\]"):
    sft.read_jsonl(str(path))
  with pytest.raises(UserError, match="response 40 \\+ EOS.*seq_len=32"):
    sft.encode(TOK, "p", "x" * 40, 32, "ex 3")


def test_arithmetic_split_and_reward():
  train, held = arithmetic.examples("train"), arithmetic.examples("eval")
  assert len(held) == arithmetic.HELD_OUT and len(train) + len(held) == 100 * 100
  assert not {e["prompt"] for e in train} & {e["prompt"] for e in held}
  e = held[0]
  assert arithmetic.reward(e["prompt"], f" {e['meta']['answer']}\n", e["meta"]) == 1.0
  assert arithmetic.reward(e["prompt"], e["meta"]["answer"] + "0", e["meta"]) == 0.0


@pytest.fixture(scope="module")
def tiny_program():
  cfg = config_lib.load(TINY_MODEL + ["--config.post.mode=sft", "--config.data.batch_size=2"])
  program = build.program_for(cfg, jax.devices()[:1])
  return program, state_lib.initialize(program.state, program.mesh).params


def test_loss_counts_response_tokens_only_against_numpy(tiny_program):
  program, params = tiny_program
  rows = packed()
  batch = {k: jnp.asarray(np.stack([r[k] for r in rows])) for k in rows[0]}
  # The mask from the text alone: positions whose target lies after the prompt of its example.
  mask = np.zeros((2, 32), np.float32)
  starts = [0, 8, 13, 0]  # each example's first position in its row (8, 5, 17 positions in row 0)
  for i, (p, r) in enumerate(EXAMPLES):
    row, n_p, n = int(i == 3), len(p.encode()), len((p + r).encode()) + 1
    mask[row, starts[i] + n_p - 1: starts[i] + n - 1] = 1.0
  np.testing.assert_array_equal(np.asarray(batch["loss_mask"]), mask)
  graphdef = program.state.graphdef

  @jax.jit  # one compiled program each, not op-by-op dispatch
  def logits_fn(params, batch):
    model = nnx.merge(graphdef, params)
    x, _ = model.features(batch["inputs"], batch["segment_ids"], batch["positions"])
    return x @ model.head_weights()

  logits = np.asarray(logits_fn(params, batch), np.float64)
  logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  ce = logz - np.take_along_axis(logits, np.asarray(batch["targets"])[..., None], -1)[..., 0]
  expected = (ce * mask).sum() / mask.sum()
  for chunk in (0, 8):  # the reference head and the chunked cross-entropy
    _, parts = jax.jit(lambda p, b: step_lib.loss_sums(graphdef, p, b, chunk_tokens=chunk))(params, batch)
    np.testing.assert_allclose(float(parts["ce"] / parts["count"]), expected, rtol=1e-5)
    assert float(parts["count"]) == mask.sum()


def test_entry_point_exits_2_on_a_missing_field(tmp_path, capsys):
  path = tmp_path / "bad.jsonl"
  path.write_text(json.dumps({"prompt": "1+1="}) + "\n")
  code = train.main([f"--config={REPO / 'configs/sft.py'}", *TINY_MODEL, f"--config.post.data={path}",
                     f"--config.output_dir={tmp_path / 'out'}"])  # in process: no second interpreter to start
  err = capsys.readouterr().err
  assert code == 2, err[-2000:]
  assert "bad.jsonl:1: missing or non-string field(s) ['response']" in err
  assert "Traceback" not in err


CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_a_hugging_face_chat_template_renders_chat_examples(tmp_path):
  """Chat examples with a tokenizer that has a chat template: the prompt is what `transformers`
  renders with the generation prompt, the response the rest of the whole conversation; the loss mask
  covers exactly the response's tokens and the EOS."""
  from transformers import PreTrainedTokenizerFast

  from hf_models import make_tokenizer
  from maxtrain.data.tokenizer import load_tokenizer

  make_tokenizer(tmp_path / "tokenizer.json")
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(
      {"chat_template": CHAT_TEMPLATE, "bos_token": "<s>", "eos_token": "</s>"}))
  messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+1="},
              {"role": "assistant", "content": "2"}]
  data = tmp_path / "chat.jsonl"
  data.write_text(json.dumps({"messages": messages}) + "\n")
  tok = load_tokenizer(str(tmp_path))
  [ex] = sft.read_jsonl(str(data), tok)
  hf = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), bos_token="<s>", eos_token="</s>")
  want_prompt = hf.apply_chat_template(messages[:-1], chat_template=CHAT_TEMPLATE, tokenize=False,
                                       add_generation_prompt=True)
  want_full = hf.apply_chat_template(messages, chat_template=CHAT_TEMPLATE, tokenize=False)
  assert ex["prompt"] == want_prompt == "<s><|system|>Add.</s><|user|>1+1=</s><|assistant|>"
  assert ex["prompt"] + ex["response"] == want_full and ex["response"] == "2</s>"
  [row] = sft.pack([sft.encode(tok, ex["prompt"], ex["response"], 64, "ex")], 64)
  trained = row["targets"][row["loss_mask"] > 0].tolist()
  assert trained == tok.encode("2</s>").tolist() + [tok.eos_id]
  assert sft.read_jsonl(str(data))[0]["prompt"].startswith("<|system|>\nAdd.")  # no tokenizer: <|role|> turns
