"""Flags shrinking configs/default.py to a 2-layer d=32 model for end-to-end tests."""

TINY_MODEL = [
    "--config.response_length=12",
    "--config.model.hidden_size=32",
    "--config.model.intermediate_size=64",
    "--config.model.num_layers=2",
    "--config.model.num_heads=2",
    "--config.model.num_kv_heads=1",
    "--config.model.head_dim=16",
    "--config.warm_start.steps=3",
    "--config.warm_start.batch_size=16",
    "--config.checkpoint.every_steps=1",
    "--config.log.progress_bar=false",
]
