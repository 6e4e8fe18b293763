"""A lint of a lowered program's HLO for what the Neuron compiler rejects (DESIGN.md, Trainium facts):
conditionals, host callbacks, while loops without a compile-time trip count, variadic reductions
(argmax), integer matmuls, the f8e4m3fn type, and random bits drawn with the threefry PRNG (Neuron
wants rbg, whose bits come from `rng-bit-generator`; rbg still derives keys (split, fold_in) with
threefry on a few words, which is allowed).

It reads the HLO text of `jax.jit(f).lower(...).as_text(dialect="hlo")`: the module before XLA's
own optimisation passes, which is what a PJRT plugin receives. Detection is textual and
conservative; a loop counts as static when its condition compares against a constant.
"""

from __future__ import annotations

import dataclasses
import math
import re

from maxtrain.aot import collectives

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*(?:\(.*\)\s*->\s*.*)?\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
_OPERANDS = re.compile(r"%?([\w.\-]+)")
_INT_TYPE = re.compile(r"^[su]\d+\[")
_DIMS = re.compile(r"\[([\d,]*)\]")
KEY_WORDS = 16  # threefry on at most this many words is key derivation, not random bits


@dataclasses.dataclass(frozen=True)
class Instruction:
  name: str
  type: str
  op: str
  operands: tuple[str, ...]
  attrs: str


@dataclasses.dataclass(frozen=True)
class Problem:
  kind: str
  computation: str
  instruction: str
  why: str

  def __str__(self) -> str:
    return f"{self.kind}: {self.instruction} in {self.computation} ({self.why})"


def _split_type(rest: str) -> tuple[str, str]:
  """'(s32[], f32[3]{0}) while(x), ...' -> ('(s32[], f32[3]{0})', 'while(x), ...')."""
  if not rest.startswith("("):
    head, _, tail = rest.partition(" ")
    return head, tail
  depth = 0
  for i, ch in enumerate(rest):
    depth += ch == "("
    depth -= ch == ")"
    if depth == 0:
      return rest[:i + 1], rest[i + 1:].lstrip()
  return rest, ""


def _matching_paren(text: str, start: int) -> int:
  depth = 0
  for i in range(start, len(text)):
    depth += text[i] == "("
    depth -= text[i] == ")"
    if depth == 0:
      return i
  return len(text)


def parse(hlo: str) -> dict[str, list[Instruction]]:
  """Computation name -> its instructions."""
  computations: dict[str, list[Instruction]] = {}
  current = None
  for line in hlo.splitlines():
    if current is None:
      m = _COMPUTATION.match(line)
      if m and not line.startswith("HloModule"):
        current = computations.setdefault(m["name"], [])
      continue
    if line.strip() == "}":
      current = None
      continue
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    type_, tail = _split_type(m["rest"])
    op, paren, _ = tail.partition("(")
    if not paren:
      continue
    close = _matching_paren(tail, len(op))
    operands = tuple(_OPERANDS.findall(tail[len(op) + 1:close]))
    current.append(Instruction(m["name"], type_, op.strip(), operands, tail[close + 1:]))
  return computations


def _attr(attrs: str, key: str) -> str | None:
  m = re.search(rf"\b{key}=%?([\w.\-]+)", attrs)
  return m.group(1) if m else None


def _elements(type_: str) -> int:
  """Elements of the (first) array in an HLO type, e.g. '(u32[64,8]{1,0}, ...)' -> 512."""
  m = _DIMS.search(type_)
  return math.prod(int(d) for d in m.group(1).split(",") if d) if m else 1


def _static_condition(instructions: list[Instruction]) -> bool:
  constants = {i.name for i in instructions if i.op == "constant"}
  for i in instructions:  # inside a shard_map body shardy wraps the bound in a Sharding custom-call: still a constant
    if i.op == "custom-call" and 'custom_call_target="Sharding"' in i.attrs and constants.intersection(i.operands):
      constants.add(i.name)
  return any(i.op == "compare" and constants.intersection(i.operands) for i in instructions)


def neuron_problems(hlo: str, *, check_prng: bool = True) -> list[Problem]:
  """Everything in `hlo` the Neuron compiler would reject. `check_prng`: also flag threefry (the
  platform preset switches JAX to rbg; a threefry left in the program means it was not applied)."""
  computations = parse(hlo)
  problems = []
  for comp, instructions in computations.items():
    for ins in instructions:
      found = None
      if check_prng and ins.op == "call" and "threefry" in (_attr(ins.attrs, "to_apply") or "") and (
          _elements(ins.type) > KEY_WORDS):
        found = "threefry PRNG", f"random bits {ins.type} from threefry: set jax_default_prng_impl=rbg"
      elif ins.op == "conditional":
        found = "conditional", "lax.cond/switch: use jnp.where masks"
      elif ins.op == "custom-call" and re.search(r'custom_call_target="[^"]*callback', ins.attrs, re.IGNORECASE):
        found = "host callback", "jax.debug.*, pure_callback, io_callback or checkify"
      elif ins.op == "while" and not _static_condition(computations.get(_attr(ins.attrs, "condition") or "", [])):
        found = "dynamic while loop", "trip count not a compile-time constant: use scan/fori_loop with static bounds"
      elif ins.op == "reduce" and ins.type.startswith("("):
        found = "variadic reduce", "argmax/argmin-style reduction over several operands"
      elif ins.op == "dot" and _INT_TYPE.match(ins.type):
        found = "integer matmul", f"dot producing {ins.type} (model.quantization=int8 makes these: use none)"
      elif "f8e4m3fn" in ins.type:
        # Neuron's FP8 is not OCP's no-Inf E4M3FN; f8e5m2 is not flagged.
        found = "f8e4m3fn", f"{ins.op} producing {ins.type} (model.quantization=fp8 makes these: use none)"
      if found:
        problems.append(Problem(found[0], comp, ins.name, found[1]))
  return problems


COLLECTIVES = collectives.KINDS + ("ragged-all-to-all", "collective-broadcast")  # ops that wait for other devices
_CALLS = re.compile(r"\b(?:body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def _called(attrs: str) -> list[str]:
  names = _CALLS.findall(attrs)
  for group in _BRANCHES.findall(attrs):
    names += [n.strip().lstrip("%") for n in group.split(",")]
  return names


def unordered_collective_loops(hlo: str) -> list[Problem]:
  """In optimised HLO (`compiled.as_text()`): a loop or conditional that holds a collective, with another
  collective (or such a loop) of the same computation that no data path orders against it.

  XLA:CPU's thunk runtime orders the plain collectives of a computation among themselves, in the module's
  schedule (their order in a scheduled module's text), but not a loop that holds collectives against them:
  devices may run the two in different orders, and each then waits at the rendezvous the other has not reached.
  A pipeline step with such a pair hung on 8 fake CPU devices (2026-12-05: a loss head's token count hoisted
  next to the schedules' per-op loops). A pair counts as ordered through data and through that chain of plain
  collectives. GPUs and TPUs issue collectives in the one scheduled order."""
  computations = parse(hlo)
  memo: dict[str, bool] = {}

  def holds(name: str) -> bool:
    if name not in memo:
      memo[name] = False  # a computation does not call itself; this also ends cycles
      memo[name] = any(i.op.removesuffix("-start") in COLLECTIVES or any(holds(c) for c in _called(i.attrs))
                       for i in computations.get(name, []))
    return memo[name]

  problems = []
  for comp, instructions in computations.items():
    by_name = {i.name: i for i in instructions}
    nested = {i.name for i in instructions if i.op in ("while", "conditional", "call") and
              any(holds(c) for c in _called(i.attrs))}
    if not nested:
      continue
    chain = [i.name for i in instructions if i.op.removesuffix("-start") in COLLECTIVES]
    plain = set(chain)
    # The runtime's order of plain collectives: each one after the one scheduled before it.
    preds = {i.name: [o for o in i.operands if o in by_name] for i in instructions}
    for earlier, later in zip(chain, chain[1:]):
      preds[later].append(earlier)
    before: dict[str, set[str]] = {}

    def ancestors(name: str) -> set[str]:
      if name not in before:
        seen, stack = set(), list(preds[name])
        while stack:
          x = stack.pop()
          if x not in seen:
            seen.add(x)
            stack.extend(preds[x])
        before[name] = seen
      return before[name]

    for loop in sorted(nested):
      for other in sorted((nested - {loop}) | plain):
        if (other not in nested or other > loop) and loop not in ancestors(other) and other not in ancestors(loop):
          problems.append(Problem("unordered collectives", comp, f"{loop} / {other}",
                                  f"{by_name[loop].op} holding collectives and {by_name[other].op} with no data "
                                  "path between them: XLA:CPU may run them in different orders on different devices"))
  return problems
