"""Tokenizers: a dependency-free byte tokenizer and local Hugging Face files.

Every tokenizer has a stable `identity` string that token stores record, so a
store built with one tokenizer is never silently trained with another.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from maxtrain.errors import UserError


@runtime_checkable
class Tokenizer(Protocol):
  """What the indexer and trainer need from a tokenizer."""

  vocab_size: int
  bos_id: int
  eos_id: int
  pad_id: int
  identity: str
  prompt_prefix: tuple[int, ...]  # ids a prompt starts with (generation, evaluation); see prompt_ids

  def encode(self, text: str) -> np.ndarray:
    """Returns int32 ids for `text`, without adding special tokens."""
    ...

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    """Returns the text for `ids`, skipping special tokens."""
    ...


class ByteTokenizer:
  """UTF-8 bytes as ids 0..255, plus BOS/EOS/PAD. Needs no files at all."""

  vocab_size = 259
  bos_id = 256
  eos_id = 257
  pad_id = 258
  identity = "byte-v1"
  # Training's convention: stored documents carry no BOS (tokens + EOS) and each starts at position 0 of
  # its own segment, so a prompt starts the same way, with nothing before it.
  prompt_prefix: tuple[int, ...] = ()
  chat_template: str | None = None  # chat examples use data/sft.py's <|role|> rendering

  def encode(self, text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    ids = np.asarray(ids).reshape(-1)
    ids = ids[(ids >= 0) & (ids < 256)]  # Drops the specials.
    return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

  def __repr__(self) -> str:
    return "ByteTokenizer()"


# Checked in order; the first name present in the vocabulary wins.
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>",
              "<|bos|>", "[BOS]", "[CLS]")
_EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eos|>",
              "[EOS]", "<|im_end|>", "[SEP]")
_PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>", "<|padding|>", "<|finetune_right_pad_id|>")


class HFTokenizer:
  """A local Hugging Face `tokenizer.json`, loaded with the `tokenizers` package."""

  def __init__(self, path: str | os.PathLike):
    import tokenizers  # Deferred: the byte tokenizer must not need it.

    path = os.fspath(path)
    if os.path.isdir(path):
      path = os.path.join(path, "tokenizer.json")
    try:
      with open(path, "rb") as f:
        raw = f.read()
    except OSError as e:
      raise UserError(
          f"tokenizer file {path!r} could not be read ({e.strerror or e}); "
          "pass 'byte' or the path of a local Hugging Face tokenizer.json"
      ) from None
    try:
      self._tok = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as e:  # The Rust side raises plain Exceptions.
      raise UserError(
          f"tokenizer file {path!r} is not a valid Hugging Face tokenizer.json "
          f"({e}); pass 'byte' or a tokenizer.json saved by `tokenizers`"
      ) from None
    self.path = path
    self.identity = "hf:" + hashlib.sha256(raw).hexdigest()
    self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
    vocab = self._tok.get_vocab(with_added_tokens=True)
    eos = _first_present(vocab, _EOS_NAMES)
    if eos is None:
      raise UserError(
          f"tokenizer file {path!r} has no end-of-text token (looked for "
          f"{', '.join(_EOS_NAMES)}); add one of them as a special token, it "
          "marks document boundaries"
      )
    self.eos_id = eos
    bos = _first_present(vocab, _BOS_NAMES)
    pad = _first_present(vocab, _PAD_NAMES)
    self.bos_id = eos if bos is None else bos
    self.pad_id = eos if pad is None else pad
    self.prompt_prefix = self._post_processor_prefix()
    self.chat_template, self.special_tokens = self._chat_template(os.path.dirname(path))

  def _chat_template(self, directory: str) -> tuple[str | None, dict[str, str]]:
    """The chat template saved beside tokenizer.json (`chat_template.jinja`, else `tokenizer_config.json`'s
    "chat_template"; None without one) and the bos/eos token strings it is rendered with."""
    config: dict = {}
    config_path = os.path.join(directory, "tokenizer_config.json")
    if os.path.isfile(config_path):
      try:
        with open(config_path, encoding="utf-8") as f:
          config = json.load(f)
      except (OSError, ValueError) as e:
        raise UserError(f"{config_path!r} is not readable JSON ({e}): fix or remove it") from None
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
      template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    jinja_path = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(jinja_path):
      with open(jinja_path, encoding="utf-8") as f:
        template = f.read()
    special = {}
    for name, default_id in (("bos_token", self.bos_id), ("eos_token", self.eos_id)):
      value = config.get(name)
      value = value.get("content") if isinstance(value, dict) else value
      special[name] = value if isinstance(value, str) else self._tok.id_to_token(default_id)
    return (template if isinstance(template, str) and template else None), special

  def _post_processor_prefix(self) -> tuple[int, ...]:
    """The ids the tokenizer's own post-processor puts before a single text (a Llama-style template's BOS;
    none for a byte-level BPE's): what `transformers` encodes a prompt with."""
    plain = self._tok.encode("a", add_special_tokens=False).ids
    full = self._tok.encode("a", add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
      if full[start:start + len(plain)] == plain:
        return tuple(full[:start])
    return ()

  def encode(self, text: str) -> np.ndarray:
    ids = self._tok.encode(text, add_special_tokens=False).ids
    return np.asarray(ids, dtype=np.int32)

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    ids = [int(i) for i in np.asarray(ids).reshape(-1)]
    return self._tok.decode(ids, skip_special_tokens=True)

  def __repr__(self) -> str:
    return f"HFTokenizer({self.path!r})"


def prompt_ids(tokenizer: Tokenizer, text: str) -> list[int]:
  """`text` encoded as a prompt: the tokenizer's prompt prefix, then its tokens."""
  return list(tokenizer.prompt_prefix) + tokenizer.encode(text).tolist()


def _first_present(vocab: dict[str, int], names: Sequence[str]) -> int | None:
  for name in names:
    if name in vocab:
      return int(vocab[name])
  return None


def load_tokenizer(spec: str) -> Tokenizer:
  """Returns the tokenizer for `spec`: "byte", or a path to a tokenizer.json.

  A directory holding a `tokenizer.json` is accepted too.
  """
  if spec == "byte":
    return ByteTokenizer()
  if not spec or not os.path.exists(spec):
    raise UserError(
        f"tokenizer {spec!r} is neither 'byte' nor an existing file; pass "
        "'byte' or the path of a local Hugging Face tokenizer.json"
    )
  return HFTokenizer(spec)
