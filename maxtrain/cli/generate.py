"""Entry point: `python -m maxtrain.generate --checkpoint RUN_OR_PATH --prompt TEXT [--prompt TEXT ...]
[--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S] [--draft mtp] [--config.KEY=VALUE ...]`.

RUN_OR_PATH: a run's output dir, a checkpoint step dir, a converted checkpoint or a Hugging Face dir.
The model runs on the mesh of the run's saved config (the training defaults for other sources), with
any `--config.mesh.*` overrides, e.g. `--config.mesh.tensor=2`.
Prints each prompt's continuation and the decode speed. `--draft mtp`: greedy speculative decoding drafted by the
model's multi-token-prediction module (model.mtp_layers > 0): the same text, and the draft's acceptance rate printed.
Exit 2 on bad input.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Sequence

from maxtrain.cli import shell
from maxtrain.errors import UserError
from maxtrain.data.tokenizer import prompt_ids


def parser() -> argparse.ArgumentParser:
  p = shell.ArgumentParser(prog="python -m maxtrain.generate", description=__doc__.split("\n\n")[0])
  p.add_argument("--checkpoint", required=True)
  p.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
  p.add_argument("--top-k", type=int, default=0, help="0 = off")
  p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--draft", choices=("none", "mtp"), default="none",
                 help="mtp: speculative greedy decoding drafted by the model's MTP module (inference/speculative.py)")
  return p


def check_sampling(args: argparse.Namespace) -> None:
  """UserError naming the first sampling flag out of range; before any model is loaded. NaN compares
  false with everything, so each range is written to fail on it."""
  checks = (("--max-new-tokens", args.max_new_tokens, args.max_new_tokens > 0, "must be > 0"),
            ("--temperature", args.temperature, 0 <= args.temperature < math.inf,
             "must be a finite number >= 0 (0 = greedy)"),
            ("--top-k", args.top_k, args.top_k >= 0, "must be >= 0 (0 = off)"),
            ("--top-p", args.top_p, 0 < args.top_p <= 1, "must be in (0, 1] (1 = off)"))
  for flag, value, ok, rule in checks:
    if not ok:
      raise UserError(f"{flag}={value}: {rule}")


def check_lengths(prompts: list[list[int]], max_new_tokens: int, max_seq_len: int, checkpoint: str) -> None:
  """The KV cache holds prompt + new tokens, and positions past model.max_seq_len were never trained."""
  longest = max(len(p) for p in prompts)
  if longest + max_new_tokens > max_seq_len:
    raise UserError(f"the longest prompt ({longest} tokens, special tokens included) + --max-new-tokens={max_new_tokens} = "
                    f"{longest + max_new_tokens} exceeds the model's model.max_seq_len={max_seq_len} ({checkpoint}). "
                    "Shorten the prompt or lower --max-new-tokens.")


def generate(invocation: shell.Invocation) -> None:
  args = invocation.args
  check_sampling(args)
  from maxtrain.inference import sampling  # jax only after the flags: --help without it

  generator, tokenizer, source = sampling.load(args.checkpoint, seed=args.seed, overrides=invocation.config_argv)
  # As the model's own tokenizer encodes a prompt (its post-processor; nothing for the byte tokenizer),
  # and never empty: an empty prompt starts after the end of a document.
  prompts = [prompt_ids(tokenizer, p) or [tokenizer.eos_id] for p in args.prompt]
  check_lengths(prompts, args.max_new_tokens, generator.cfg.max_seq_len, args.checkpoint)
  eos = {tokenizer.eos_id} | ({source.eos_id} if isinstance(source.eos_id, int) else set(source.eos_id or ()))
  rule = sampling.Sampling(args.temperature, args.top_k, args.top_p, args.seed)
  if args.draft == "mtp":
    from maxtrain.inference import speculative  # jax only after the flags: --help without it

    speculative.check(generator.cfg, rule)
    generator = speculative.SpeculativeGenerator(generator)
  outputs, stats = generator.generate(prompts, args.max_new_tokens, rule, eos_ids=sorted(eos),
                                      vocab_limit=min(source.vocab_size, generator.cfg.vocab_size))
  for prompt, out in zip(args.prompt, outputs):
    print(prompt + tokenizer.decode(out))
    print("-" * 40)
  if "acceptance_rate" in stats:
    print(f"mtp draft: acceptance rate {stats['acceptance_rate']:.3f} ({stats['verify_calls']} verify calls, "
          f"{stats['tokens']} tokens)", file=sys.stderr)
  print(f"decode: {stats['tokens']} tokens in {stats['decode_s']:.2f}s, {stats['tokens_per_s']:.1f} tokens/s "
        f"(prefill {stats['prefill_s']:.2f}s, compile included)", file=sys.stderr)


COMMAND = shell.Command(name="maxtrain.generate", prog="python -m maxtrain.generate", parser=parser, list_keys=False)


def main(argv: Sequence[str] | None = None) -> int:
  return shell.run(COMMAND, generate, argv)

if __name__ == "__main__":
  sys.exit(main())
