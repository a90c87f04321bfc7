"""gspo_jax: GSPO / GRPO reinforcement learning for language models in JAX (see README.md).

Entry point: `python -m gspo_jax.main --config=configs/default.py --workdir=DIR`, or
`gspo_jax.trainer.loop.run(config, workdir)` from Python. The math lives in `objectives`,
`advantages` and `logprobs`; models in `models`; the sampler in `sampling`.
"""
