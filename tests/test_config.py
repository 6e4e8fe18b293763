"""Strict config (issue 42): typed configs refuse an undeclared key (naming the nearest declared one), and a
checkpoint's saved config is read through one `migrate` that brings it to today's keys. The entry-point
case (a checkpoint whose saved config has a key nobody knows) is in test_trust.py, beside the other
damaged-checkpoint cases that share its trained run."""

import dataclasses
import json
import re

import pytest

from maxtrain import config as config_lib
from maxtrain.config import migrate as migrate_lib, schema, sections
from maxtrain.config.migrate import migrate
from maxtrain.config.keys import FAMILY_BASE, declared_keys, flat_items
from maxtrain.config.loader import family_defaults
from maxtrain.errors import UserError
from maxtrain.models import registry
from maxtrain.models.decoder import ModelConfig
from maxtrain.models.mla import MLAConfig
from maxtrain.models.moe import MoEConfig
from maxtrain.models.quant import QuantConfig


def saved_dict() -> dict:
  """A config as a checkpoint's meta holds it: redacted, through JSON."""
  return json.loads(json.dumps(config_lib.redacted(config_lib.base_config())))


@pytest.mark.parametrize("build,section,key,nearest", [
    (ModelConfig.from_config, "model", "num_layer", "model.num_layers"),
    (QuantConfig.from_config, "model", "quant_kind", "model.quant_kinds"),
    (MoEConfig.from_config, "model.moe", "num_expert", "model.moe.num_experts"),
    (MLAConfig.from_config, "model.mla", "kv_lora_rnk", "model.mla.kv_lora_rank"),
])
def test_typed_model_configs_refuse_an_undeclared_key(build, section, key, nearest):
  """Each section as a ConfigDict and as a plain dict: the key is named with the nearest declared one; before
  issue 42 ModelConfig and QuantConfig dropped it silently (a misspelt saved key ran the default)."""
  cfg = config_lib.base_config()
  node = cfg
  for part in section.split("."):
    node = node[part]
  for values in (node, node.to_dict()):
    bad = dict(values.items()) if hasattr(values, "to_dict") else dict(values)
    bad[key] = 1
    with pytest.raises(UserError, match=rf"unknown config key config\.{section}\.{key}\. Did you mean config\.{nearest}"):
      build(bad)
    build(values)  # the declared keys alone build


def test_model_config_from_a_partial_dict_takes_the_defaults():
  """An HF import's keys (no quant or remat keys): missing is fine, only undeclared is refused."""
  model = config_lib.base_config().model.to_dict()
  keep = ("num_layers", "d_model", "num_heads", "num_kv_heads", "d_ff", "vocab_size", "max_seq_len")
  cfg = ModelConfig.from_config({**{k: model[k] for k in keep}, "quantization": "fp8", "moe": {"num_experts": 4}})
  assert (cfg.num_layers, cfg.moe.num_experts, cfg.quant) == (model["num_layers"], 4, QuantConfig(recipe="fp8"))


def test_migrate_keeps_every_saved_value_and_fills_missing_keys_with_declared_defaults():
  saved = saved_dict()
  assert migrate(saved) == saved  # today's checkpoint: unchanged
  saved["model"]["family"], saved["model"]["d_model"] = "deepseek_v3", 96
  del saved["post"]["mode"], saved["model"]["mla"], saved["model"]["mtp_layers"]  # saved before they existed
  migrated = migrate(saved)
  assert (migrated["model"]["family"], migrated["model"]["d_model"], migrated["post"]["mode"]) == ("deepseek_v3", 96, "")
  # the declared default (what the code ran before the key existed), not the family's published value
  assert family_defaults("deepseek_v3")["mla.kv_lora_rank"] == 512
  assert migrated["model"]["mla"] == config_lib.base_config().model.mla.to_dict() and migrated["model"]["mtp_layers"] == 0
  assert sorted(flat_items(migrated)) == sorted(declared_keys())


def test_migrate_defaults_ignore_a_family_base_being_loaded():
  token = FAMILY_BASE.set(family_defaults("deepseek_v3"))
  try:
    assert migrate({})["model"]["mla"]["kv_lora_rank"] == 0
  finally:
    FAMILY_BASE.reset(token)


def test_migrate_refuses_a_key_nobody_knows_naming_it_and_the_nearest():
  saved = saved_dict()
  saved["optimizer"]["lr_peak"] = 1e-3
  with pytest.raises(UserError, match=r"^checkpoint /c/4, in its saved config: unknown config key "
                     r"config\.optimizer\.lr_peak\. Did you mean config\.optimizer\.lr.*migrate\.py"):
    config_lib.saved_config({"config": saved}, "checkpoint /c/4")
  saved = saved_dict()
  saved["model"]["moe"] = 3  # a section saved as a value is no declared key either
  with pytest.raises(UserError, match=r"unknown config key config\.model\.moe\."):
    migrate(saved)


def test_saved_config_without_a_config_is_refused():
  with pytest.raises(UserError, match=r"checkpoint /c/4: its meta has no saved config"):
    config_lib.saved_config({"version": "0.1"}, "checkpoint /c/4")


def test_migrate_tables_name_today_keys_and_a_rename_moves_the_value(monkeypatch):
  """RENAMED points at declared keys and REMOVED at undeclared ones (both empty today: no key of keys.py's git
  history was ever renamed or dropped); the mechanism itself, on made-up old names."""
  assert set(migrate_lib.RENAMED.values()) <= declared_keys()
  assert not set(migrate_lib.RENAMED) & declared_keys() and not migrate_lib.REMOVED & declared_keys()
  monkeypatch.setattr(migrate_lib, "RENAMED", {"optimizer.peak_lr": "optimizer.lr"})
  monkeypatch.setattr(migrate_lib, "REMOVED", frozenset({"data.old_knob"}))
  saved = saved_dict()
  del saved["optimizer"]["lr"]
  saved["optimizer"]["peak_lr"], saved["data"]["old_knob"] = 0.25, 7
  migrated = migrate(saved)
  assert migrated["optimizer"]["lr"] == 0.25 and "peak_lr" not in migrated["optimizer"]
  assert "old_knob" not in migrated["data"]


def test_math_changes_compare_a_key_an_old_checkpoint_lacked_at_its_default():
  """An old checkpoint without model.rope_local_theta ran without it: a run that sets it changes the math."""
  saved = saved_dict()
  del saved["model"]["rope_local_theta"]
  now = config_lib.redacted(config_lib.base_config())["model"]
  now["rope_local_theta"] = 10000.0
  assert registry.math_changes(migrate(saved)["model"], now) == ["model.rope_local_theta: 0.0 -> 10000.0"]


def config_with(**values):
  cfg = config_lib.base_config()
  for key, value in values.items():
    *path, leaf = key.split(".")
    node = cfg
    for part in path:
      node = node[part]
    node[leaf] = value
  return cfg


def test_the_warmup_is_checked_once_against_its_schedule():
  """config/sections.py `warmup`: one check for the load (asked for: exit 2), the trainer (inherited: a warning)
  and the wsd decay (exit 2 either way), where there were three."""
  fits = config_with(steps=100, **{"optimizer.warmup_steps": 10})
  assert sections.warmup(fits, asked=True) is None and sections.warmup(fits, asked=False) is None
  long = config_with(steps=100, **{"optimizer.warmup_steps": 50, "optimizer.decay_steps": 10})
  with pytest.raises(UserError, match=r"config\.optimizer\.warmup_steps=50 is longer than the run's LR schedule of 10 "):
    sections.warmup(long, asked=True)
  assert sections.warmup(long, asked=False) == ("optimizer.warmup_steps=50 > the schedule's 10 steps (optimizer."
                                                "decay_steps or steps): the learning rate never reaches optimizer.lr")
  # wsd: 100 - round(0.2 x 100) = 80; a warmup of 81 runs into the decay, asked for or not
  wsd = {"optimizer.schedule": "wsd", "optimizer.decay_fraction": 0.2}
  assert sections.warmup(config_with(steps=100, **wsd, **{"optimizer.warmup_steps": 80}), asked=True) is None
  for asked in (True, False):
    with pytest.raises(UserError, match=r"warmup_steps=81 runs into the wsd decay.*100 - round\(0\.2 x 100\) = 80"):
      sections.warmup(config_with(steps=100, **wsd, **{"optimizer.warmup_steps": 81}), asked=asked)


@pytest.mark.parametrize("check,key,value,message", [
    (sections.checkpoint, "checkpoint.resume", "latest", "config.checkpoint.resume='latest': use auto, never"),
    (sections.checkpoint, "checkpoint.cadence", "often", "config.checkpoint.cadence='often': use fixed or auto"),
    (sections.checkpoint, "checkpoint.local_dir", "s3://b/x", "the local tier is a node-local path, not a URL"),
    (sections.monitor, "monitor.prometheus_host", " ", "config.monitor.prometheus_host is empty"),
    (sections.monitor, "monitor.prometheus_port", 70000, "config.monitor.prometheus_port=70000: a port is 0..65535"),
])
def test_section_checks_beside_their_keys(check, key, value, message):
  """The checkpoint and monitor sections' checks, pure functions of the keys (plan.validate imports neither
  Orbax storage nor the Prometheus server for them)."""
  cfg = config_with(**{key: value})
  with pytest.raises(UserError, match=re.escape(message)):
    check(cfg[key.split(".")[0]])
  check(config_lib.base_config()[key.split(".")[0]])


def test_typed_sections_are_exactly_their_declared_keys():
  """Every section's dataclass (config/schema.py, nested ones too): its fields are the section's declared keys,
  no more, no fewer, and its defaults the declared defaults (a key added to keys.py but not to the dataclass, a
  default changed in one place only, fails here); built from the config, strict, frozen, checked as built."""
  declared = {k: v for k, v in flat_items(config_lib.base_config()).items()}
  typed_defaults = flat_items(schema.Config().to_dict())
  assert typed_defaults == declared  # every key, every default (llama's model keys)
  for path, cls in [("", schema.Config), *schema.SECTIONS.items()]:
    prefix = f"{path}." if path else ""
    fields = {f"{prefix}{f.name}" for f in dataclasses.fields(cls) if f"{prefix}{f.name}" not in schema.SECTIONS}
    leaves = {k for k in declared if k.startswith(prefix) and "." not in k[len(prefix):]}
    assert fields == leaves, path
  assert set(schema.SECTIONS) == {k.rpartition(".")[0] for k in declared if "." in k}
  methods = {name for name in dir(schema._Section) if not name.startswith("__")} | {"of"}
  assert not {k for k in declared if k.rpartition(".")[2] in methods}  # a key would shadow the mapping view's method
  cfg = config_lib.base_config()
  typed = config_lib.Config.from_dict(cfg)
  assert json.dumps(typed.to_dict()) == json.dumps(cfg.to_dict())  # the same saved JSON, key order included
  assert config_lib.redacted(typed) == config_lib.redacted(cfg) and config_lib.Config.of(typed) is typed
  assert isinstance(typed.model.moe, schema.MoE) and isinstance(typed.fleet, sections.Fleet)
  with pytest.raises(dataclasses.FrozenInstanceError):
    typed.model.d_model = 512
  changed = config_lib.with_values(typed, {"model.remat": "full", "model.moe.num_experts": 4, "steps": 7})
  assert (changed.model.remat, changed.model.moe.num_experts, changed.steps) == ("full", 4, 7)
  assert (typed.model.remat, typed.model.moe.num_experts, typed.steps) == ("none", 0, 200)  # the original stays
  assert changed.model.mla is typed.model.mla  # untouched sections are shared, not copied
  saved = saved_dict()
  saved["model"]["moe"]["num_expert"] = 8
  with pytest.raises(UserError, match=r"unknown config key config\.model\.moe\.num_expert\. Did you mean "
                     r"config\.model\.moe\.num_experts"):
    config_lib.Config.from_dict(saved)
  del saved["model"]["moe"]["num_expert"], saved["optimizer"]["lr"]
  with pytest.raises(UserError, match=r"config\.optimizer\.lr is missing"):
    config_lib.Config.from_dict(saved)
  with pytest.raises(UserError, match=r"unknown config key config\.model\.d_modle\. Did you mean config\.model\.d_model"):
    config_lib.with_values(typed, {"model.d_modle": 1})
  with pytest.raises(UserError, match=r"unknown config key config\.model\.moe\."):
    config_lib.with_values(typed.model, {"moe": 1})  # a whole section is not a value
  fleet = sections.typed(sections.Fleet, cfg.fleet, "fleet")
  assert dataclasses.asdict(fleet) == cfg.fleet.to_dict() and fleet == typed.fleet
  with pytest.raises(UserError, match=r"unknown config key config\.fleet\.straggler_treshold\. Did you mean "
                     r"config\.fleet\.straggler_threshold"):
    sections.typed(sections.Fleet, {**cfg.fleet.to_dict(), "straggler_treshold": 0.1}, "fleet")
  with pytest.raises(UserError, match=r"config\.fleet\.exchange_timeout_s=0\.0: must be > 0"):
    sections.typed(sections.Fleet, {**cfg.fleet.to_dict(), "exchange_timeout_s": 0.0}, "fleet")
