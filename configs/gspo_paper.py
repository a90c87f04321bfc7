"""GSPO with the paper's algorithm settings (arXiv 2507.18071 §5.1).

Sequence-level importance ratio s_i = exp(mean_t log pi_theta/pi_old), clip range
3e-4 / 4e-4, each rollout batch split into 4 mini-batches, no KL term, 1/|y_i|
length-normalised sequence mean. Model and data come from arguments:

  # the tiny synthetic task (CPU, minutes):
  python -m gspo_jax.main --config=configs/gspo_paper.py --workdir=/tmp/gspo
  # a real checkpoint on GSM8K:
  python -m gspo_jax.main --config=configs/gspo_paper.py:hf_path=/ckpt/Qwen3-0.6B,manual_dir=/data/gsm8k \
      --workdir=/tmp/gspo_qwen

Compare with configs/grpo_paper.py (same everything but the ratio and the clip range): the
paper reports about two orders of magnitude more clipped tokens under GSPO (Fig. 4), yet
better training efficiency.
"""

from configs import base, common, default


def get_config(arg: str | None = None):
    args = common.parse_arg(arg, hf_path="", manual_dir="")
    c = default.get_config() if not args["hf_path"] else base.get_config()
    c.importance_sampling = "seq"
    c.clip_low = 3e-4
    c.clip_high = 4e-4
    c.num_mini_batches = 4
    c.use_kl_loss = False
    c.kl_loss_coef = 0.0
    c.loss_agg_mode = "seq-mean-token-mean"
    c.adv_estimator = "grpo"
    if args["hf_path"]:
        common.use_hf_model_on_gsm8k(c, args["hf_path"], args["manual_dir"])
    return c
