"""GRPO, the paper's baseline (arXiv 2507.18071 §2 and §5.1).

Per-token importance ratio pi_theta(y_t)/pi_old(y_t), clip range 0.2 / 0.27, 4
mini-batches per rollout, no KL. On a Mixture-of-Experts model the paper needs Routing
Replay for GRPO to converge (§5.3): pass routing_replay=true.

  python -m gspo_jax.main --config=configs/grpo_paper.py --workdir=/tmp/grpo
  python -m gspo_jax.main --config=configs/grpo_paper.py:hf_path=/ckpt/Qwen3-30B-A3B,manual_dir=/data/gsm8k,routing_replay=true \
      --workdir=/tmp/grpo_moe
"""

from configs import base, common, default


def get_config(arg: str | None = None):
    args = common.parse_arg(arg, hf_path="", manual_dir="", routing_replay=False)
    c = default.get_config() if not args["hf_path"] else base.get_config()
    c.importance_sampling = "token"
    c.clip_low = 0.2
    c.clip_high = 0.27
    c.num_mini_batches = 4
    c.use_kl_loss = False
    c.kl_loss_coef = 0.0
    c.loss_agg_mode = "seq-mean-token-mean"
    c.adv_estimator = "grpo"
    c.model.routing_replay = args["routing_replay"]
    if args["hf_path"]:
        common.use_hf_model_on_gsm8k(c, args["hf_path"], args["manual_dir"])
    return c
