"""Every RL algorithm of the registry (`maxtrain/posttrain/algorithms`) against a NumPy reference written
out by hand in float64: its advantages, its loss and the loss's gradient in the log-probabilities (fp32
results, rtol 1e-5: a few float32 roundings of O(1) terms); DAPO's overlong shaping and dynamic
sampling's group choice; the registry's defaults (`--config.post.algorithm=X` alone gives X's recipe)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtrain import config as config_lib
from maxtrain.errors import UserError
from maxtrain.posttrain import algorithms, rollout
from maxtrain.posttrain.algorithms import dapo
from maxtrain.posttrain.algorithms.base import ADVANTAGE_EPS, Hyper

P, G, T = 3, 4, 7


def batch(seed=0):
  rng = np.random.default_rng(seed)
  rewards = rng.integers(0, 3, (P, G)).astype(np.float32)
  rewards[0] = 1.0  # a group of equal rewards
  old = rng.normal(-2.0, 0.5, (P * G, T)).astype(np.float32)
  logp = (old + rng.normal(0, 0.3, (P * G, T))).astype(np.float32)  # ratios inside and outside the clip range
  ref = (old + rng.normal(0, 0.2, (P * G, T))).astype(np.float32)
  mask = (rng.random((P * G, T)) < 0.7).astype(np.float32)
  mask[:, 0] = 1.0  # every completion has a token
  return rewards, logp, old, ref, mask


def spread(adv_PG, mask):
  return np.asarray(adv_PG, np.float64).reshape(-1, 1) * mask


# NumPy advantages (float64), [B, T].
def np_grpo(r, old, ref, mask, hp):
  r = r.astype(np.float64)
  return spread((r - r.mean(-1, keepdims=True)) / (r.std(-1, keepdims=True) + ADVANTAGE_EPS), mask)


def np_dr_grpo(r, old, ref, mask, hp):
  r = r.astype(np.float64)
  return spread(r - r.mean(-1, keepdims=True), mask)


def np_rloo(r, old, ref, mask, hp):
  r = r.astype(np.float64)
  baseline = np.stack([np.delete(r, i, axis=1).mean(axis=1) for i in range(r.shape[1])], axis=1)  # the others' mean
  return spread(r - baseline, mask)


def np_reinforce_pp(r, old, ref, mask, hp):
  B, T_ = mask.shape
  kl = (old.astype(np.float64) - ref) * mask
  returns = np.zeros((B, T_))
  for b in range(B):
    for t in range(T_):
      returns[b, t] = r.reshape(-1)[b] - hp.kl_coef * kl[b, t:].sum()
  values = returns[mask > 0]
  return (returns - values.mean()) / (values.std() + ADVANTAGE_EPS) * mask


def np_dapo(r, old, ref, mask, hp):
  lengths = mask.sum(axis=1)
  start = hp.max_new_tokens - hp.overlong_buffer
  penalty = np.array([0.0 if n <= start else max(-1.0, (start - n) / hp.overlong_buffer) for n in lengths])
  return np_grpo(r + penalty.reshape(r.shape), old, ref, mask, hp)


# NumPy losses and d loss / d logp (float64).
def np_token_terms(logp, old, ref, adv, mask, hp):
  logp, old, ref, adv, mask = (np.asarray(a, np.float64) for a in (logp, old, ref, adv, mask))
  ratio = np.exp(logp - old)
  clipped = np.clip(ratio, 1 - hp.clip_low, 1 + hp.clip_high)
  surr = np.minimum(ratio * adv, clipped * adv)
  inside = (ratio >= 1 - hp.clip_low) & (ratio <= 1 + hp.clip_high)
  d_surr = np.where((ratio * adv <= clipped * adv) | inside, ratio * adv, 0.0)
  kl = np.exp(ref - logp) - (ref - logp) - 1
  d_kl = 1 - np.exp(ref - logp)
  return mask * (hp.kl_coef * kl - surr), mask * (hp.kl_coef * d_kl - d_surr)


def np_token_mean(logp, old, ref, adv, mask, hp):
  terms, d = np_token_terms(logp, old, ref, adv, mask, hp)
  return terms.sum() / mask.sum(), d / mask.sum()


def np_constant_norm(logp, old, ref, adv, mask, hp):
  terms, d = np_token_terms(logp, old, ref, adv, mask, hp)
  n = mask.shape[0] * hp.max_new_tokens
  return terms.sum() / n, d / n


def np_reinforce_pp_loss(logp, old, ref, adv, mask, hp):
  return np_token_mean(logp, old, ref, adv, mask, dataclasses.replace(hp, kl_coef=0.0))


def np_gspo(logp, old, ref, adv, mask, hp):
  logp, old, ref, adv, mask = (np.asarray(a, np.float64) for a in (logp, old, ref, adv, mask))
  B = mask.shape[0]
  length = mask.sum(axis=1)
  s = np.exp((mask * (logp - old)).sum(axis=1) / length)
  a = (adv * mask).sum(axis=1) / length
  clipped = np.clip(s, 1 - hp.clip_low, 1 + hp.clip_high)
  surr = np.minimum(s * a, clipped * a)
  inside = (s >= 1 - hp.clip_low) & (s <= 1 + hp.clip_high)
  d_surr_ds = np.where((s * a <= clipped * a) | inside, a, 0.0)  # d min / d s
  kl = np.exp(ref - logp) - (ref - logp) - 1
  loss = -surr.mean() + hp.kl_coef * (mask * kl).sum() / mask.sum()
  grad = -(d_surr_ds * s / length).reshape(-1, 1) * mask / B + hp.kl_coef * mask * (1 - np.exp(ref - logp)) / mask.sum()
  return loss, grad


REFERENCES = {"grpo": (np_grpo, np_token_mean), "dr_grpo": (np_dr_grpo, np_constant_norm),
              "rloo": (np_rloo, np_token_mean), "reinforce_pp": (np_reinforce_pp, np_reinforce_pp_loss),
              "dapo": (np_dapo, np_token_mean), "gspo": (np_grpo, np_gspo)}


def test_every_registered_algorithm_has_a_reference():
  assert set(algorithms.ALGORITHMS) == set(REFERENCES) | {"ppo"}  # ppo: test_ppo_* below


def np_gae(rewards_B, old, ref, mask, values, hp):
  """GAE row by row over the completion's positions, written from the recursion (float64)."""
  adv, returns = np.zeros(mask.shape), np.zeros(mask.shape)
  for b in range(mask.shape[0]):
    t_ = np.flatnonzero(mask[b])
    r = -hp.kl_coef * (old[b, t_].astype(np.float64) - ref[b, t_])
    r[-1] += rewards_B[b]
    v = values[b, t_].astype(np.float64)
    a, later = np.zeros(len(t_)), 0.0
    for i in reversed(range(len(t_))):
      v_next = v[i + 1] if i + 1 < len(t_) else 0.0
      later = r[i] + hp.gamma * v_next - v[i] + hp.gamma * hp.lam * later
      a[i] = later
    adv[b, t_], returns[b, t_] = a, a + v
  return adv, returns


def test_ppo_gae_losses_and_gradients_match_numpy():
  rewards, logp, old, ref, mask = batch(2)
  mask[:, 1:3] = 1.0  # contiguous completions (first token at position 0)
  mask = np.cumprod(mask, axis=1)
  values = np.random.default_rng(5).normal(0.3, 0.4, mask.shape).astype(np.float32) * mask
  ppo = algorithms.get("ppo")
  assert ppo.critic
  hp = Hyper(clip_low=0.2, clip_high=0.2, kl_coef=0.05, gamma=0.9, lam=0.8, value_clip=0.1)
  adv, returns = ppo.advantages(rewards, old, ref, mask, hp, values_BT=values)
  ref_adv, ref_returns = np_gae(rewards.reshape(-1), old, ref, mask, values, hp)
  np.testing.assert_allclose(returns, ref_returns, rtol=1e-5, atol=1e-6)
  tokens = ref_adv[mask > 0]
  np.testing.assert_allclose(adv, (ref_adv - tokens.mean()) / (tokens.std() + ADVANTAGE_EPS) * mask, rtol=1e-5, atol=1e-5)
  # lam = 1, gamma = 1, no KL: the returns are the sequence reward at every token (Monte Carlo)
  _, mc = ppo.advantages(rewards, old, ref, mask, Hyper(kl_coef=0.0, gamma=1.0, lam=1.0), values_BT=values)
  np.testing.assert_allclose(mc, np.repeat(rewards.reshape(-1, 1), mask.shape[1], 1) * mask, rtol=1e-6, atol=1e-6)
  # The policy loss: the token-level clipped surrogate, no KL term (it is in the reward).
  (loss, _), grad = jax.value_and_grad(lambda lp: ppo.loss(lp, old, ref, adv, mask, hp), has_aux=True)(jnp.asarray(logp))
  expected_loss, expected_grad = np_reinforce_pp_loss(logp, old, ref, adv, mask, hp)
  np.testing.assert_allclose(float(loss), expected_loss, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(grad), expected_grad, rtol=1e-5, atol=1e-8)
  # The clipped value loss and its gradient in the values.
  new_values = values + np.random.default_rng(6).normal(0, 0.2, mask.shape).astype(np.float32)  # some past the clip
  (v_loss, metrics), v_grad = jax.value_and_grad(
      lambda v: ppo.value_loss(v, values, returns, mask, hp), has_aux=True)(jnp.asarray(new_values))
  v, v_old, ret, m = (np.asarray(a, np.float64) for a in (new_values, values, returns, mask))
  clipped = v_old + np.clip(v - v_old, -hp.value_clip, hp.value_clip)
  plain, held = np.square(v - ret), np.square(clipped - ret)
  np.testing.assert_allclose(float(v_loss), (0.5 * np.maximum(plain, held) * m).sum() / m.sum(), rtol=1e-5)
  inside = np.abs(v - v_old) <= hp.value_clip
  d = np.where((plain >= held) | inside, v - ret, 0.0) * m / m.sum()  # the clipped branch is flat in v
  np.testing.assert_allclose(np.asarray(v_grad), d, rtol=1e-5, atol=1e-7)
  assert 0 < np.mean(~inside[m > 0]) < 1  # both branches exercised
  err = (v - ret)[m > 0]
  np.testing.assert_allclose(float(metrics["explained_variance"]), 1 - err.var() / ret[m > 0].var(), rtol=1e-4)


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_advantages_loss_and_gradient_match_numpy(name):
  rewards, logp, old, ref, mask = batch()
  algorithm = algorithms.get(name)
  # gspo's sequence ratios are ~1 +- 0.1 here: a clip of 0.05 exercises both of its branches
  clip = (0.05, 0.08) if name == "gspo" else (0.2, 0.28)
  hp = Hyper(clip_low=clip[0], clip_high=clip[1], kl_coef=0.05, max_new_tokens=T, overlong_buffer=3)
  np_adv, np_loss = REFERENCES[name]
  adv = algorithm.advantages(rewards, old, ref, mask, hp)
  expected_adv = np_adv(rewards, old, ref, mask, hp)
  assert adv.shape == (P * G, T) and adv.dtype == np.float32
  np.testing.assert_allclose(adv, expected_adv, rtol=1e-5, atol=1e-6)
  assert np.all(adv[mask == 0] == 0)
  fn = lambda lp: algorithm.loss(lp, old, ref, adv, mask, hp)
  (loss, metrics), grad = jax.value_and_grad(fn, has_aux=True)(jnp.asarray(logp))
  expected_loss, expected_grad = np_loss(logp, old, ref, adv, mask, hp)
  np.testing.assert_allclose(float(loss), expected_loss, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(grad), expected_grad, rtol=1e-5, atol=1e-8)
  assert 0 < float(metrics["clip_fraction"]) < 1, "the batch must exercise both sides of the clip"
  assert float(metrics["tokens"]) == mask.sum()
  # On policy (logp = old) the ratio is exactly 1 and nothing is clipped.
  _, on_policy = algorithm.loss(jnp.asarray(old), old, ref, adv, mask, hp)
  assert float(on_policy["ratio_mean"]) == 1.0 and float(on_policy["clip_fraction"]) == 0.0


def test_the_estimators_differ_where_their_derivations_say():
  rewards, _, old, ref, mask = batch(1)
  hp = Hyper(kl_coef=0.05, max_new_tokens=T)
  adv = {name: algorithms.get(name).advantages(rewards, old, ref, mask, hp) for name in REFERENCES}
  row = lambda a: a[:, 0].reshape(P, G)  # every row's first token is a completion token
  np.testing.assert_allclose(row(adv["rloo"]), row(adv["dr_grpo"]) * G / (G - 1), rtol=1e-6)  # leave-one-out: G/(G-1)
  assert np.all(row(adv["dr_grpo"])[0] == 0) and np.all(row(adv["grpo"])[0] == 0)  # equal rewards: no signal
  assert not np.all(row(adv["reinforce_pp"])[0] == 0)  # batch-normalised: a group's own mean is not subtracted
  tokens = adv["reinforce_pp"][mask > 0]
  np.testing.assert_allclose([tokens.mean(), tokens.std()], [0.0, 1.0], atol=1e-5)


def test_dapo_overlong_penalty_ramps_to_minus_one():
  hp = Hyper(max_new_tokens=8, overlong_buffer=4)
  np.testing.assert_allclose(dapo.overlong_penalty(np.array([1, 4, 5, 6, 8]), hp), [0, 0, -0.25, -0.5, -1.0])
  np.testing.assert_array_equal(dapo.overlong_penalty(np.array([8]), Hyper(max_new_tokens=8)), [0.0])  # off


def draw(rewards_PG):
  """A stand-in Rollout of P groups with these rewards (rows numbered, to follow which were chosen)."""
  rewards = np.asarray(rewards_PG, np.float32).reshape(-1)
  B = len(rewards)
  ids = np.arange(B)
  return rollout.Rollout(examples=[{"id": int(i)} for i in ids], rows={k: np.tile(ids[:, None], (1, 2)) for k in rollout.ROW_KEYS},
                         lengths=np.ones(B, np.int32), texts=[str(i) for i in ids], rewards=rewards,
                         parts={"reward": rewards}, positions=[0], sampled_rewards=rewards, dropped_groups=0)


def test_dynamic_sampling_keeps_groups_whose_rewards_differ_and_tops_up():
  first = draw([[1, 1], [0, 1], [0, 0]])  # groups 0 and 2 have equal rewards
  second = draw([[1, 0], [2, 2], [0, 3]])
  r = rollout.select([first, second], group_size=2, groups=3, dynamic=True)
  assert r.rewards.tolist() == [0, 1, 1, 0, 0, 3]  # varied groups in draw order: (1st, g1), (2nd, g0), (2nd, g2)
  assert r.dropped_groups == 3 and r.positions == [0, 0] and len(r.sampled_rewards) == 12
  short = rollout.select([first], group_size=2, groups=3, dynamic=True)  # the draws ran out: topped up
  assert short.rewards.tolist() == [0, 1, 1, 1, 0, 0] and short.dropped_groups == 0
  assert rollout.select([first], group_size=2, groups=3, dynamic=False) is first


def post_cfg(*extra):
  return config_lib.load(["--config=configs/rl.py", *extra]).post


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_the_algorithm_alone_picks_its_recipe(name):
  algorithm, hp = algorithms.resolve(post_cfg(f"--config.post.algorithm={name}"))
  assert algorithm.name == name
  defaults = {"clip_eps": hp.clip_low, "clip_eps_high": hp.clip_high, "kl_coef": hp.kl_coef,
              "max_draws": hp.max_draws}
  for key, value in algorithm.defaults.items():
    if key in defaults:
      assert defaults[key] == value, key
  if name == "dapo":
    assert (hp.clip_low, hp.clip_high, hp.kl_coef, hp.overlong_buffer, hp.max_draws) == (0.2, 0.28, 0.0, 1, 3)
  else:
    assert hp.overlong_buffer == 0 and hp.max_draws == 1
  _, overridden = algorithms.resolve(post_cfg(f"--config.post.algorithm={name}", "--config.post.kl_coef=0.5"))
  assert overridden.kl_coef == 0.5  # a value set by the user wins


def test_bad_algorithm_settings_are_user_errors():
  with pytest.raises(UserError, match="post.algorithm='grop'.*Did you mean 'grpo'"):
    algorithms.resolve(post_cfg("--config.post.algorithm=grop"))
  with pytest.raises(UserError, match="post.clip_eps_high=-0.5"):
    algorithms.resolve(post_cfg("--config.post.clip_eps_high=-0.5"))
  with pytest.raises(UserError, match="post.overlong_buffer=9"):
    algorithms.resolve(post_cfg("--config.post.algorithm=dapo", "--config.post.overlong_buffer=9"))


def test_ppo_critic_values_match_numpy():
  """V_t = w . h_t + u . e_t + b with e_t from the completion tokens before t only (program/critic.py)."""
  from maxtrain.program import critic

  rng = np.random.default_rng(7)
  B, D, L = 3, 5, 6
  mask = np.zeros((B, T), np.float32)
  for row, (start, n) in enumerate([(1, 4), (0, 7), (3, 2)]):  # completions at different offsets and lengths
    mask[row, start:start + n] = 1.0
  logp = rng.normal(-1.0, 0.5, (B, T)).astype(np.float32)
  x = rng.normal(0, 1, (B, T, D)).astype(np.float32)
  head = {"w": rng.normal(0, 0.1, D).astype(np.float32), "u": np.array([0.3, -0.5, 0.7], np.float32),
          "b": np.float32(0.2)}
  got = np.asarray(critic.values(head, jnp.asarray(x), jnp.asarray(logp), jnp.asarray(mask), L))
  expected = np.zeros((B, T))
  for row in range(B):
    s = k = 0.0
    for t in range(T):
      e = np.array([s, np.exp(s), k / L])
      expected[row, t] = x[row, t] @ head["w"] + e @ head["u"] + head["b"]
      if mask[row, t]:  # token t joins the prefix of the positions after it
        s, k = s + float(logp[row, t]), k + 1
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
  # The critic's optimizer: w (the features' weights) moves at 1/100 of the head's rate.
  tx = critic.with_critic(dataclasses.make_dataclass("O", [("tx", object)])(tx=None), D, 1e-2).tx.critic_tx
  params = {"w": jnp.zeros(D), "u": jnp.zeros(3), "b": jnp.zeros(())}
  updates, _ = tx.update(jax.tree.map(jnp.ones_like, params), tx.init(params), params)
  np.testing.assert_allclose(np.asarray(updates["w"]), -1e-4, rtol=1e-3)
  np.testing.assert_allclose(np.asarray(updates["u"]), -1e-2, rtol=1e-3)
