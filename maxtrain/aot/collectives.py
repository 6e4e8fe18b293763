"""The collectives of a compiled (partitioned) HLO module, read from its text: what each device
sends and receives, for before/after comparisons (tools/bench_muon.py, tests/test_optim.py).

Sizes are of each op's result as written in the HLO; an op inside a loop body (the scanned layers,
the microbatches) appears once, so compare builds of one config rather than read totals as traffic.
"""

from __future__ import annotations

import collections
import re

_DTYPE_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s16": 2,
                "u16": 2, "s8": 1, "u8": 1, "pred": 1}
KINDS = ("all-gather", "all-to-all", "reduce-scatter", "all-reduce", "collective-permute")
# `%x = f32[8,512,4096]{2,1,0} all-gather(...)`, or a tuple result `(f32[..], f32[..]) all-to-all(...)`.
_OP = re.compile(r"=\s*(\(?[^=]*?\)?)\s+(" + "|".join(KINDS) + r")(?:-start)?\(")
_COMMENT = re.compile(r"/\*.*?\*/")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")


def ops(hlo_text: str) -> list[tuple[str, str, int]]:
  """(kind, result type, bytes of the result) of every collective, in program order."""
  found = []
  for line in hlo_text.splitlines():
    m = _OP.search(_COMMENT.sub("", line))  # tuple results carry /*index=5*/ comments
    if not m:
      continue
    size = 0
    for dtype, dims in _ARRAY.findall(m.group(1)):
      n = 1
      for d in filter(None, dims.split(",")):
        n *= int(d)
      size += n * _DTYPE_BYTES.get(dtype, 4)
    found.append((m.group(2), m.group(1).strip(), size))
  return found


def totals(hlo_text: str) -> dict[str, tuple[int, int]]:
  """{kind: (ops, bytes of their results)}."""
  sums: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
  for kind, _, size in ops(hlo_text):
    sums[kind][0] += 1
    sums[kind][1] += size
  return {k: (n, b) for k, (n, b) in sorted(sums.items())}


def array_shapes(hlo_text: str, kind: str) -> list[tuple[int, ...]]:
  """The result shapes of the `kind` collectives (each array of a tuple result on its own)."""
  return [tuple(int(d) for d in filter(None, dims.split(","))) for k, result, _ in ops(hlo_text) if k == kind
          for _, dims in _ARRAY.findall(result)]
