"""GSPO (or GRPO) on long additions with a written scratchpad: responses of 34 to 256
tokens whose lengths vary with the question, the regime GSPO's argument is about (the
token-level ratio noise of GRPO accumulates over a long response; GSPO's sequence ratio
averages it). The default task's 0.1M-parameter model and 16-token answers cannot show it.

Task (gspo_jax/data/scratchpad.py): a + b with both operands of d digits, worked column by
column, each line restating the digits left ("4781+2959: 1+9=10", "478+295: 8+5+1=14",
..., "#### 7740"). A supervised warm start imitates a teacher
who drops every carry on 60 % of the problems that need one (as the default run's does);
RL against the exact verifier (`arith_exact`, the number after "####") has to unlearn it,
one early slip deciding the whole answer.

Two scales (`scale=`), the same everything else:
  gpu  scratchpad/pad4_10: d in [4, 10], responses 66-245 tokens (mean 146); Qwen3-style
       4 layers, d_model 256, 4 heads of 64 (2 KV), MLP 768: 2.9M parameters
  cpu  scratchpad/pad2_6: d in [2, 6], responses 32-125 tokens (mean 75); d_model 128,
       heads of 32, MLP 384: 0.8M parameters (what two CPU cores train in minutes)

  python -m gspo_jax.main --config=configs/scratchpad.py --workdir=/tmp/pad
  python -m gspo_jax.main --config=configs/scratchpad.py:algo=grpo --workdir=/tmp/pad_grpo
  python -m gspo_jax.main --config=configs/scratchpad.py:scale=cpu --workdir=/tmp/pad_cpu
"""

from configs import common, grpo_paper, gspo_paper

ALGOS = {"gspo": gspo_paper, "grpo": grpo_paper}
# scale -> (task config, model width, response_length)
SCALES = {"gpu": ("pad4_10", 256, 256), "cpu": ("pad2_6", 128, 128)}


def get_config(arg: str | None = None):
    args = common.parse_arg(arg, algo="gspo", scale="gpu")
    if args["algo"] not in ALGOS:
        raise ValueError(
            f"configs/scratchpad.py: algo={args['algo']!r} is not one of {list(ALGOS)}"
        )
    c = ALGOS[args["algo"]].get_config()  # the paper's algorithm and the default's loop
    use_scratchpad(c, args["scale"])
    return c


def use_scratchpad(c, scale: str = "gpu"):
    """The scratchpad task at `scale`, its model and warm start, on top of a default-task
    config `c` (the experiment's --task=scratchpad applies it to every arm)."""
    if scale not in SCALES:
        raise ValueError(f"configs/scratchpad.py: scale={scale!r} is not one of {list(SCALES)}")
    digits, width, response = SCALES[scale]
    c.data.name = "scratchpad"
    c.data.config_name = digits
    # The templated question is at most 81 tokens; a solution at most d² + 14·d + 4 tokens
    # plus the end token (245 at 10 digits, 125 at 6).
    c.prompt_length = 88
    c.response_length = response
    c.sampling.prompt_buckets = (64, 88)
    c.model.hidden_size = width
    c.model.intermediate_size = 3 * width
    c.model.num_layers = 4
    c.model.num_heads = 4
    c.model.num_kv_heads = 2
    c.model.head_dim = width // 4
    c.warm_start.learning_rate = 1e-3
    c.warm_start.batch_size = 32
    c.warm_start.steps = 1500
    c.warm_start.target_accuracy = 0.3  # stop at >= 30 % greedy accuracy on 200 train problems
    c.warm_start.check_every = 100
    c.warm_start.max_steps = 4000
    c.eval.num_prompts = 500
    c.eval.batch_size = 50
    return c
