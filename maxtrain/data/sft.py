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

import hashlib
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


def _check_text(value: Any, where: str, field: str) -> None:
  """A string must encode as UTF-8: JSON's "\\ud800" escape decodes to a lone surrogate, which no tokenizer
  can encode (a traceback deep in the packing, before this check)."""
  if isinstance(value, str):
    try:
      value.encode("utf-8")
    except UnicodeEncodeError as e:
      raise UserError(f"{where}: field {field!r} holds a lone surrogate {value[e.start]!r} (a \\ud800-\\udfff escape "
                      "that is not half of a pair): not text; fix or drop that line") from None


def read_jsonl(path: str, tokenizer: Any = None) -> list[dict[str, Any]]:
  """The examples of a JSONL file, each with its `where` (PATH:LINE); UserError naming the file and line
  on bad input (not UTF-8, not JSON, missing fields, a lone surrogate)."""
  p = Path(path)
  require(p.is_file(), f"config.post.data={path}: no such file (a JSONL of prompt/response or messages)")
  out = []
  for i, raw in enumerate(p.read_bytes().split(b"\n"), 1):
    try:
      line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
      raise UserError(f"{path}:{i}: not UTF-8 (byte 0x{raw[e.start]:02X} at column {e.start + 1}): save the file "
                      "as UTF-8") from None
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise UserError(f"{path}:{i}: not JSON ({e.msg})") from None
    example = parse_example(record, f"{path}:{i}", tokenizer)
    for field in ("prompt", "response"):
      _check_text(example[field], f"{path}:{i}", field)
    out.append({**example, "where": f"{path}:{i}"})
  require(bool(out), f"config.post.data={path}: no examples")
  return out


def _files(source: str) -> list[Path]:
  """The files a JSONL source reads: PATH, and its `.eval` sibling when there is one."""
  eval_path = Path(source).with_suffix(".eval" + Path(source).suffix)
  return [Path(source)] + ([eval_path] if eval_path.is_file() else [])


def source_identity(source: str) -> dict[str, Any]:
  """What a post-training source is, for the checkpoint's data state: a task's name, or each file's path,
  size and SHA-256 (of the bytes read: an edit anywhere, even one that keeps the size, changes it)."""
  if source in TASKS or not source:
    return {"task": source or "arithmetic"}
  files = []
  for path in _files(source):
    data = path.read_bytes() if path.is_file() else b""
    files.append({"path": str(path.resolve()), "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
  return {"files": files}


def describe_change(saved: dict[str, Any], now: dict[str, Any]) -> str:
  """One line naming what differs between two `source_identity`s (the file and how)."""
  if "task" in saved or "task" in now:
    return f"it read {_name(saved)}, this run reads {_name(now)} (config.post.data)"
  before = {f["path"]: f for f in saved.get("files", [])}
  after = {f["path"]: f for f in now.get("files", [])}
  if set(before) != set(after):
    return f"it read {_name(saved)}, this run reads {_name(now)} (config.post.data)"
  for path, f in after.items():
    old = before[path]
    if old != f:
      return (f"{path} changed since (size {old['size']} -> {f['size']} bytes, sha256 {old['sha256'][:12]} -> "
              f"{f['sha256'][:12]})")
  return "the data differs"


def _name(identity: dict[str, Any]) -> str:
  if "task" in identity:
    return f"the task {identity['task']!r}"
  return " and ".join(f["path"] for f in identity.get("files", [])) or "nothing"


def load_examples(source: str, split: str, tokenizer: Any = None) -> list[dict[str, Any]]:
  """`source` = a task name (TASKS) or a JSONL path: for a path, "eval" reads PATH's sibling with
  `.eval` before the suffix when there is one, else the last 5% of the file. `tokenizer`: its chat
  template renders chat examples (`parse_example`)."""
  if source in TASKS or not source:
    return [{**e, "where": f"{source or 'arithmetic'} {split} example {i}"} for i, e in enumerate(arithmetic.examples(split))]
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
  encoded = (encode(tokenizer, examples[i]["prompt"], examples[i]["response"], seq_len, examples[i]["where"])
             for i in order)
  rows = pack(encoded, seq_len)
  return {k: np.stack([r[k] for r in rows]) for k in KEYS}
