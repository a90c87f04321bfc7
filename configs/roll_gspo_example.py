"""ROLL's GSPO recipe (alibaba/ROLL, docs "User Guides / Algorithms / GSPO", the page as last
updated 2026-04-30: gh-pages commit 6ac37eb1164294fe4ba15dacb9cf50d21038d36f,
https://alibaba.github.io/ROLL/docs/User%20Guides/Algorithms/GSPO) in gspo_jax, with ROLL's
own key names:

  adv_estimator: "grpo"           whiten_advantages: false    advantage_clip: 2.0
  importance_sampling: seq        dual_clip_loss: true        reward_clip: 10
  ppo_epochs: 1                   use_kl_loss: true           kl_loss_coef: 0.001
  loss_agg_mode: "seq-mean-token-mean"
  norm_mean_type / norm_std_type: ~ (reward_norm None), add_token_level_kl: false
  rollout_batch_size: 64, num_return_sequences_in_group: 8,
  prompt_length: 2048, response_length: 4096       (with hf_path: a real model on GSM8K)

Earlier versions of that page and its examples/docs_examples/example_gspo.yaml used
adv_estimator "reinforce" with whiten_advantages true: `estimator=reinforce` below gives that
variant. (Their English yaml also said loss_agg_mode "seq-mean-token-sum", the Chinese
"seq-mean-token-mean"; both variants here keep the latter, GSPO's 1/|y_i| normalisation.)

Where the recipe is silent or ambiguous:
- clip range: the recipe sets no pg_clip. ROLL's default (0.2) would never clip a sequence
  ratio (they sit within ~1e-3 of 1; config validation warns), so we use the paper's
  3e-4 / 4e-4 (§5.1).
- num_mini_batches: not set by the recipe; 4 here, as the paper (§5.1).
- add_token_level_kl=true (an argument) turns on the in-reward token-level KL with
  token_level_kl_coef 0.001 (our choice: the recipe's KL strength), keeping the KL loss.

  python -m gspo_jax.main --config=configs/roll_gspo_example.py --workdir=/tmp/roll_gspo
  python -m gspo_jax.main --config=configs/roll_gspo_example.py:add_token_level_kl=true \
      --workdir=/tmp/roll_gspo_tokkl
  python -m gspo_jax.main --config=configs/roll_gspo_example.py:estimator=reinforce \
      --workdir=/tmp/roll_gspo_reinforce
  python -m gspo_jax.main \
      --config=configs/roll_gspo_example.py:hf_path=/ckpt/Qwen3-0.6B,manual_dir=/data/gsm8k \
      --workdir=/tmp/roll_gspo_qwen

Without hf_path it runs on configs/default.py's task and tiny model (batch and lengths of
that task; the algorithm settings above).
"""

from configs import base, common, default


def get_config(arg: str | None = None):
    args = common.parse_arg(
        arg, hf_path="", manual_dir="", add_token_level_kl=False, estimator="grpo"
    )
    if args["estimator"] not in ("grpo", "reinforce"):
        raise ValueError(
            f"roll_gspo_example: estimator={args['estimator']!r}; expected grpo (ROLL's page "
            "of 2026-04-30) or reinforce (its earlier yaml, with whitened advantages)"
        )
    c = default.get_config() if not args["hf_path"] else base.get_config()
    c.adv_estimator = args["estimator"]
    c.importance_sampling = "seq"
    c.ppo_epochs = 1
    c.num_mini_batches = 4
    c.use_kl_loss = True
    c.kl_loss_coef = 0.001
    c.loss_agg_mode = "seq-mean-token-mean"
    c.whiten_advantages = args["estimator"] == "reinforce"
    c.advantage_clip = 2.0
    c.dual_clip_loss = True
    c.reward_clip = 10.0
    c.reward_norm = None
    c.reward_shift = False
    c.reward_scale = False
    c.clip_low, c.clip_high = 3e-4, 4e-4  # the paper (§5.1); the recipe sets no pg_clip
    c.add_token_level_kl = args["add_token_level_kl"]
    c.token_level_kl_coef = 0.001 if args["add_token_level_kl"] else 0.0
    if args["hf_path"]:
        common.use_hf_model_on_gsm8k(c, args["hf_path"], args["manual_dir"])
        c.rollout_batch_size, c.num_return_sequences_in_group = 64, 8
        c.prompt_length, c.response_length = 2048, 4096
    return c
