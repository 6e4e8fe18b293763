"""RL on the embedded arithmetic task with the algorithm of your choice, each at its recommended recipe:

  python -m maxtrain.train --config=configs/rl.py --config.post.algorithm=rloo \\
      --config.checkpoint.init_from=runs/sft/checkpoints/200

post.algorithm = grpo | dr_grpo | rloo | reinforce_pp | dapo | gspo | ppo. What an algorithm needs beyond the
shared keys (clip range, KL weight, DAPO's overlong buffer and draws) is a default of that algorithm
(post.* keys left at -1; maxtrain/posttrain/algorithms); set a key to override it. The shared recipe is
configs/grpo.py's (8 prompts x 8 completions, 2 epochs x 2 minibatches a round, 40 rounds) with a cosine
schedule from lr 5e-5 over the run's 160 optimizer updates. See docs/post_training.md."""

from pathlib import Path

from maxtrain.config import load_file


def get_config():
  c, _ = load_file(Path(__file__).with_name("grpo.py"))
  c.output_dir = "runs/rl"
  c.post.mode = "rl"
  c.post.algorithm = "grpo"
  c.optimizer.schedule = "cosine"  # over optimizer updates (rounds x 4), not rounds
  c.optimizer.lr = 5e-5  # the cosine's mean over the run is ~grpo.py's constant 3e-5
  c.optimizer.min_lr_ratio = 0.1
  return c
