"""A checkpoint's saved config, brought to today's keys: the one reader of a saved config.

Every checkpoint saves its run's resolved config (redacted) in its meta. Whoever compares a resumed or
imported checkpoint with this run (its model math, optimizer, tokenizer, mode, mesh) reads that config through
`saved_config(meta, where)`, never `meta["config"]` itself, so an older checkpoint is read one way everywhere:
- a key renamed since it was saved moves to its new name (`RENAMED`); a key maxtrain dropped is ignored
  (`REMOVED`): both empty today (every key ever declared is still declared, with its meaning);
- a key it lacks (saved before the key existed) takes today's declared default, which is what that
  checkpoint ran: a key is added with the default that keeps the old behaviour (model keys the llama way,
  post.mode pretraining), not a family's published value;
- a key neither today's declarations nor the tables above know is exit 2 naming it (a checkpoint of a newer
  maxtrain, or an edited one): it is never dropped unread.
"""

from __future__ import annotations

from typing import Any, Mapping

from maxtrain.config.keys import FAMILY_BASE, base_config, declared_keys, flat_items, unknown_key
from maxtrain.errors import UserError

RENAMED: dict[str, str] = {}  # a saved config's dotted key -> today's name for it
REMOVED: frozenset[str] = frozenset()  # saved keys that no longer mean anything (their values are ignored)


def defaults() -> dict[str, Any]:
  """Dotted key -> declared default (llama's model keys: a family's published values are not defaults)."""
  token = FAMILY_BASE.set({})
  try:
    return flat_items(base_config())
  finally:
    FAMILY_BASE.reset(token)


def migrate(saved: Mapping[str, Any], where: str = "a saved config") -> dict[str, Any]:
  """The saved config (nested dicts, as the meta holds it) with today's keys, every one of them present;
  UserError naming a key that neither today's declarations nor RENAMED / REMOVED know."""
  flat = flat_items(saved)
  for old, new in RENAMED.items():
    if old in flat:
      value = flat.pop(old)
      flat.setdefault(new, value)  # a config saved with both names already had the new one
  unknown = sorted(k for k in flat if k not in declared_keys() and k not in REMOVED)
  if unknown:
    raise unknown_key(unknown[0], f"{where}: ", "It was saved by a maxtrain that has this key and this one has not "
                      "(a newer one), or edited: resume it with the maxtrain that wrote it, or, where the key was "
                      "renamed or dropped since, add it to RENAMED or REMOVED in maxtrain/config/migrate.py.")
  merged = {**defaults(), **{k: v for k, v in flat.items() if k not in REMOVED}}
  return _nest(merged)


def saved_config(meta: Mapping[str, Any], where: str) -> dict[str, Any]:
  """The config a checkpoint was saved with (its meta's `config`), migrated; `where` names the checkpoint
  (`checkpoint PATH`) in the error."""
  saved = meta.get("config")
  if not isinstance(saved, Mapping):
    raise UserError(f"{where}: its meta has no saved config (every maxtrain checkpoint saves its run's config): not "
                    "a maxtrain training checkpoint, or its meta was rewritten. Resume from another checkpoint.")
  version = meta.get("version")
  return migrate(saved, f"{where} (saved by maxtrain {version}), in its saved config" if version else
                 f"{where}, in its saved config")


def _nest(flat: Mapping[str, Any]) -> dict[str, Any]:
  out: dict[str, Any] = {}
  for key, value in flat.items():
    *sections, leaf = key.split(".")
    node = out
    for section in sections:
      node = node.setdefault(section, {})
    node[leaf] = value
  return out
