"""The default run: a ~3.5M-parameter LLaMA on the Python standard library, sized to train on a
2-core CPU in a few minutes. Every key is documented in maxtrain/config/keys.py."""

from maxtrain.config import base_config


def get_config():
  return base_config()
