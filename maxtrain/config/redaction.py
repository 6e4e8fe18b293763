"""Secrets in configs: credentials reach a run through `runtime.env` (HF_TOKEN=..., AWS_SECRET_ACCESS_KEY=...)
or, by mistake, through any string key. Everything that writes or logs a config goes through `redacted`
(config.json, checkpoint meta, TensorBoard, the event log's config hash, log lines), so none of them can
hold a secret value; files that hold a config are written readable by their owner only."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import ml_collections

REDACTED = "<redacted>"
SECRET_ENV_KEYS = ("runtime.env",)  # every value of these KEY=VALUE lists is redacted, whatever its name
# A name is a credential's when one of its words is one of these, or it contains SECRET, PASSWORD or
# CREDENTIAL anywhere (`data.tokenizer` and `model.loss_chunk_tokens` are not: whole words only).
_SECRET_WORDS = {"token", "key", "apikey", "secret", "password", "passwd", "credential", "credentials", "auth"}
_SECRET_PARTS = ("secret", "password", "passwd", "credential")
# Values that are credentials whatever the name: AWS access key ids, Hugging Face, GitHub, OpenAI and
# Slack tokens, the password of a URL (scheme://user:password@host), and NAME=value pairs inside a
# string whose NAME looks like a credential's.
_SECRET_VALUES = re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b|\bhf_[A-Za-z0-9]{16,}|\bgh[pousr]_[A-Za-z0-9]{20,}"
                            r"|\bsk-[A-Za-z0-9_-]{20,}|\bxox[abpr]-[A-Za-z0-9-]{10,}")
_URL_PASSWORD = re.compile(r"(\w+://[^/\s:@]+:)[^/\s@]+(@)")
_NAMED_PAIR = re.compile(r"\b([A-Za-z_][A-Za-z0-9_.]*)=([^,\s]*)")


def is_secret_name(name: str) -> bool:
  low = name.lower()
  return any(w in _SECRET_WORDS for w in re.split(r"[^a-z0-9]+", low)) or any(p in low for p in _SECRET_PARTS)


def redact_text(text: str) -> str:
  """`text` with every credential-looking value replaced by <redacted> (for log lines and messages)."""
  text = _SECRET_VALUES.sub(REDACTED, text)
  text = _URL_PASSWORD.sub(rf"\g<1>{REDACTED}\g<2>", text)
  return _NAMED_PAIR.sub(lambda m: f"{m[1]}={REDACTED}" if is_secret_name(m[1]) and m[2] else m[0], text)


def redact_env_list(text: str) -> str:
  """`K=V,K=V` (runtime.env) -> `K=<redacted>,K=<redacted>`: the names stay, no value does."""
  names = re.findall(r"(?:^|,)\s*([A-Za-z_][A-Za-z0-9_]*)=", text)
  return ",".join(f"{name}={REDACTED}" for name in names) if names else (REDACTED if text else text)


def _redact_value(key: str, value: Any) -> Any:
  if not isinstance(value, str) or not value:
    return value
  if key in SECRET_ENV_KEYS:
    return redact_env_list(value)
  if is_secret_name(key.rsplit(".", 1)[-1]):
    return REDACTED
  return redact_text(value)


def redacted(cfg: Any, prefix: str = "") -> dict:
  """The config (a ConfigDict, its typed Config or a dict) as a plain dict with every secret value replaced by <redacted>: the only form in which
  a config is written or logged."""
  out = {}
  for key, value in cfg.items():
    if isinstance(value, (ml_collections.ConfigDict, dict)) or hasattr(value, "to_dict"):  # or a typed section
      out[key] = redacted(value, f"{prefix}{key}.")
    else:
      out[key] = _redact_value(prefix + key, value)
  return out


def write_private(path: str | Path, text: str) -> None:
  """Writes `text` to a file only its owner can read (0o600, also when it existed with another mode)."""
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
  with os.fdopen(fd, "w") as f:
    os.fchmod(f.fileno(), 0o600)
    f.write(text)


def save(cfg: Any, path: str | Path) -> None:
  """The resolved config as JSON (config.json of a run), secrets redacted, readable by its owner only."""
  write_private(path, json.dumps(redacted(cfg), indent=2, sort_keys=True) + "\n")
