"""The default run: a tiny Qwen3-style model learns multi-digit addition with GSPO on a CPU.

A char-level tokenizer and the synthetic `arith` task are generated locally; the model is
trained from scratch with a short supervised warm start on the task itself, then GSPO takes
over (paper settings: sequence ratio, clip 3e-4 / 4e-4, 4 mini-batches per rollout).

  bash launch/local.sh                     # sets up a fresh machine and runs this
  python -m gspo_jax.main --config=configs/default.py --workdir=/tmp/gspo_default

Expected on a 2-core CPU: under 10 minutes; held-out greedy accuracy rises between the start
and the end of RL (numbers in README.md "Results").
"""

from configs import base


def get_config(arg: str | None = None):
    del arg
    c = base.get_config()
    c.num_steps = 60
    c.data.name = "arithmetic"
    c.data.config_name = "add3"
    c.reward.spec = "arith_exact"
    c.reward.accuracy = "arith_exact"
    c.data.instruction = ""  # the warm start teaches the "#### <answer>" format
    c.prompt_length = 40  # the templated char-level question is at most 37 tokens
    c.response_length = 16
    c.rollout_batch_size = 16
    c.num_return_sequences_in_group = 8
    c.num_mini_batches = 4
    c.importance_sampling = "seq"
    c.clip_low = 3e-4
    c.clip_high = 4e-4
    c.optim.learning_rate = 1e-4
    c.model.hidden_size = 128
    c.model.num_layers = 4
    c.warm_start.steps = 300
    c.eval.every_steps = 20
    c.eval.num_prompts = 256
    c.checkpoint.every_steps = 20
    return c
