"""Flag strings (XLA_FLAGS, NEURON_CC_FLAGS, LIBTPU_INIT_ARGS) merged by flag name, and KEY=VALUE lists.

A flag given at a higher precedence replaces the flag of the same name from a lower one, in place;
other flags stay. The text of each flag is kept as written, so the merge never rewrites a value.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Sequence

from maxtrain.errors import UserError

Normalize = Callable[[str, "str | None"], "tuple[str, str | None]"]
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


@dataclasses.dataclass(frozen=True)
class Flag:
  name: str  # canonical name, the merge key
  value: str | None
  text: str  # as written, e.g. "--model-type transformer"
  origin: str  # where it came from, for the log
  replaced: str = ""  # origin of the flag of the same name it replaced, if any


def tokenize(text: str) -> list[str]:
  """Whitespace-separated tokens; quoted parts ('a b', "a b") stay inside their token, quotes kept."""
  tokens, current, quote = [], "", ""
  for ch in text:
    if quote:
      quote = "" if ch == quote else quote
    elif ch in "'\"":
      quote = ch
    elif ch.isspace():
      if current:
        tokens.append(current)
      current = ""
      continue
    current += ch
  if quote:
    raise UserError(f"unbalanced quote in flags {text!r}")
  return tokens + ([current] if current else [])


def identity(name: str, value: str | None) -> tuple[str, str | None]:
  return name, value


def parse(text: str, origin: str, normalize: Normalize = identity) -> list[Flag]:
  """`--a=1 --b 2 -c` -> flags a, b, c. A token not starting with '-' is the value of the flag before
  it (`--model-type transformer`)."""
  flags: list[Flag] = []
  for token in tokenize(text):
    if not token.startswith("-") and flags and flags[-1].value is None and "=" not in flags[-1].text:
      last = flags.pop()
      name, value = normalize(last.text, token)
      flags.append(Flag(name, value, f"{last.text} {token}", origin))
      continue
    raw_name, eq, raw_value = token.partition("=")
    name, value = normalize(raw_name, raw_value if eq else None)
    flags.append(Flag(name, value, token, origin))
  return flags


def merge(layers: Sequence[tuple[str, str]], normalize: Normalize = identity) -> list[Flag]:
  """Flags of (origin, text) layers, lowest precedence first, merged by name: a later flag replaces
  an earlier one of the same name where the earlier one stood."""
  merged: dict[str, Flag] = {}
  for origin, text in layers:
    for flag in parse(text, origin, normalize):
      old = merged.get(flag.name)
      merged[flag.name] = dataclasses.replace(flag, replaced=old.origin) if old else flag
  return list(merged.values())


def render(flags: Sequence[Flag]) -> str:
  return " ".join(f.text for f in flags)


def find(flags: Sequence[Flag], name: str) -> Flag | None:
  return next((f for f in flags if f.name == name), None)


def parse_env_list(text: str, key: str) -> dict[str, str]:
  """`KEY=VALUE,KEY=VALUE` -> dict. A comma not followed by `NAME=` belongs to the value, so
  `NCCL_PROTO=Simple,LL128,FOO=1` is two variables."""
  out: dict[str, str] = {}
  last = None
  for piece in text.split(",") if text.strip() else []:
    if _ENV_NAME.match(piece.strip()):
      name, _, val = piece.strip().partition("=")
      out[name], last = val, name
    elif last is not None:
      out[last] += "," + piece
    else:
      # The value is not echoed: it may hold a credential (HF_TOKEN=...).
      raise UserError(f"config.{key}: expected KEY=VALUE[,KEY=VALUE...] (the value is not shown: it may hold a "
                      "secret), e.g. "
                      f"{key}=NCCL_DEBUG=INFO,XLA_PYTHON_CLIENT_MEM_FRACTION=0.85")
  return out
