"""Every default of gspo_jax, each field commented. Experiment configs override a few.

The algorithm fields use ROLL's GSPO vocabulary (adv_estimator, importance_sampling,
rollout_batch_size, ...) so a ROLL yaml translates line by line. Paper references are to
"Group Sequence Policy Optimization" (Qwen team, arXiv 2507.18071).

Run any config with

  python -m gspo_jax.main --config=configs/<name>.py --workdir=/tmp/run --config.ppo_epochs=2

The config is locked: a misspelt `--config.foo=` is an error, never a silently new field.
`gspo_jax.config.validate.validate(config)` checks it at start-up (modes, divisibility, paper ranges).
"""

import ml_collections
from ml_collections import config_dict

from configs import common

_placeholder = config_dict.placeholder


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    common.no_arg(arg, "configs/base.py")
    c = ml_collections.ConfigDict()
    c.seed = 0  # one seed for init, data order, sampling and dropout-free training
    c.num_steps = 100  # RL steps; each samples one rollout batch and trains on it
    c.imports = ""  # your code, imported at start-up in every process (reward workers too):
    # comma-separated module names or .py files, e.g. "my_rewards.py" whose
    # @gspo_jax.rewards.register_reward("my_reward") makes reward.spec=my_reward valid

    # ------------------------------------------------------------------------------------
    # Algorithm (ROLL names). GSPO = importance_sampling "seq"; GRPO = "token".
    # ------------------------------------------------------------------------------------
    c.adv_estimator = "grpo"  # "grpo": group z-score of rewards (paper §2 eq. 3, §4.1);
    # "reinforce": the processed reward itself (use with whiten_advantages, ROLL's GSPO yaml);
    # "rloo": r_i minus the mean reward of the group's other responses (needs G >= 2)
    c.norm_adv_by_std_in_grpo = True  # "grpo" divides by the group's reward std; False:
    # mean-centred only (Dr. GRPO's baseline; with loss_agg_mode "seq-mean-token-sum-norm"
    # this is Dr. GRPO as published, configs/dr_grpo.py)
    c.loss_mode = "clip"  # the per-token policy loss (docs/objectives.md): "clip" (PPO/GRPO/
    # GSPO clipped surrogate) | "sapo" (soft gate) | "cispo" (clipped stop-gradient weight) |
    # "gmpo" (geometric mean, log-space clip; importance_sampling "token") | "dppo_tv" |
    # "dppo_kl" (binary TV / KL trust-region mask). LUSPO: "clip" with importance_sampling
    # "seq" and loss_agg_mode "seq-mean-token-sum" (configs/luspo.py)
    c.sapo_tau_pos = 1.0  # SAPO gate temperature for A > 0 (arXiv 2511.20347's value)
    c.sapo_tau_neg = 1.05  # ... for A <= 0 (> sapo_tau_pos: negative tokens decay faster)
    c.dppo_delta_low = 0.15  # DPPO-TV: mask A < 0 tokens whose p - p_old < -delta_low
    c.dppo_delta_high = 0.15  # DPPO-TV: mask A > 0 tokens whose p - p_old > delta_high;
    # DPPO-KL: mask tokens whose binary KL(p_old || p) > delta_high, moved in A's direction
    # (the paper's KL threshold is 0.05: configs/dppo.py:variant=kl)
    c.dppo_max_weight = 5.0  # DPPO: the stop-gradient weight min(r, dppo_max_weight)
    c.opsm_delta = _placeholder(float)  # off-policy sequence masking (DeepSeek-V3.2 §3), any
    # loss_mode: no loss for a sequence with A < 0 whose mean_t (log mu - log pi_theta) > delta,
    # mu the sampler (None: off). Scales differ: TRL's example 0.5, slime's default 1e-4
    # (docs/objectives.md)
    c.importance_sampling = "seq"  # "seq": GSPO s_i = exp(mean_t log ratio) (paper §4.1);
    # "seq_token": GSPO-token, stop-gradient form (paper §4.3); "token": GRPO/PPO ratio (§2)
    c.rollout_batch_size = 8  # prompts per RL step (N)
    c.num_return_sequences_in_group = 8  # responses per prompt (G); B = N * G
    c.prompt_length = 128  # max prompt tokens (left padded); longer prompts are an error
    c.response_length = 128  # max new tokens per response; also the seq-mean-token-sum-norm horizon
    c.ppo_epochs = 1  # passes over each rollout batch
    c.num_mini_batches = 4  # optimizer steps per epoch; paper §5.1 splits each rollout into 4
    c.micro_batch_size = _placeholder(int)  # responses per gradient-accumulation micro-batch
    # inside the jitted step (None: the whole mini-batch at once). Never changes the loss.
    c.loss_agg_mode = "seq-mean-token-mean"  # "token-mean" | "seq-mean-token-sum" |
    # "seq-mean-token-mean" (GSPO's 1/|y_i| length normalisation, §4.1) | "seq-mean-token-sum-norm"
    c.clip_low = 3e-4  # lower clip range eps_low: r >= 1 - clip_low (paper §5.1: 3e-4 for GSPO,
    c.clip_high = 4e-4  # upper eps_high: r <= 1 + clip_high; 4e-4 for GSPO; GRPO uses 0.2 / 0.27)
    c.dual_clip_loss = False  # cap the loss of negative-advantage samples at -A * dual_clip_ratio
    c.dual_clip_ratio = 3.0  # dual-clip constant c (Ye et al. 2020); must be > 1
    c.use_kl_loss = False  # add kl_loss_coef * KL(pi_theta || pi_ref) to the loss (paper: off)
    c.kl_loss_coef = 0.0  # beta of the KL loss term
    c.kl_estimator = "k3"  # "k1" | "k2" | "k3" | "low_var_kl" (Schulman's estimators)
    c.add_token_level_kl = False  # subtract token_level_kl_coef * KL_t from the reward per token
    c.token_level_kl_coef = 0.0  # beta of the in-reward token-level KL (with reward-to-go)
    c.entropy_coef = 0.0  # subtract entropy_coef * entropy from the loss (0: off)
    c.whiten_advantages = False  # z-score advantages over the batch after the estimator
    c.advantage_clip = _placeholder(float)  # clip advantages to +-advantage_clip (None: off)
    c.reward_clip = _placeholder(float)  # clip rewards to +-reward_clip after normalising
    c.reward_norm = _placeholder(str)  # None/"none" | "batch" | "group" | "running"
    c.reward_shift = False  # with reward_norm: subtract the mean only
    c.reward_scale = False  # with reward_norm: divide by the std only (both/neither: z-score)
    c.old_logprobs_source = "recompute"  # pi_old: "recompute" (the train step's own forward
    # pass at the rollout params, on the very micro-batches its updates use, so the first
    # update's ratios are exactly 1, also in bf16) or "sampler" (the sampler's log-probs,
    # paper §5.4: saves that pass; the first update's ratios then carry the train/inference
    # mismatch, logged as policy/ratio_noise_floor and sampler/*)
    c.rollout_correction = "none"  # sampler/trainer mismatch as a separate stop-gradient
    # weight on the loss, never in the GSPO ratio or its clip (docs/rollout_correction.md):
    # "none" | "tis" (w = min(rho, C)) | "mask" (w = rho inside [1/C, C], else 0), with
    # rho = pi_old / pi_sampler and pi_old the trainer's own (runs the pi_old pass whatever
    # old_logprobs_source says; the ratio then measures policy change only)
    c.rollout_correction_level = "token"  # "token": rho per token; "seq": one rho per
    # response, exp(mean_t log rho) (the geometric mean, as GSPO's s_i; never exp of the sum)
    c.rollout_correction_threshold = 2.0  # C > 1: the TIS cap, or the mask's [1/C, C]
    c.shared_prompt = True  # train step and log-prob pass: each prompt's tokens through the
    # model once per group, its G responses attending to them (dense models; the same numbers)
    c.packing = _placeholder(bool)  # train step (π_old pass included) and π_ref's log-prob
    # pass: responses packed into rows of pack_length real tokens (segment ids, attention and
    # DeltaNet state within a segment), so long-tailed lengths stop costing padding; the same
    # numbers. None: on when response_length >= 64 (where it wins, docs/benchmarks.md)
    c.pack_length = 0  # tokens per packed row; 0: prompt + response length (a rollout row)
    c.logprob_chunk_size = 256  # tokens per chunk of the chunked log-softmax, per chip (a
    # batch split over n chips runs chunks of n x this many tokens): [B, T, V] f32 logits never
    # exist (docs/architecture.md); larger chunks are faster, smaller use less memory
    c.invalid_reward = "mask"  # NaN / non-numeric / failed-verifier rewards: "mask" (excluded
    # from group statistics, advantage 0, counted) or "zero" (treated as reward 0, counted)
    # DAPO (Yu et al. 2025) rollout options, all off by default (gspo_jax/rollout/filtering.py):
    c.dynamic_sampling = False  # drop groups whose rewards are all equal (zero std: zero
    # advantage, no gradient) and sample more prompts until rollout_batch_size groups are live
    c.dynamic_sampling_max_rounds = 3  # extra sampling rounds per RL step at most; a batch
    # still short after them is filled with masked dead groups (rollout/groups_short)
    c.overlong_filter = False  # truncated responses (no end token within response_length) get
    # no loss; they still count in their group's reward statistics (DAPO §3.4, TRL)
    c.overlong_buffer_len = 0  # DAPO's soft overlong penalty: a response of length L in
    # (response_length - buffer, response_length] gets reward -= (L - (response_length -
    # buffer)) / buffer * overlong_penalty_factor; 0: no penalty
    c.overlong_penalty_factor = 1.0  # the penalty at L = response_length (>= 0)

    # ------------------------------------------------------------------------------------
    # Policy model.
    # ------------------------------------------------------------------------------------
    c.model = ml_collections.ConfigDict()
    c.model.hf_path = _placeholder(str)  # checkpoint to start from: a local Hugging Face
    # directory, or a Hub id ("Qwen/Qwen3-0.6B", "org/name@revision") in the HF cache
    c.model.download = False  # let a Hub id missing from the cache be downloaded (opt-in)
    c.model.tokenizer_path = _placeholder(str)  # tokenizer dir (default: hf_path)
    c.model.param_dtype = "float32"  # master weights
    c.model.dtype = "float32"  # compute dtype ("bfloat16" for bf16 compute, f32 master weights)
    # rematerialisation per decoder layer: "none" | "full" | "dots" | "save_qkv" |
    # "save_qkv_attention" (models/config.py says what each keeps)
    c.model.remat = "none"
    c.model.moe_impl = "ragged"  # MoE dispatch: "ragged" (sorted, lax.ragged_dot) | "dense"
    c.model.attention_impl = "auto"  # "auto" (splash on TPU, cudnn on GPU, xla on CPU) | "xla" |
    # "splash" | "cudnn": kernel of the full-sequence attention (gspo_jax/models/attention.py)
    c.model.scan_layers = config_dict.FieldReference(True, field_type=bool)  # full-sequence
    # pass: True, one lax.scan over the stacked layers (compile time independent of depth);
    # False, a Python loop, faster for a few small layers; None, scan a model of more than
    # 4 layers (every published architecture: a checkpoint's, a --preset's), loop otherwise
    c.model.routing_replay = False  # MoE only: replay the rollout policy's expert choices in
    # the train step (paper §5.3; GRPO needs it on MoE, GSPO should not)
    c.model.router_aux_loss_coef = 0.0  # MoE only: Qwen3-MoE's router load-balancing loss
    # (models/moe_aux.py) times this, added to the RL loss and the warm start's (0: off; a
    # checkpoint's config.json value is not read: transformers adds it only with
    # output_router_logits, off in Qwen's checkpoints; Qwen3-MoE's config default is 0.001)
    c.model.lora_rank = 0  # LoRA adapters of this rank on the lora_targets (0: off, every
    # weight trains); only the adapters train, are in the optimizer state and checkpoints
    c.model.lora_alpha = 16.0  # LoRA scale alpha: y = W x + (alpha / rank) * B(A x)
    c.model.lora_targets = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"  # comma-
    # separated projections LoRA adapts: attention q/k/v/o, dense MLP gate/up/down (not MoE)
    # Architecture of a model trained from scratch (used when hf_path is None):
    c.model.arch = "qwen3"
    c.model.hidden_size = 128
    c.model.intermediate_size = 384
    c.model.num_layers = 4
    c.model.num_heads = 4
    c.model.num_kv_heads = 2
    c.model.head_dim = 32
    c.model.rope_theta = 10000.0
    c.model.tie_word_embeddings = True
    c.model.num_experts = 0  # > 0 with arch "qwen3_moe"
    c.model.num_experts_per_tok = 2
    c.model.moe_intermediate_size = 128

    # ------------------------------------------------------------------------------------
    # Rollout sampler.
    # ------------------------------------------------------------------------------------
    c.sampling = ml_collections.ConfigDict()
    c.sampling.temperature = 1.0  # 0 is greedy; log-probs are of softmax(logits / temperature)
    c.sampling.top_k = _placeholder(int)  # filter to the k most likely tokens (None: off)
    c.sampling.top_p = _placeholder(float)  # nucleus filter (None: off)
    c.sampling.prompt_buckets = (32, 64, 128, 256, 512, 1024, 2048)  # padded prompt lengths:
    # prompts of a bucket seen before never recompile
    c.sampling.engine = "continuous"  # a finished row takes the next queued sequence (paged
    # KV cache); "static": every row decodes until the last one ends (cheaper per step on CPU
    # for small models and short, even lengths). Same samples for the same seed (README,
    # "Rollout engines")
    c.sampling.num_slots = _placeholder(int)  # continuous decode rows (None: one per sequence
    # up to the rows a decode step costs about the same for, 256 on TPU / 16 on CPU, else
    # ~1/4 of the sequences, within kv_budget_tokens: gspo_jax.sampling.continuous.default_num_slots)
    c.sampling.page_size = 16  # tokens per KV page (continuous)
    c.sampling.kv_budget_tokens = _placeholder(int)  # response tokens the KV pages hold at
    # once (None: every slot at full length); below that, rows wait or are preempted and rerun
    c.sampling.kv_dtype = "auto"  # storage of the decode's keys/values: "auto" (the compute
    # dtype, model.dtype), "bfloat16", "float32", or "int8" (continuous engine only: int8 pages
    # with an f32 scale per token and kv head, ~0.52x a bf16 pool at head_dim 128; the sampler's
    # log-probs then carry the quantisation, docs/benchmarks.md). Sampler log-probs feed only
    # old_logprobs_source="sampler" and rollout_correction; the default pi_old is recomputed
    c.sampling.shared_prefix_attention = True  # int8 KV pages with a shared prefill: a decode
    # step reads a prompt's pages once for all its responses (cascade attention,
    # gspo_jax.models.paged_prefix); no effect elsewhere. Same math, summed in another order
    c.sampling.rollout_layout = "auto"  # how the rollout lays the policy out on the mesh,
    # remade from the trainer's params once per RL step: "tensor" (weights in the compute
    # dtype, heads / MLP / KV heads / vocabulary split over mesh.fsdp x mesh.tensor, rows
    # over mesh.data), "trainer" (the trainer's rules, each weight gathered whole per call;
    # the continuous engine runs one replica per data x fsdp chip),
    # "auto": "tensor" when mesh.fsdp x mesh.tensor > 1 divides the model's kv heads, else
    # "trainer" (docs/tpu.md, "The rollout layout")
    c.sampling.rollout_mesh = ml_collections.ConfigDict()
    c.sampling.rollout_mesh.tensor = 0  # > 0: the rollout runs on a mesh of its own over the
    # same chips, groups of this many chips splitting the model ("tensor" layout) x replicas
    # over the rest, whatever the trainer's mesh; the params are resharded onto it once per RL
    # step, the samples come back (sampling/layout.py). 0: the trainer's mesh (rollout_layout)

    # ------------------------------------------------------------------------------------
    # Optimizer (optax AdamW, clip-by-global-norm, warmup + constant/cosine schedule).
    # ------------------------------------------------------------------------------------
    c.optim = ml_collections.ConfigDict()
    c.optim.learning_rate = 1e-6  # peak learning rate
    c.optim.schedule = "constant"  # "constant" | "cosine" (decays to end_lr_ratio * peak)
    c.optim.warmup_steps = 0  # linear warm-up, in optimizer updates
    c.optim.end_lr_ratio = 0.1  # cosine floor as a fraction of the peak
    c.optim.weight_decay = 0.0
    c.optim.b1 = 0.9
    c.optim.b2 = 0.999
    c.optim.eps = 1e-8
    c.optim.max_grad_norm = 1.0  # clip by global norm (None or 0: off)
    c.max_all_skipped_steps = 3  # stop (exit 1, nothing exported) after this many RL steps in
    # a row whose every optimizer update was skipped for a non-finite gradient or update:
    # such a run trains nothing (0: never stop; a rare bad batch skips one update and goes on)

    # ------------------------------------------------------------------------------------
    # Device mesh. -1 on one axis absorbs the remaining devices.
    # ------------------------------------------------------------------------------------
    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1  # pure data parallelism (batch)
    c.mesh.fsdp = 1  # batch + parameter sharding (ZeRO-3 style)
    c.mesh.tensor = 1  # heads / mlp / vocab sharding
    c.mesh.expert = 1  # MoE experts
    # slices (TPU multi-slice, joined by the data-center network) that split the batch; the
    # axes above then describe one slice, and mesh.data is per slice
    c.mesh.dcn_data = 1

    # ------------------------------------------------------------------------------------
    # Data: TFDS builders in array_record format, read with grain.
    # ------------------------------------------------------------------------------------
    c.data = ml_collections.ConfigDict()
    c.data.name = "arithmetic"  # "arithmetic" (synthetic, generated locally) | "gsm8k"
    # (manual_dir) | "scratchpad" | "jsonl" / "parquet" (your files: train_path, test_path)
    # | "hf" (a Hugging Face dataset: hf_path)
    c.data.config_name = "add3"  # builder config of the dataset ("" for none, e.g. gsm8k)
    c.data.data_dir = _placeholder(str)  # where TFDS writes the prepared dataset
    c.data.manual_dir = _placeholder(str)  # GSM8K: the directory with train.jsonl / test.jsonl
    # data.name="jsonl": your own prompts, one JSON object per line (gspo_jax/data/jsonl.py)
    c.data.train_path = _placeholder(str)  # the training split's JSONL file
    c.data.test_path = _placeholder(str)  # the held-out split's JSONL file
    c.data.prompt_key = "prompt"  # the field asked as the question
    c.data.answer_key = "answer"  # the field the reward compares with (the reference)
    # data.name="hf": a `datasets` save_to_disk directory, a directory of Parquet files, or a
    # Hub id in the Hugging Face cache (gspo_jax/data/tables.py); splits: train/eval_split
    c.data.hf_path = _placeholder(str)
    c.data.download = False  # let a Hub dataset missing from the cache be downloaded (opt-in)
    c.data.train_split = "train"
    c.data.eval_split = "test"
    c.data.system_prompt = _placeholder(str)  # optional system message of the chat template
    c.data.chat_template = "tokenizer"  # "tokenizer" (its own template) | "none" (plain
    # text, for base models) | a Jinja chat template or the path of a .jinja file
    c.data.enable_thinking = _placeholder(bool)  # Qwen3's switch, passed to the template
    # (None: the template's default)
    c.data.instruction = _placeholder(str)  # appended to every question; None: the dataset
    # pipeline's default ("Give the final answer after ####."), "" for none
    c.data.overlong = "error"  # prompts longer than prompt_length: "error" (start-up error
    # naming the count and an example) or "drop" (skip them, logged); never truncated

    # ------------------------------------------------------------------------------------
    # Rewards (host-side verifiers, see gspo_jax/rewards).
    # ------------------------------------------------------------------------------------
    c.reward = ml_collections.ConfigDict()
    c.reward.spec = "math"  # "name" or "name:weight,name:weight" from the reward registry
    c.reward.accuracy = "math"  # reward whose value (0/1) is reported as accuracy
    c.reward.timeout_s = 5.0  # per-call verifier timeout; a timeout scores 0 and is counted
    c.reward.num_workers = 2  # verifier worker processes (0: in-process, timeout by SIGALRM)
    c.reward.max_failed_rollouts = 3  # stop (with the verifier's error) after this many
    # rollouts in a row in which every reward call raised or returned a non-number / NaN:
    # they carry no reward signal (0: never stop)

    # ------------------------------------------------------------------------------------
    # Supervised warm start on the task itself: of a model trained from scratch, or with
    # on_checkpoint of model.hf_path's weights (e.g. an upcycled MoE's experts specialising).
    # ------------------------------------------------------------------------------------
    c.warm_start = ml_collections.ConfigDict()
    c.warm_start.steps = 0  # SFT steps before RL (0: off)
    c.warm_start.on_checkpoint = False  # also train model.hf_path's weights (else: scratch only)
    c.warm_start.cache = True  # reuse the warm start of an earlier run with the same model,
    # data, warm_start.* and seed (trainer/warm_cache.py); False: train it anew
    c.warm_start.cache_dir = _placeholder(str)  # None: warm_start_cache beside the workdir
    c.warm_start.batch_size = 64
    c.warm_start.learning_rate = 1e-3
    c.warm_start.teacher_error_rate = 0.0  # fraction of carrying additions the warm-start
    # teacher answers with the carries dropped (data/teacher.py); 0: a perfect teacher
    c.warm_start.target_accuracy = _placeholder(float)  # train to a target, not a step
    # count: stop at the first check whose greedy accuracy on the first check_prompts
    # train-split problems reaches it (None or 0: run `steps`); else go on past `steps` at the
    # final learning rate up to max_steps. The same start on any CPU type (README, "The
    # default run")
    c.warm_start.check_every = 100  # SFT steps between checks (with target_accuracy)
    c.warm_start.check_prompts = 200  # train-split problems a check scores
    c.warm_start.max_steps = _placeholder(int)  # give up (warn) here; None: `steps`

    # ------------------------------------------------------------------------------------
    # Evaluation, checkpoints, logging.
    # ------------------------------------------------------------------------------------
    c.eval = ml_collections.ConfigDict()
    c.eval.every_steps = 10  # greedy evaluation on the held-out split (0: only start and end)
    c.eval.num_prompts = 128  # held-out prompts per evaluation
    c.eval.batch_size = 64  # prompts per greedy sampling call
    c.eval.pass_k = 0  # k: also sample k responses per prompt at eval.temperature and log
    # eval/pass@1..pass@k (Chen et al. 2021's unbiased estimator) and eval/maj@k (majority
    # vote over the answers); 0: greedy accuracy only. Costs k x the greedy eval's tokens
    c.eval.temperature = 1.0  # sampling temperature of those k samples (> 0; no top-k / top-p)
    c.eval.num_samples = None  # deprecated: eval.pass_k's old name, read with a warning until
    # the next release (it read like G, the group size, which `sampling.sample` calls num_samples)
    c.eval.save_per_problem = False  # also write each greedy evaluation's per-problem score
    # (the accuracy reward) to WORKDIR/eval_problems/step<k>_p<process>.npz (paired statistics)

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every_steps = 50  # orbax checkpoint period in RL steps (0: only at the end);
    # a signal that ends the job (SIGTERM, SIGINT, SIGHUP, SIGUSR1, ...) also saves one at the
    # current step boundary (docs/failures.md)
    c.checkpoint.max_to_keep = 3  # the newest N are kept; a corrupt one falls back to the next
    c.checkpoint.async_save = True
    # Seconds one save may take (writing in the background included) before the run stops
    # with an error naming the directory: a filesystem that stops answering must not hang
    # the run. Far above a healthy save; raise it for a very large model on slow storage.
    c.checkpoint.save_timeout_s = 1800.0
    c.checkpoint.export_hf = True  # write the final policy with save_pretrained to workdir/hf

    c.log = ml_collections.ConfigDict()
    c.log.progress_bar = True  # tqdm bar with reward, accuracy, clip fraction, KL
    c.log.tensorboard = True  # TensorBoard event files in workdir/tb (no TensorFlow needed)
    c.log.plot = True  # workdir/curves.png at the end
    # RL steps (1-based) to trace with the JAX profiler into workdir/profile, e.g. (3, 4);
    # view with `tensorboard --logdir workdir/profile` (the profile plugin). Step 1 compiles.
    c.log.profile_steps = ()
    c.log.wandb_project = _placeholder(str)  # Weights & Biases project (None: no W&B); needs
    # `pip install wandb`. Run name: the workdir's name; run id kept in workdir/wandb_run_id
    c.log.wandb_entity = _placeholder(str)  # W&B team or user (None: your default entity)
    c.log.wandb_mode = "online"  # "online" | "offline" (sync later: `wandb sync`) | "disabled"
    return c
