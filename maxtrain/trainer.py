"""The training loop: validated config -> mesh -> data -> sharded state -> compiled step -> loop."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import jax
import ml_collections
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from maxtrain import config as config_lib
from maxtrain import optim
from maxtrain import state as state_lib
from maxtrain import step as step_lib
from maxtrain.data import corpus, pipeline
from maxtrain.data.store import TokenStore
from maxtrain.errors import UserError
from maxtrain.models.llama import ModelConfig, param_count
from maxtrain.monitor.tensorboard import MetricWriter
from maxtrain.sharding.mesh import AXES, BATCH_AXES, make_mesh

log = logging.getLogger("maxtrain")


def open_stores(data_cfg: ml_collections.ConfigDict, vocab_size: int) -> tuple[TokenStore, TokenStore]:
  """Opens (building the embedded corpus on first use) and checks the train and val stores."""
  if data_cfg.path:
    train_prefix, val_prefix = f"{data_cfg.path}.train", f"{data_cfg.path}.val"
  else:
    train_prefix, val_prefix = corpus.prepare_corpus(data_cfg.corpus, tokenizer_spec=data_cfg.tokenizer)
  train, val = TokenStore.open(train_prefix), TokenStore.open(val_prefix)
  for store in (train, val):
    if store.vocab_size > vocab_size:
      raise UserError(
          f"token store {store.prefix} was built with a tokenizer of {store.vocab_size} ids "
          f"({store.tokenizer_identity}), more than config.model.vocab_size={vocab_size}. "
          f"Set --config.model.vocab_size to at least {store.vocab_size} (rounded up so mesh.tensor divides it)."
      )
  if train.tokenizer_identity != val.tokenizer_identity:
    raise UserError(f"{train.prefix} and {val.prefix} were built with different tokenizers "
                    f"({train.tokenizer_identity} vs {val.tokenizer_identity}); rebuild both with tools/index_data.py")
  return train, val


def evaluate(eval_step, params, batches) -> float:
  total, count = 0.0, 0.0
  for batch in batches:
    loss_sum, n = eval_step(params, batch)
    total, count = total + loss_sum, count + n
  return float(total) / max(float(count), 1.0)


def run(cfg: ml_collections.ConfigDict) -> dict:
  """Trains per `cfg`; returns a summary (final eval loss, unigram entropy, timings)."""
  t_start = time.monotonic()
  mesh_shape = config_lib.validate(cfg, jax.device_count(), jax.process_count())
  train_store, val_store = open_stores(cfg.data, cfg.model.vocab_size)
  mesh = make_mesh({a: s for a, s in zip(AXES, mesh_shape)})

  out_dir = Path(cfg.output_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  if jax.process_index() == 0:
    config_lib.save(cfg, out_dir / "config.json")
  log.info("devices: %d x %s; mesh %s; train %s (%d tokens), val %s (%d tokens)",
           jax.device_count(), jax.devices()[0].device_kind, dict(mesh.shape),
           train_store.prefix, train_store.num_tokens, val_store.prefix, val_store.num_tokens)

  model_cfg = ModelConfig.from_config(cfg.model)
  optimizer = optim.make(cfg.optimizer, cfg.steps)
  graphdef, state, state_shardings = state_lib.create(model_cfg, optimizer.tx, mesh, cfg.seed)
  log.info("model: %.2fM parameters; optimizer %s: %s", param_count(state.params) / 1e6, cfg.optimizer.name,
           optim.describe_groups(state.params, optimizer.labels(state.params)))

  batch_sharding = NamedSharding(mesh, P(BATCH_AXES, None))
  seq_len, batch_size = cfg.data.seq_len, cfg.data.batch_size
  loader = pipeline.TrainLoader(train_store.prefix, seq_len, batch_size, cfg.seed,
                                jax.process_index(), jax.process_count())
  eval_data = [pipeline.to_global(b, batch_sharding) for b in pipeline.eval_batches(
      val_store.prefix, seq_len, batch_size, cfg.eval.batches, jax.process_index(), jax.process_count())]

  replicated = state_lib.replicated(mesh)
  with jax.set_mesh(mesh):
    train_step = jax.jit(step_lib.make_train_step(graphdef, optimizer, z_loss=cfg.optimizer.z_loss,
                                                  grad_accum_steps=cfg.optimizer.grad_accum_steps),
                         in_shardings=(state_shardings, batch_sharding),
                         out_shardings=(state_shardings, replicated), donate_argnums=0)
    eval_step = jax.jit(step_lib.make_eval_step(graphdef),
                        in_shardings=(state_shardings.params, batch_sharding), out_shardings=replicated)
    batch = pipeline.to_global(next(loader), batch_sharding)
    t0 = time.monotonic()
    compiled = train_step.lower(state, batch).compile()
    log.info("compiled train step in %.1fs", time.monotonic() - t0)

  writer = MetricWriter(out_dir / "tensorboard")
  writer.text("config", "```\n" + json.dumps(cfg.to_dict(), indent=2, sort_keys=True) + "\n```")
  tokens_per_step = batch_size * seq_len
  step = int(state.step)
  t_interval, steps_in_interval = time.monotonic(), 0
  eval_loss = float("nan")
  with jax.set_mesh(mesh):
    while step < cfg.steps:
      state, metrics = compiled(state, batch)
      step += 1
      steps_in_interval += 1
      if step < cfg.steps:
        # Host work for the next batch overlaps the device running this step (async dispatch).
        batch = pipeline.to_global(next(loader), batch_sharding)
      if step % cfg.log_every == 0 or step == cfg.steps:
        metrics = jax.device_get(metrics)  # note: a host-device sync point, once per log interval
        now = time.monotonic()
        step_time = (now - t_interval) / steps_in_interval
        t_interval, steps_in_interval = now, 0
        # Every scalar the step returns is logged as train/<name>: new metrics need no loop change.
        scalars = {f"train/{k}": v for k, v in metrics.items()}
        scalars.update({"train/step_time_s": step_time, "train/tokens_per_s": tokens_per_step / step_time})
        writer.scalars(step, scalars)
        log.info("step %d/%d  loss %.4f  grad_norm %.3f  lr %.2e  %.3fs/step  %.0f tok/s", step, cfg.steps,
                 metrics["loss"], metrics["grad_norm"], metrics["lr"], step_time, tokens_per_step / step_time)
      if step == cfg.steps or (cfg.eval.every_steps and step % cfg.eval.every_steps == 0):
        t_eval = time.monotonic()
        eval_loss = evaluate(eval_step, state.params, eval_data)
        writer.scalars(step, {"eval/loss": eval_loss})
        log.info("step %d  eval loss %.4f", step, eval_loss)
        t_interval += time.monotonic() - t_eval  # eval time is not step time

  writer.close()
  entropy = train_store.unigram_entropy()
  summary = {"final_eval_loss": eval_loss, "unigram_entropy": entropy, "steps": step,
             "wall_s": time.monotonic() - t_start}
  log.info("final eval loss %.4f nats/token vs unigram entropy %.4f nats/token of the training corpus "
           "(a model that learned nothing beyond token frequencies scores about the latter)", eval_loss, entropy)
  if jax.process_index() == 0:
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
  return summary
