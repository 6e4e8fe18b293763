"""Sequence packing of an RL update batch (`post.pack_updates`): the rollout's rows (each one prompt +
completion at positions 0..m-1, then padding) placed first-fit decreasing into fewer rows of the same
length. Each row keeps its own document id (segment 1, 2, ... in its packed row; padding 0) and its
positions 0..m-1, so the one attention mask (`models/attention/mask.py`: same segment, causal) keeps
completions apart and RoPE sees each at its own positions: every token's log-probability, and so a
token-level loss (sum over completion tokens / their count), is the unpacked batch's up to float rounding
(tests/test_grpo.py). Losses that read whole rows (a per-row sum, the row count) are refused at load.

Every [B, T] array of the batch (tokens, mask, log-probs, advantages) moves with its tokens. The packed
row count is rounded up to the batch shards times a power of two (at most the unpacked count), so a run
compiles the update for a few shapes only.
"""

from __future__ import annotations

import numpy as np


def lengths(segment_ids_BT: np.ndarray) -> np.ndarray:
  """Each row's real tokens: the leading run of segment 1 (`rollout.rollout_rows`' layout)."""
  real_BT = segment_ids_BT == 1
  m_B = real_BT.sum(axis=1)
  assert all(real_BT[b, :m].all() for b, m in enumerate(m_B)), "a row's real tokens must lead it"
  return m_B


def assign(m_B: np.ndarray, seq_len: int) -> list[list[int]]:
  """First-fit decreasing: packed rows as lists of source rows (longest first; ties in row order)."""
  order = sorted(range(len(m_B)), key=lambda b: (-int(m_B[b]), b))
  rows: list[list[int]] = []
  free: list[int] = []
  for b in order:
    fit = next((r for r, room in enumerate(free) if room >= m_B[b]), None)
    if fit is None:
      rows.append([]), free.append(seq_len)
      fit = len(rows) - 1
    rows[fit].append(b)
    free[fit] -= int(m_B[b])
  return rows


def padded_rows(n: int, multiple: int, most: int) -> int:
  """n packed rows rounded up to `multiple` x a power of two, at most `most` (the unpacked rows)."""
  r = multiple
  while r < n:
    r *= 2
  return max(min(r, most), n)


def pack(batch: dict[str, np.ndarray], multiple: int = 1) -> tuple[dict[str, np.ndarray], list[list[int]]]:
  """(the packed batch, which source rows each packed row holds, in order). `multiple`: the batch shards."""
  b, t = batch["segment_ids"].shape
  m_B = lengths(batch["segment_ids"])
  groups = assign(m_B, t)
  n = padded_rows(len(groups), multiple, b)
  out = {k: np.zeros((n, t), v.dtype) for k, v in batch.items()}
  for r, group in enumerate(groups):
    start = 0
    for doc, src in enumerate(group, start=1):
      m = int(m_B[src])
      for k, v in batch.items():
        out[k][r, start:start + m] = v[src, :m]
      out["segment_ids"][r, start:start + m] = doc
      start += m
  return out, groups


def unpack(packed_BT: np.ndarray, groups: list[list[int]], m_B: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
  """A per-token array of the packed batch back in the unpacked rows (zeros past each row's tokens)."""
  out = np.zeros(shape, packed_BT.dtype)
  for r, group in enumerate(groups):
    start = 0
    for src in group:
      m = int(m_B[src])
      out[src, :m] = packed_BT[r, start:start + m]
      start += m
  return out


def padding_share(m_B: np.ndarray, shape: tuple[int, ...]) -> float:
  """The share of a batch's token slots ([rows, T]) that hold none of the real tokens `m_B` (per source row)."""
  return 1.0 - float(np.sum(m_B)) / float(np.prod(shape))
