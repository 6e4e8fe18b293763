"""Context parallelism: the `context` mesh axis, attention under shard_map over it (against the einsum
reference), the loader's load-balancing order, and the real trainer on context=4 x fsdp=2 giving the
losses and parameters of context=1, resume included.

Shape legend: B batch, T length, N heads, K kv heads, H head dim.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtrain.program import batch as batch_lib
from maxtrain import config as config_lib
from maxtrain.cli import train
from maxtrain.data.loader import MixtureLoader, contiguous_rows
from maxtrain.data.mixture import Source, Stage
from maxtrain.data.indexing import index_files
from maxtrain.errors import UserError
from maxtrain.models.attention.flash import flash_attention_qkv
from maxtrain.models.attention.layer import dot_product_attention
from maxtrain.sharding import context_attention as ca
from maxtrain.sharding.mesh import make_mesh
from maxtrain.sharding import rules as rules_lib
from maxtrain.sharding.rules import DEFAULT_RULES
from maxtrain.program.plan import validate
from test_checkpoint import losses, restore_raw
from tiny import TINY_MODEL

RTOL, ATOL = 1e-5, 1e-6  # fp32 parity, as tests/test_flash_attention.py


def _packed(seed: int, b: int, t: int, n: int, k: int, h: int, num_docs: int = 4):
  """q, k, v, a cotangent, and packed documents (different boundaries per row) with their
  per-document positions, as the loader makes them."""
  rng = np.random.default_rng(seed)
  q, kk, v, dout = (rng.standard_normal(s).astype(np.float32) for s in [(b, t, n, h), (b, t, k, h), (b, t, k, h),
                                                                         (b, t, n, h)])
  seg = (np.sort(rng.integers(0, num_docs, (b, t)), axis=1) + 1).astype(np.int32)
  starts = np.concatenate([np.ones((b, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
  idx = np.arange(t)[None].repeat(b, 0)
  pos = (idx - np.maximum.accumulate(np.where(starts, idx, 0), axis=1)).astype(np.int32)
  return q, kk, v, dout, seg, pos


@pytest.mark.parametrize("sizes,block,window,cap", [
    ({"data": 1, "fsdp": 1, "context": 1, "tensor": 1}, 8, 0, 0.0),  # 1 device: shard_map over a size-1 axis
    ({"data": 1, "fsdp": 2, "context": 4, "tensor": 1}, 4, 0, 0.0),  # the must-show mesh, 2 blocks per chunk
    ({"data": 2, "fsdp": 1, "context": 2, "tensor": 2}, 16, 0, 0.0),  # heads over tensor, blocks clamped to the chunk
    ({"data": 1, "fsdp": 2, "context": 4, "tensor": 1}, 4, 6, 0.0),  # a sliding window shorter than a document
    ({"data": 1, "fsdp": 2, "context": 4, "tensor": 1}, 4, 6, 1.5),  # and Gemma 2's score soft-capping
])
def test_context_attention_matches_reference(sizes, block, window, cap):
  num = int(np.prod(list(sizes.values())))
  mesh = make_mesh(sizes, jax.devices()[:num])
  q, k, v, dout, seg, pos = _packed(0, 4, 64, 4, 2, 8)  # GQA: 2 query heads per kv head
  out_ref, vjp = jax.vjp(lambda q, k, v: dot_product_attention(q, k, v, jnp.asarray(seg), window=window,
                                                              logit_cap=cap), q, k, v)
  grads_ref = vjp(dout)

  order = ca.zigzag_order(64, sizes["context"])
  attend = ca.sharded(mesh, DEFAULT_RULES, functools.partial(flash_attention_qkv, window=window, logit_cap=cap),
                      block_q=block, block_kv=block)
  with jax.set_mesh(mesh):
    @jax.jit
    def run(q, k, v, seg, pos, dout):
      out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, seg, pos), q, k, v)
      return out, vjp(dout)
    out, grads = run(*(x[:, order] for x in (q, k, v, seg, pos, dout)))
  natural = np.argsort(order)
  np.testing.assert_allclose(np.asarray(out)[:, natural], out_ref, rtol=RTOL, atol=ATOL)
  for name, g, g_ref in zip("qkv", grads, grads_ref):
    np.testing.assert_allclose(np.asarray(g)[:, natural], g_ref, rtol=RTOL, atol=ATOL, err_msg=f"d{name}")


def test_zigzag_order_and_block_pairs_balance_the_causal_work():
  np.testing.assert_array_equal(ca.zigzag_order(8, 2), [0, 1, 6, 7, 2, 3, 4, 5])
  # Every shard visits the same number of block pairs: 2C-1 full chunk pairs + 2 diagonal triangles,
  # a bit over half of the 2c x 2Cc rectangle it would compute without skipping.
  shards, chunk, block = 4, 16, 4
  counts = [int(ca.block_pairs(jnp.int32(i), shards, chunk, block, block).shape[0]) for i in range(shards)]
  nb = chunk // block
  assert counts == [(2 * shards - 1) * nb * nb + 2 * nb * (nb + 1) // 2] * shards
  assert counts[0] / (2 * nb * 2 * shards * nb) < 0.6


def test_context_order_moves_every_field_together():
  rows = {"inputs": np.arange(16).reshape(1, 16), "positions": np.arange(16).reshape(1, 16) * 10}
  out = batch_lib.context_order(rows, 2)
  np.testing.assert_array_equal(out["inputs"][0], [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11])
  np.testing.assert_array_equal(out["positions"], out["inputs"] * 10)
  assert batch_lib.context_order(rows, 1) is rows


def test_mesh_keeps_tensor_innermost():
  mesh = make_mesh({"data": 1, "fsdp": 2, "context": 2, "tensor": 2})
  assert dict(mesh.shape) == {"pipeline": 1, "data": 1, "fsdp": 2, "expert": 1, "context": 2, "tensor": 2}
  ids = np.vectorize(lambda d: d.id)(mesh.devices).reshape(-1, 2)
  for group in ids:  # each tensor group is two consecutive devices
    assert group[1] == group[0] + 1


def test_bad_context_layouts_are_refused(monkeypatch):
  def plan(*args):
    return validate(config_lib.load(TINY_MODEL + list(args)), 8, require_data=False)

  with pytest.raises(UserError, match=r"seq_len=36 is not divisible by 2 x the context shards, 2 x mesh.context=4"):
    plan("--config.mesh.context=4", "--config.mesh.fsdp=2", "--config.data.seq_len=36")
  # Each process loads whole sequences: one process per device cannot split them.
  cfg = config_lib.load(TINY_MODEL + ["--config.mesh.context=4", "--config.mesh.fsdp=2"])
  with pytest.raises(UserError, match=r"a sequence is split over mesh.context=4 .* each process's 1 devices"):
    validate(cfg, 8, num_processes=8, require_data=False)
  assert validate(cfg, 8, num_processes=2, require_data=False).layout.shards("act_length") == 4
  # A mesh axis the rule set never uses would only duplicate work.
  monkeypatch.setitem(rules_lib.RULE_SETS, "no_context", {**DEFAULT_RULES, "act_length": None, "embed": "fsdp",
                                                            "lora_in": "fsdp", "expert_embed": "fsdp"})
  with pytest.raises(UserError, match=r"maps nothing to mesh axis context.*Set mesh.context=1"):
    plan("--config.mesh.context=4", "--config.mesh.fsdp=2", "--config.mesh.rules=no_context")
  assert plan("--config.mesh.context=4", "--config.mesh.fsdp=2").layout.shards("act_length") == 4
  # Under context parallelism attention is the flash core: another kernel is refused, not replaced.
  with pytest.raises(UserError, match=r"attention=dot with a sequence split over .*context.*model.attention=flash"):
    plan("--config.mesh.context=4", "--config.mesh.fsdp=2", "--config.model.attention=dot")
  assert plan("--config.mesh.context=1", "--config.mesh.fsdp=8", "--config.model.attention=dot")
  # ... which soft-caps the scores as dot does (Gemma 2's)
  assert plan("--config.mesh.context=4", "--config.mesh.fsdp=2", "--config.model.attn_logit_softcap=50.0")


# The trainer, end to end, on packed documents: seq_len 64 over the repository's sources cut into
# documents of 8-47 bytes, so every row holds several (over whole source files, 1 row in the 160
# of 20 steps did). GQA (2 query heads per kv head). The chunked loss (4 chunks either way) is forced
# on: under context parallelism it folds each shard's tokens into rows of their own.
TINY = TINY_MODEL + ["--config.data.seq_len=64", "--config.eval.every_steps=0", "--config.log_every=1",
                     "--config.checkpoint.every_steps=10", "--config.optimizer.decay_steps=20",
                     "--config.model.loss_chunk_tokens=16", "--config.model.num_kv_heads=2"]
CONTEXT_1 = ["--config.mesh.fsdp=8"]
CONTEXT_4 = ["--config.mesh.fsdp=2", "--config.mesh.context=4"]


@pytest.fixture(scope="module")
def short_docs_store(tmp_path_factory) -> str:
  """A token store of ~5,000 short documents (one .jsonl line each) cut from this repository's sources."""
  root = tmp_path_factory.mktemp("short_docs")
  text = "".join(p.read_text() for p in sorted((Path(__file__).resolve().parent.parent / "maxtrain").glob("*.py")))
  text = text[:150_000]
  cuts = np.cumsum(np.random.default_rng(0).integers(8, 48, len(text) // 8))
  docs = [text[a:b] for a, b in zip([0, *cuts], cuts) if a < len(text)]
  (root / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
  index_files([str(root / "docs.jsonl")], str(root / "docs"), val_fraction=0.2, workers=1, progress=False)
  return str(root / "docs")


def test_context4_trains_like_context1_and_resumes_its_checkpoint(short_docs_store, tmp_path, monkeypatch):
  store = short_docs_store
  # The 20 steps' batches (the trainer's loader, seed 0): every row holds more than one document.
  loader = MixtureLoader([Source("s", f"{store}.train", 1.0)], [Stage(0, 0, 8, 64, (1.0,))], 0,
                         contiguous_rows(0, 1), vocab_size=384)
  assert min(len(set(row.tolist())) for _ in range(20) for row in next(loader)["segment_ids"]) >= 2
  traced = []  # the shards of every context-parallel attention the trainer traced
  sharded = ca.sharded
  monkeypatch.setattr(ca, "sharded", lambda mesh, rules, **kw: traced.append(mesh.shape["context"]) or
                      sharded(mesh, rules, **kw))

  def run(name, steps, mesh):
    code = train.main(TINY + mesh + [f"--config.data.path={store}", f"--config.steps={steps}",
                                     f"--config.output_dir={tmp_path / name}"])
    assert code == 0, name

  run("one", 20, CONTEXT_1)
  assert traced == []  # context=1: the plain flash kernel
  run("four", 20, CONTEXT_4)
  assert traced and set(traced) == {4}
  # Resume: the context=1 run's step-10 checkpoint, continued on context=4.
  shutil.copytree(tmp_path / "one" / "checkpoints", tmp_path / "resumed" / "checkpoints",
                  ignore=lambda _, names: [n for n in names if n == "20"])
  run("resumed", 20, CONTEXT_4)

  ref = losses(tmp_path / "one")
  assert sorted(ref) == list(range(1, 21))
  for name, steps in (("four", range(1, 21)), ("resumed", range(11, 21))):
    got = losses(tmp_path / name)
    assert sorted(got) == list(steps), name
    np.testing.assert_allclose([got[s] for s in steps], [ref[s] for s in steps], rtol=1e-5, err_msg=name)
    # The final eval (its batches also in context order) sees the same model.
    eval_loss = lambda run: json.loads((tmp_path / run / "summary.json").read_text())["final_eval_loss"]
    np.testing.assert_allclose(eval_loss(name), eval_loss("one"), rtol=1e-5, err_msg=name)
    params = restore_raw(tmp_path / name / "checkpoints", 20)["params"]
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params),
                            jax.tree.leaves(restore_raw(tmp_path / "one" / "checkpoints", 20)["params"])):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=f"{name} {jax.tree_util.keystr(path)}")
