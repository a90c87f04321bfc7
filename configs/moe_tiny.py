"""A tiny Qwen3-MoE trained from scratch on the default task: Routing Replay at laptop scale.

The default run (configs/default.py: 2-digit addition, a warm start that imitates a teacher
who drops carries, then RL against the exact verifier) with the dense MLP of every layer
replaced by 8 SwiGLU experts, 2 active per token (0.2M parameters, 0.1M active). The
algorithm is the paper's GSPO or GRPO (configs/gspo_paper.py, configs/grpo_paper.py), or
another of the GSPO family (algo=sapo, cispo, gmpo, luspo, dppo: configs/<algo>.py):

  python -m gspo_jax.main --config=configs/moe_tiny.py --workdir=/tmp/moe_gspo
  python -m gspo_jax.main --config=configs/moe_tiny.py:algo=grpo,routing_replay=true \
      --workdir=/tmp/moe_grpo_rr
  python -m gspo_jax.main --config=configs/moe_tiny.py:algo=grpo --workdir=/tmp/moe_grpo

Paper §5.3: about 10% of the activated experts change after each update of a 48-layer MoE,
GRPO needs Routing Replay to converge there, GSPO does not. Every update logs
`updates/expert_change/<u>` (the fraction of activated experts the current router picks
differently from π_old's; with replay: would pick). `python -m
experiments.gspo_vs_grpo` runs all three, three seeds each (docs/results.md), from
the dense default's warm start upcycled to these 8 experts: this config's own from-scratch
warm start (1200 steps) solved too few held-out problems to give a short RL run a reward
(the figure: docs/results.md, "Task").
"""

from configs import cispo, common, dppo, gmpo, grpo_paper, gspo_paper, luspo, sapo

# The paper's two, and the rest of the GSPO family's presets (docs/objectives.md).
ALGOS = {
    "gspo": gspo_paper,
    "grpo": grpo_paper,
    "sapo": sapo,
    "cispo": cispo,
    "gmpo": gmpo,
    "luspo": luspo,
    "dppo": dppo,
}


def get_config(arg: str | None = None):
    args = common.parse_arg(arg, algo="gspo", routing_replay=False)
    if args["algo"] not in ALGOS:
        raise ValueError(f"configs/moe_tiny.py: algo={args['algo']!r} is not one of {list(ALGOS)}")
    c = ALGOS[args["algo"]].get_config()  # the paper's algorithm on configs/default.py's task
    c.model.arch = "qwen3_moe"
    c.model.num_experts = 8
    c.model.num_experts_per_tok = 2
    c.model.moe_intermediate_size = 64
    c.model.moe_impl = "dense"  # every expert on every token: faster than ragged on a CPU
    # at this size, and exact (tests/models/test_models_moe.py: dense == ragged)
    c.model.routing_replay = args["routing_replay"]
    return c
