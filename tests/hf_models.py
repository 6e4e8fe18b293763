"""Tiny random Hugging Face LLaMA models for the interop tests, built locally (nothing downloaded)."""

from pathlib import Path

import numpy as np

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
VARIANTS = {
    "gqa_untied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=500.0),
    "tied_mha": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True, rope_theta=10000.0),
    "llama3_rope": dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False,
                        rope_theta=500000.0, rope_scaling=LLAMA3_ROPE),
}


def make_tokenizer(path: Path) -> Path:
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=290, special_tokens=["<s>", "</s>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
  tok.train_from_iterator(["the quick brown fox", "jumps over the lazy dog", "def f(x): return x"], trainer)
  tok.save(str(path))
  return path


def make_hf_model(directory: Path, variant: str, *, vocab_size: int = 299, seed: int = 0, tokenizer: bool = True,
                  **overrides):
  """Saves a random LlamaForCausalLM (fp32, odd vocabulary) to `directory`; returns the torch model."""
  import torch
  import transformers

  torch.manual_seed(seed)
  cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                 max_position_embeddings=64, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1,
                                 **{**VARIANTS[variant], **overrides})
  model = transformers.LlamaForCausalLM(cfg).eval()
  with torch.no_grad():  # norms away from 1 so that a swapped norm would show
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1 + 0.1 * torch.randn_like(p))
  model.save_pretrained(directory)
  if tokenizer:
    make_tokenizer(Path(directory) / "tokenizer.json")
  return model


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
  import torch

  with torch.no_grad():
    return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
