"""The tiny model every end-to-end test trains (compiles in about a second on one CPU core)."""

TINY_MODEL = ["--config.model.num_layers=2", "--config.model.d_model=32", "--config.model.num_heads=4",
              "--config.model.num_kv_heads=4", "--config.model.d_ff=64", "--config.data.seq_len=32",
              "--config.data.batch_size=8", "--config.eval.batches=1"]
