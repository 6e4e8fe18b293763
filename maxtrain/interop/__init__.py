"""Hugging Face interop: LLaMA checkpoints in (`hf_import`) and out (`hf_export`), one block of one
tensor at a time, and parameters onto a run's mesh (`init_from`). Entry point: `python -m maxtrain.convert`."""
