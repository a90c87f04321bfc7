"""gspo_jax: GSPO / GRPO reinforcement learning for language models in JAX (see README.md).

Entry points: `python -m gspo_jax.main --config=configs/default.py --workdir=DIR`, or from
Python `gspo_jax.train(config, workdir, reward_fns=[...], dataset=[...])` (trainer/api.py). The tree reads like one RL step
(docs/architecture.md): data -> sampling -> rollout -> algorithm -> train_step -> trainer,
with models, sharding and config beside them.

`gspo_jax.objectives` and `gspo_jax.advantages` are the public paths of the paper's math
(`policy_loss`, `kl_penalty`, `compute_advantages`); they are the modules of the same name in
gspo_jax/algorithm/, registered here under both names (one module object, not a copy).
"""

import sys

from gspo_jax.algorithm import advantages, objectives

sys.modules[f"{__name__}.objectives"] = objectives
sys.modules[f"{__name__}.advantages"] = advantages


def __getattr__(name: str):
    """`gspo_jax.train(config, workdir, reward_fns=..., dataset=...)`: the Python entry
    (gspo_jax/trainer/api.py), imported on first use (it brings the whole trainer)."""
    if name == "train":
        from gspo_jax.trainer.api import train

        return train
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
