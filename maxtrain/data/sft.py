"""Supervised fine-tuning data: prompt/response examples (JSONL, or the embedded arithmetic task),
tokenized with the run's tokenizer and packed into the pipeline's [seq_len] rows (`pipeline.KEYS`)
with one segment per example and the loss on response tokens only.

An example is `prompt + response + EOS` as tokens t[0..n-1] (BOS first when the tokenizer has one
in use: never for the byte tokenizer, which marks documents by EOS only). Packed, it contributes n-1
positions: inputs t[:-1], targets t[1:], positions 0..n-2, its own segment id, and
loss_mask[j] = 1 exactly where the target t[j+1] is a response token (or the EOS). A chat example
(`{"messages": [{"role": ..., "content": ...}, ...]}`) is rendered as "<|role|>\\ncontent\\n" turns; its
last message, which must be the assistant's, is the response and everything before it the prompt.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from maxtrain.data import arithmetic
from maxtrain.data.pipeline import DTYPES, KEYS
from maxtrain.errors import UserError, require

TASKS = ("arithmetic",)


def render_chat(messages: list, where: str) -> tuple[str, str]:
  """(prompt, response) of a chat example: turns before the last, and the last (assistant) message."""
  require(isinstance(messages, list) and messages, f"{where}: 'messages' must be a non-empty list")
  for i, m in enumerate(messages):
    require(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str),
            f"{where}: messages[{i}] needs string fields 'role' and 'content'")
  require(messages[-1]["role"] == "assistant",
          f"{where}: the last message's role is {messages[-1]['role']!r}; it must be 'assistant' (the response)")
  turns = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages[:-1])
  return turns + "<|assistant|>\n", messages[-1]["content"]


def render_template(template: str, messages: list, where: str, special: dict[str, str]) -> tuple[str, str]:
  """(prompt, response) with a Hugging Face chat template (Jinja, rendered as `transformers` does): the
  prompt is the turns before the last plus the generation prompt; the response is what rendering the
  whole conversation adds after it (the answer and the template's end of turn)."""
  import jinja2
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
  env.globals["raise_exception"] = raise_exception
  try:
    compiled = env.from_string(template)
    prompt = compiled.render(messages=messages[:-1], add_generation_prompt=True, **special)
    full = compiled.render(messages=messages, add_generation_prompt=False, **special)
  except jinja2.TemplateError as e:
    raise UserError(f"{where}: the tokenizer's chat template failed on this example ({e})") from None
  require(full.startswith(prompt) and len(full) > len(prompt), f"{where}: the tokenizer's chat template does not "
          "render the conversation as the generation prompt followed by the assistant's answer; use prompt/response "
          "fields instead of messages")
  return prompt, full[len(prompt):]


def parse_example(record: Any, where: str, tokenizer: Any = None) -> dict[str, Any]:
  """{"prompt", "response", "meta"} of one JSON record; UserError naming `where` and the field. Chat
  messages use `tokenizer`'s chat template when it has one, else the <|role|> rendering."""
  require(isinstance(record, dict), f"{where}: each line must be a JSON object")
  if "messages" in record:
    prompt, response = render_chat(record["messages"], where)  # checks the messages
    template = getattr(tokenizer, "chat_template", None)
    if template:
      prompt, response = render_template(template, record["messages"], where, tokenizer.special_tokens)
  else:
    missing = [k for k in ("prompt", "response") if not isinstance(record.get(k), str)]
    require(not missing, f"{where}: missing or non-string field(s) {missing}: each line needs string "
            "'prompt' and 'response' (or 'messages' with roles)")
    prompt, response = record["prompt"], record["response"]
  return {"prompt": prompt, "response": response, "meta": record.get("meta", {})}


def read_jsonl(path: str, tokenizer: Any = None) -> list[dict[str, Any]]:
  """The examples of a JSONL file (UserError naming the file and line on bad input)."""
  p = Path(path)
  require(p.is_file(), f"config.post.data={path}: no such file (a JSONL of prompt/response or messages)")
  out = []
  for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise UserError(f"{path}:{i}: not JSON ({e.msg})") from None
    out.append(parse_example(record, f"{path}:{i}", tokenizer))
  require(bool(out), f"config.post.data={path}: no examples")
  return out


def load_examples(source: str, split: str, tokenizer: Any = None) -> list[dict[str, Any]]:
  """`source` = a task name (TASKS) or a JSONL path: for a path, "eval" reads PATH's sibling with
  `.eval` before the suffix when there is one, else the last 5% of the file. `tokenizer`: its chat
  template renders chat examples (`parse_example`)."""
  if source in TASKS or not source:
    return arithmetic.examples(split)
  eval_path = Path(source).with_suffix(".eval" + Path(source).suffix)
  if eval_path.is_file():
    return read_jsonl(str(eval_path if split == "eval" else source), tokenizer)
  rows = read_jsonl(source, tokenizer)
  cut = len(rows) - max(1, len(rows) // 20)
  return rows[cut:] if split == "eval" else rows[:cut]


def encode(tokenizer: Any, prompt: str, response: str, seq_len: int, where: str) -> tuple[np.ndarray, int]:
  """(tokens, number of prompt tokens): prompt + response + EOS; UserError if it exceeds seq_len + 1."""
  p_ids = np.asarray(tokenizer.encode(prompt), np.int32)
  r_ids = np.asarray(tokenizer.encode(response), np.int32)
  tokens = np.concatenate([p_ids, r_ids, [tokenizer.eos_id]]).astype(np.int32)
  require(len(r_ids) + 1 <= seq_len and len(tokens) <= seq_len + 1,
          f"{where}: the example is {len(tokens)} tokens (prompt {len(p_ids)}, response {len(r_ids)} + EOS), "
          f"longer than config.data.seq_len={seq_len} + 1: raise data.seq_len or shorten it")
  return tokens, len(p_ids)


def example_rows(tokens: np.ndarray, n_prompt: int) -> dict[str, np.ndarray]:
  """One example's positions: inputs/targets/positions/loss_mask (segment ids set by `pack`)."""
  n = len(tokens) - 1
  return {"inputs": tokens[:-1], "targets": tokens[1:], "positions": np.arange(n, dtype=np.int32),
          "loss_mask": (np.arange(1, n + 1) >= n_prompt).astype(np.float32)}


def pack(encoded: Iterable[tuple[np.ndarray, int]], seq_len: int) -> list[dict[str, np.ndarray]]:
  """Greedy first-fit packing in order: examples into rows of `seq_len`, each its own segment; the
  rest of a row is padding (its own segment, loss-masked)."""
  rows, current, used = [], [], 0

  def flush():
    parts = [dict(p, segment_ids=np.full(len(p["inputs"]), i + 1, np.int32)) for i, p in enumerate(current)]
    pad = seq_len - used
    if pad:
      parts.append({"inputs": np.zeros(pad, np.int32), "targets": np.zeros(pad, np.int32),
                    "positions": np.arange(pad, dtype=np.int32), "loss_mask": np.zeros(pad, np.float32),
                    "segment_ids": np.full(pad, len(current) + 1, np.int32)})
    rows.append({k: np.concatenate([p[k] for p in parts]).astype(DTYPES[k]) for k in KEYS})

  for tokens, n_prompt in encoded:
    part = example_rows(tokens, n_prompt)
    if used + len(part["inputs"]) > seq_len:
      flush()
      current, used = [], 0
    current.append(part)
    used += len(part["inputs"])
  if current:
    flush()
  return rows


def packed_rows(source: str, split: str, tokenizer: Any, seq_len: int, seed: int) -> np.ndarray | dict:
  """The split's examples, shuffled by `seed` (train) and packed: a dict of [rows, seq_len] arrays."""
  examples = load_examples(source, split, tokenizer)
  order = np.random.default_rng(seed).permutation(len(examples)) if split == "train" else range(len(examples))
  where = source or "post.data"
  encoded = (encode(tokenizer, examples[i]["prompt"], examples[i]["response"], seq_len, f"{where} example {i}")
             for i in order)
  rows = pack(encoded, seq_len)
  return {k: np.stack([r[k] for r in rows]) for k in KEYS}
