"""maxtrain: a JAX-native LLM pretraining stack."""

__version__ = "0.1.0"
