"""The GRPO objective (posttrain/algorithms/grpo.py) against a NumPy reference: advantages, the clipped
surrogate with the k3 KL, token-level averaging, and the gradient in the log-probabilities (fp32,
rtol 1e-5); the k3 estimator's expectation is the exact KL."""

import jax
import jax.numpy as jnp
import numpy as np

from maxtrain.posttrain import algorithms
from maxtrain.posttrain.algorithms import base as rl_loss


def grpo_loss(logp, old, ref, adv, mask, *, clip_eps, kl_coef):
  return algorithms.get("grpo").loss(logp, old, ref, adv, mask,
                                     rl_loss.Hyper(clip_low=clip_eps, clip_high=clip_eps, kl_coef=kl_coef))


def np_advantages(r_PG, eps=rl_loss.ADVANTAGE_EPS):
  r = r_PG.astype(np.float64)
  return (r - r.mean(-1, keepdims=True)) / (r.std(-1, keepdims=True) + eps)


def np_loss_and_grad(logp, old, ref, adv, mask, clip_eps, kl_coef):
  """Loss and d loss / d logp, written out by hand in float64."""
  logp, old, ref, adv, mask = (np.asarray(a, np.float64) for a in (logp, old, ref, adv, mask))
  count = max(mask.sum(), 1.0)
  ratio = np.exp(logp - old)
  clipped = np.clip(ratio, 1 - clip_eps, 1 + clip_eps)
  unclipped_term, clipped_term = ratio * adv, clipped * adv
  surrogate = np.minimum(unclipped_term, clipped_term)
  kl = np.exp(ref - logp) - (ref - logp) - 1
  loss = (mask * (kl_coef * kl - surrogate)).sum() / count
  # d surrogate: ratio * A where the unclipped term is the min or the ratio is inside the clip range
  inside = (ratio >= 1 - clip_eps) & (ratio <= 1 + clip_eps)
  d_surr = np.where((unclipped_term <= clipped_term) | inside, ratio * adv, 0.0)
  d_kl = 1 - np.exp(ref - logp)
  return loss, mask * (kl_coef * d_kl - d_surr) / count


def fixed_batch(seed=0, P=3, G=4, T=7):
  rng = np.random.default_rng(seed)
  B = P * G
  rewards = rng.integers(0, 2, (P, G)).astype(np.float32)
  rewards[0] = 1.0  # a group of equal rewards: zero advantage
  old = rng.normal(-2.0, 0.5, (B, T)).astype(np.float32)
  logp = (old + rng.normal(0, 0.3, (B, T))).astype(np.float32)  # ratios both inside and outside the clip range
  ref = (old + rng.normal(0, 0.2, (B, T))).astype(np.float32)
  mask = (rng.random((B, T)) < 0.7).astype(np.float32)
  return rewards, logp, old, ref, mask


def test_group_advantages_match_numpy():
  rewards = fixed_batch()[0]
  adv = np.asarray(rl_loss.group_advantages(jnp.asarray(rewards)))
  np.testing.assert_allclose(adv, np_advantages(rewards), rtol=1e-5, atol=1e-6)
  assert np.all(adv[0] == 0.0)  # equal rewards
  np.testing.assert_allclose(adv.mean(-1), 0.0, atol=1e-6)


def test_objective_and_gradient_match_numpy():
  rewards, logp, old, ref, mask = fixed_batch()
  T = logp.shape[1]
  adv_BT = np.repeat(np_advantages(rewards).reshape(-1, 1), T, axis=1).astype(np.float32) * mask
  clip_eps, kl_coef = 0.2, 0.05
  fn = lambda lp: grpo_loss(lp, old, ref, adv_BT, mask, clip_eps=clip_eps, kl_coef=kl_coef)
  (loss, metrics), grad = jax.value_and_grad(fn, has_aux=True)(jnp.asarray(logp))
  ref_loss, ref_grad = np_loss_and_grad(logp, old, ref, adv_BT, mask, clip_eps, kl_coef)
  np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=1e-5, atol=1e-9)
  ratio = np.exp(logp.astype(np.float64) - old)
  assert 0 < float(metrics["clip_fraction"]) < 1  # the fixed batch exercises both branches
  assert np.any(np.abs(ratio - 1) > 0.2)
  assert float(metrics["tokens"]) == mask.sum()


def test_token_level_averaging_weights_every_token_equally():
  """A long completion counts by its tokens: the loss is one mean over all masked tokens of the batch."""
  logp = jnp.zeros((2, 4))
  adv = jnp.array([[1.0, 1.0, 1.0, 1.0], [-1.0, 0.0, 0.0, 0.0]])
  mask = jnp.array([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
  loss, _ = grpo_loss(logp, logp, logp, adv, mask, clip_eps=0.2, kl_coef=0.0)
  assert float(loss) == np.float32(-(4 * 1.0 - 1.0) / 5)  # one mean over 5 tokens, not a mean of row means (-0.5)


def test_ratio_is_one_on_policy():
  _, logp, _, ref, mask = fixed_batch(1)
  adv = np.ones_like(mask)
  _, metrics = grpo_loss(jnp.asarray(logp), jnp.asarray(logp), ref, adv, mask, clip_eps=0.2, kl_coef=0.1)
  assert float(metrics["ratio_mean"]) == 1.0 and float(metrics["clip_fraction"]) == 0.0


def test_k3_expectation_is_the_exact_kl():
  """sum_x p(x) k3(x) = KL(p || q) exactly for categorical p, q (the estimator is unbiased)."""
  rng = np.random.default_rng(3)
  logits_p, logits_q = rng.normal(size=(5, 11)), rng.normal(size=(5, 11))
  logp = jax.nn.log_softmax(jnp.asarray(logits_p, jnp.float32))
  logq = jax.nn.log_softmax(jnp.asarray(logits_q, jnp.float32))
  expected = np.asarray(jnp.sum(jnp.exp(logp) * rl_loss.k3_kl(logp, logq), axis=-1))
  p, q = np.exp(np.asarray(logp, np.float64)), np.exp(np.asarray(logq, np.float64))
  exact = (p * (np.log(p) - np.log(q))).sum(-1)
  np.testing.assert_allclose(expected, exact, rtol=1e-5)
  assert np.all(np.asarray(rl_loss.k3_kl(logp, logq)) >= 0)
  np.testing.assert_array_equal(np.asarray(rl_loss.k3_kl(logp, logp)), 0.0)
