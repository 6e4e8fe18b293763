"""The vendor kernels (`models/attention/vendor.py`: cudnn, nki) cannot run here (no GPU, no Trainium):
their selection and refusals, and the mask the cudnn path passes, checked through JAX's XLA
implementation of the same `jax.nn.dot_product_attention` call against the einsum reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtrain import config as config_lib
from maxtrain.cli import train
from maxtrain.errors import UserError
from maxtrain.models.attention import vendor as vendor_attention
from maxtrain.models.attention.layer import CHOICES, dot_product_attention, resolve_kernel
from maxtrain.program.plan import validate
from tiny import TINY_MODEL


def test_cudnn_call_masks_packed_documents_like_the_reference():
  rng = np.random.default_rng(0)
  b, t, n, k, h = 2, 64, 4, 2, 16  # GQA
  q, kk, v, dout = (jnp.asarray(rng.standard_normal(s), jnp.float32)
                    for s in [(b, t, n, h), (b, t, k, h), (b, t, k, h), (b, t, n, h)])
  seg = jnp.asarray(np.sort(rng.integers(0, 4, (b, t)), axis=1) + 1, jnp.int32)  # packed, per-row boundaries

  def value_and_grads(attention):
    out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, seg), q, kk, v)
    return [out, *vjp(dout)]

  for window in (0, 7):  # 7 < the documents' lengths here: the window, not the documents, cuts the keys
    via_xla = lambda q, k, v, seg: vendor_attention.cudnn_attention(q, k, v, seg, window=window, implementation="xla")
    reference = lambda q, k, v, seg: dot_product_attention(q, k, v, seg, window=window)
    for got, want in zip(value_and_grads(via_xla), value_and_grads(reference)):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_selection_and_refusals():
  assert {"cudnn", "nki"} <= set(CHOICES)
  lengths = (1, 256, 1024, 8192, 131072)
  assert {resolve_kernel("auto", t, backend="cpu", dtype=jnp.bfloat16) for t in lengths} == {"blocked", "flash"}
  # A GPU runs cuDNN in bf16/fp16 only: fp32 there keeps the pure-JAX kernels; Trainium never gets nki from auto.
  assert {resolve_kernel("auto", t, backend="gpu", dtype=jnp.bfloat16) for t in lengths} == {"cudnn"}
  assert {resolve_kernel("auto", t, backend="gpu", dtype=jnp.float32) for t in lengths} == {"blocked", "flash"}
  assert resolve_kernel("auto", 8192, backend="gpu", dtype=jnp.bfloat16, head_dim=12) == "flash"  # not a multiple of 8
  assert resolve_kernel("auto", 8192, backend="gpu", dtype=jnp.bfloat16, window=4096) == "cudnn"  # cuDNN's own window
  assert {resolve_kernel("auto", t, backend="neuron", dtype=jnp.bfloat16) for t in lengths} == {"blocked", "flash"}
  x = jnp.zeros((1, 8, 2, 4))
  seg = jnp.ones((1, 8), jnp.int32)
  with pytest.raises(UserError, match="cudnn runs on NVIDIA GPUs only.*'cpu'.*model.attention=flash"):
    vendor_attention.cudnn_attention(x, x, x, seg)
  with pytest.raises(UserError, match="nki needs AWS's Neuron packages.*pip install jax-neuronx"):
    vendor_attention.nki_attention(x, x, x, seg)
  for kernel, platform in (("cudnn", "gpu"), ("nki", "neuron")):
    cfg = config_lib.load(TINY_MODEL + [f"--config.model.attention={kernel}", "--config.runtime.platform=cpu"])
    with pytest.raises(UserError, match=f"attention={kernel} runs only on runtime.platform={platform}"):
      validate(cfg, 8, require_data=False)


def test_trainer_exits_2_for_a_vendor_kernel_it_cannot_run(tmp_path, capsys):
  code = train.main(TINY_MODEL + ["--config.model.attention=cudnn", "--config.steps=1",
                                  f"--config.output_dir={tmp_path}"])
  assert code == 2
  assert "attention=cudnn runs only on runtime.platform=gpu" in capsys.readouterr().err  # hardware=auto: cpu
