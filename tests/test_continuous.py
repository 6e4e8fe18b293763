"""Continuous batching (`maxtrain/inference/continuous.py`): with 4 decode rows refilled as completions end,
greedy completions per prompt (through the EOS) are the static-batch generator's and their log-probs agree
to float noise, on a sliding-window model (the static generator's ring cache vs every slot kept); sampling
is a function of the seed and the prompt list (4 rows = 8 rows, another seed differs)."""

import jax
import numpy as np
import pytest
from flax import nnx

from maxtrain.inference import continuous, sampling
from maxtrain.models import registry

MAX_NEW = 20
PROMPTS = [list(np.random.default_rng(i).integers(1, 60, 3 + i % 9)) for i in range(13)]


@pytest.fixture(scope="module")
def generator():
  """A window layer (5 < the 11-token prompts + 20 tokens): the static generator's ring cache, every slot here."""
  keys = {"family": "mistral", "sliding_window": 5, "vocab_size": 64, "num_layers": 2, "d_model": 64, "num_heads": 4,
          "num_kv_heads": 2, "d_ff": 128, "max_seq_len": 128, "attention": "dot"}
  graph = registry.build(registry.model_config(keys), rngs=nnx.Rngs(params=0))
  return sampling.Generator(graph, jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",)))


def ends(tokens_NM, eos):
  return [list(r).index(eos) + 1 if eos in r else len(r) for r in tokens_NM]


def test_greedy_completions_equal_the_static_batch(generator):
  static, static_scores, _ = generator.generate_scored(PROMPTS, MAX_NEW, sampling.Sampling(), vocab_limit=60)
  values, counts = np.unique(static[:, 1:], return_counts=True)
  eos = int(values[np.argmax(counts)])  # the model's commonest token: completions of many lengths
  lengths = ends(static, eos)
  assert min(lengths) < 5 and max(lengths) == MAX_NEW, lengths
  got, got_scores, timing = continuous.batcher(generator, 4).generate_scored(PROMPTS, MAX_NEW, sampling.Sampling(), eos,
                                                                   vocab_limit=60)
  assert ends(got, eos) == lengths
  for i, n in enumerate(lengths):
    assert got[i, :n].tolist() == static[i, :n].tolist(), i
    assert (got[i, n:] == eos).all()
    # log-prob and entropy: the same math over differently placed cache slots. A per-token bound, each value on its
    # own (no sum grows the error): a greedy token's |logp| and the entropy are at most log(vocab) = log(64) = 4.16,
    # where an fp32 ulp is 4.8e-7, so 2e-6 is 4 ulps (measured: up to 1.4e-6, 3 ulps)
    np.testing.assert_allclose(got_scores[i, :n], static_scores[i, :n], rtol=0, atol=2e-6, err_msg=str(i))
  assert timing["tokens"] == sum(lengths)


def test_sampling_is_a_function_of_the_seed_not_of_the_rows(generator):
  draw = lambda rows, seed: continuous.batcher(generator, rows).generate_scored(  # noqa: E731
      PROMPTS, MAX_NEW, sampling.Sampling(temperature=1.0, seed=seed), 7, vocab_limit=60)
  four, scores4, _ = draw(4, 3)
  eight, scores8, _ = draw(8, 3)
  np.testing.assert_array_equal(four, eight)
  # per token, as above: a sampled token's |logp| of this near-uniform random model stays near log(64) (measured
  # <= 4.54, fp32 ulp 4.8e-7): 2e-6 is 4 ulps (measured: 9.5e-7)
  np.testing.assert_allclose(scores4, scores8, rtol=0, atol=2e-6)
  assert (draw(4, 4)[0] != four).any()
  assert four.max() < 60  # vocabulary padding is never drawn
