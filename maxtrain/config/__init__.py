"""Config, without jax (the supervisor loads configs, and the platform environment must be set before JAX
starts): `keys.py` declares every key, `loader.py` loads a file with its hardware preset and overrides,
`help.py` prints them, `schema.py` types them (frozen sections, built once at load), `migrate.py` reads a
checkpoint's saved config (today's keys), `redaction.py` keeps secrets out of everything written or logged.

The names below are the package's interface; import them from here.
"""

from maxtrain.config.help import help_text
from maxtrain.config.keys import base_config, key_docs
from maxtrain.config.loader import load, load_file
from maxtrain.config.migrate import saved_config  # migrate.migrate: the module keeps its name
from maxtrain.config.redaction import REDACTED, redact_text, redacted, save
from maxtrain.config.schema import Config, with_values

__all__ = ["REDACTED", "Config", "base_config", "help_text", "key_docs", "load", "load_file", "redact_text", "redacted",
           "save", "saved_config", "with_values"]
