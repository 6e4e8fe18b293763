"""Model families through one registry (models/registry.py): nothing outside models/ names a family, the
pieces (q/k/v biases, qk-norm, head_dim, sliding windows) against a NumPy/plain-JAX reference, and the
flash and blocked kernels skip the key blocks a window leaves out."""

import ast
import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtrain.models import registry
from maxtrain.models.attention import flash as fa
from maxtrain.models.attention.blocked import blocked_attention
from maxtrain.models.attention.layer import dot_product_attention

REPO = Path(__file__).resolve().parent.parent
# The declaration of model.family's default (config/ sits below models/ and cannot ask the registry).
ALLOWED = {("maxtrain/config/keys.py", registry.DEFAULT)}


def _family_words() -> set[str]:
  words = set()
  for family in registry.families().values():
    words |= {family.name, family.hf.architecture, family.hf.model_type, family.name.capitalize()}
    words.add(type(family.module).__name__ if not isinstance(family.module, type) else "")
  return words - {""} | {"Llama", "Qwen2", "Qwen3", "Mistral"}


def test_no_module_outside_models_names_a_family():
  """A family is its module in models/ plus a registry line: elsewhere no string literal is a family's name,
  HF architecture or model_type, no identifier is a family's class, and no import reaches a family module
  (prose in docstrings and comments may mention them)."""
  words = _family_words()
  modules = {f"maxtrain.models.{name}" for name in registry.names()}
  found = []
  for path in sorted((REPO / "maxtrain").rglob("*.py")):
    if path.is_relative_to(REPO / "maxtrain" / "models"):
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      where = str(path.relative_to(REPO))
      if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in words and (
          where, node.value) not in ALLOWED:
        found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
      elif isinstance(node, (ast.Name, ast.Attribute)) and (getattr(node, "id", None) or node.attr) in words:
        found.append(f"{path.relative_to(REPO)}:{node.lineno}: {getattr(node, 'id', None) or node.attr}")
      elif isinstance(node, ast.ImportFrom) and (node.module in modules or any(
          f"{node.module}.{a.name}" in modules for a in node.names)):
        found.append(f"{path.relative_to(REPO)}:{node.lineno}: import {node.module}")
      elif isinstance(node, ast.Import) and any(a.name in modules for a in node.names):
        found.append(f"{path.relative_to(REPO)}:{node.lineno}: import")
  assert not found, "\n".join(found)
