"""Config system: every default present, paper configs as the paper says, validate() errors."""

import importlib
import pathlib
import subprocess
import warnings

import pytest
from helpers import main_command

from configs import base, common, default, grpo_paper, gspo_paper
from gspo_jax import sampling
from gspo_jax.config import specs
from gspo_jax.config.specs import batch_sizes
from gspo_jax.config.validate import ConfigError, ConfigWarning, mesh_shape, validate

ROLL_FIELDS = (
    "adv_estimator",
    "importance_sampling",
    "rollout_batch_size",
    "num_return_sequences_in_group",
    "prompt_length",
    "response_length",
    "ppo_epochs",
    "use_kl_loss",
    "kl_loss_coef",
    "loss_agg_mode",
    "whiten_advantages",
    "advantage_clip",
    "dual_clip_loss",
    "reward_clip",
    "reward_norm",
    "reward_shift",
    "reward_scale",
    "add_token_level_kl",
)


def _validate_quietly(config, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        validate(config, **kwargs)


def test_base_has_roll_vocabulary_and_paper_knobs():
    c = base.get_config()
    for name in ROLL_FIELDS + (
        "clip_low",
        "clip_high",
        "dual_clip_ratio",
        "kl_estimator",
        "num_mini_batches",
        "micro_batch_size",
        "entropy_coef",
        "seed",
    ):
        assert name in c, name
    assert "learning_rate" in c.optim and "schedule" in c.optim


@pytest.mark.parametrize("module", [base, default, gspo_paper, grpo_paper])
def test_shipped_configs_validate_without_warnings(module):
    _validate_quietly(module.get_config(), num_devices=1)


def test_paper_configs_match_the_paper():
    gspo = gspo_paper.get_config()
    assert (gspo.importance_sampling, gspo.clip_low, gspo.clip_high) == ("seq", 3e-4, 4e-4)
    assert gspo.num_mini_batches == 4 and not gspo.use_kl_loss
    assert gspo.loss_agg_mode == "seq-mean-token-mean"
    grpo = grpo_paper.get_config()
    assert (grpo.importance_sampling, grpo.clip_low, grpo.clip_high) == ("token", 0.2, 0.27)
    assert grpo.num_mini_batches == 4 and not grpo.use_kl_loss


def test_paper_configs_take_a_checkpoint_and_gsm8k_as_arguments():
    c = gspo_paper.get_config("hf_path=/ckpt/qwen,manual_dir=/data/gsm8k")
    assert c.model.hf_path == "/ckpt/qwen" and c.data.manual_dir == "/data/gsm8k"
    assert c.data.name == "gsm8k" and c.importance_sampling == "seq"
    g = grpo_paper.get_config("hf_path=/m,manual_dir=/d,routing_replay=true")
    assert g.model.routing_replay is True
    with pytest.raises(ValueError, match="valid keys"):
        gspo_paper.get_config("hf=/typo")
    with pytest.raises(ValueError, match="manual_dir"):
        gspo_paper.get_config("hf_path=/ckpt")


def test_parse_arg_types():
    assert common.parse_arg("a=3,b=true,c=x", a=1, b=False, c="") == {"a": 3, "b": True, "c": "x"}
    with pytest.raises(ValueError, match="not a boolean"):
        common.parse_arg("b=maybe", b=False)


CONFIG_FILES = sorted(
    p for p in pathlib.Path("configs").glob("*.py") if "def get_config" in p.read_text()
)


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_every_config_refuses_an_argument_it_does_not_take(path):
    """configs/default.py and base.py dropped theirs: `default.py:hf_path=/x,manual_dir=/y`
    trained the scratch model without a word."""
    module = importlib.import_module(f"configs.{path.stem}")
    with pytest.raises(ValueError, match=r"bogus_key"):
        module.get_config("bogus_key=1")


@pytest.mark.parametrize("scale, digits, width", [("gpu", "pad4_10", 256), ("cpu", "pad2_6", 128)])
def test_the_scratchpad_config_at_each_scale(scale, digits, width):
    """Its response_length holds the longest worked solution of its task plus the end token
    (the warm start's overlong policy would refuse a longer one), for either algorithm."""
    from configs import scratchpad
    from gspo_jax import data

    for algo in ("gspo", "grpo"):
        c = scratchpad.get_config(f"algo={algo},scale={scale}")
        _validate_quietly(c)
        assert (c.data.name, c.data.config_name, c.model.hidden_size) == (
            "scratchpad",
            digits,
            width,
        )
        assert c.importance_sampling == ("seq" if algo == "gspo" else "token")
    config = next(x for x in data.SCRATCHPAD_CONFIGS if x.name == digits)
    n = config.max_digits
    longest = data.worked_solution(int("9" * n), int("9" * n))
    assert len(longest) + 1 <= c.response_length  # char-level tokens + <|im_end|>
    with pytest.raises(ValueError, match="scale='tpu' is not one of"):
        scratchpad.get_config("scale=tpu")


def test_main_names_the_config_file_and_the_argument_it_does_not_take(tmp_path):
    workdir = tmp_path / "run"
    proc = subprocess.run(
        main_command(workdir, config="configs/default.py:hf_path=/x,manual_dir=/y"),
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("gspo_jax: error: ")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert (
        "configs/default.py takes no config argument, got 'hf_path=/x,manual_dir=/y'" in (lines[0])
    )
    assert not workdir.exists()


@pytest.mark.parametrize(
    "train, held_out, warns",
    [
        ("train[500:]", "train[:500]", False),
        ("train", "train[:500]", True),
        ("train", "test", False),
    ],
)
def test_a_held_out_split_inside_the_training_split_warns(train, held_out, warns):
    """A dev split carved out of train is fine; one cut from the very split RL trains on
    would score training prompts as held out."""
    c = default.get_config()
    c.data.train_split, c.data.eval_split = train, held_out
    if warns:
        with pytest.warns(ConfigWarning, match=r"overlap: the held-out accuracy is measured"):
            validate(c)
    else:
        _validate_quietly(c)


def test_a_warm_up_longer_than_the_run_warns_naming_the_field():
    """It used to pass silently: the learning rate never reached its set value."""
    c = default.get_config()
    c.num_steps, c.ppo_epochs, c.num_mini_batches = 10, 1, 4
    c.optim.warmup_steps = 40  # exactly the run's 40 updates: reaches the peak at the end
    _validate_quietly(c)
    c.optim.warmup_steps = 41
    with pytest.warns(ConfigWarning, match=r"optim.warmup_steps=41 is longer than the run.*= 40"):
        validate(c)


@pytest.mark.parametrize("flag", ["--config.clip_hihg=0.1", "--config.optim.learnng_rate=1"])
def test_main_rejects_a_misspelt_config_flag(tmp_path, flag):
    """`python -m gspo_jax.main` loads the config locked: a typo is an error before anything
    runs (no workdir is created), never a silently new field."""
    workdir = tmp_path / "run"
    proc = subprocess.run(
        main_command(workdir, flag),
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert flag.split("=")[0].split(".")[-1] in proc.stderr
    assert not workdir.exists()


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("importance_sampling", "sequence", r"importance_sampling='sequence' is not one of \["),
        ("loss_agg_mode", "mean", "loss_agg_mode='mean' is not one of"),
        ("adv_estimator", "gae", "adv_estimator='gae'"),
        ("reward_norm", "global", "reward_norm='global'"),
        ("kl_estimator", "k4", "kl_estimator='k4'"),
        ("old_logprobs_source", "vllm", "old_logprobs_source='vllm'"),
    ],
)
def test_unknown_mode_names_list_the_valid_ones(field, value, match):
    c = base.get_config()
    c[field] = value
    with pytest.raises(ConfigError, match=match) as err:
        validate(c)
    assert "[" in str(err.value)  # the list of valid values follows


def test_unknown_mode_error_lists_valid_modes():
    c = base.get_config()
    c.importance_sampling = "bogus"
    with pytest.raises(ConfigError) as err:
        validate(c)
    for mode in ("token", "seq", "seq_token"):
        assert repr(mode) in str(err.value)


def test_reward_norm_none_spellings():
    for spelling in (None, "none", "None", "null"):
        c = base.get_config()
        c.reward_norm = spelling
        _validate_quietly(c)


def test_rollout_not_divisible_into_mini_batches_names_the_numbers():
    c = base.get_config()
    c.rollout_batch_size, c.num_return_sequences_in_group, c.num_mini_batches = 5, 3, 4
    with pytest.raises(
        ConfigError, match=r"5 x 3 = 15 responses do not split into num_mini_batches=4"
    ):
        validate(c)


def test_mini_batch_not_divisible_into_micro_batches_names_the_numbers():
    c = base.get_config()  # 8 x 8 = 64 responses, 4 mini-batches of 16
    c.micro_batch_size = 6
    with pytest.raises(
        ConfigError, match=r"64 / 4 = 16 responses does not split into micro_batch_size=6"
    ):
        validate(c)


def test_micro_batch_not_divisible_over_devices():
    c = base.get_config()
    c.micro_batch_size = 4
    with pytest.raises(ConfigError, match=r"micro-batch of 4 responses does not split over the 8"):
        validate(c, num_devices=8)
    validate(c, num_devices=4)


def test_prompts_must_split_over_processes():
    c = base.get_config()
    c.rollout_batch_size = 6
    c.num_mini_batches = 2
    with pytest.raises(ConfigError, match="rollout_batch_size=6 prompts do not split over 4"):
        validate(c, num_processes=4)


def test_group_normalisation_needs_a_group():
    c = base.get_config()
    c.num_return_sequences_in_group = 1
    c.num_mini_batches = 1
    with pytest.raises(ConfigError, match="adv_estimator='grpo'.*>= 2"):
        validate(c)
    c.adv_estimator = "reinforce"
    c.reward_norm = "group"
    with pytest.raises(ConfigError, match="reward_norm='group' needs"):
        validate(c)
    c.reward_norm = "batch"
    _validate_quietly(c)


def test_non_positive_sizes_are_errors():
    c = base.get_config()
    c.ppo_epochs = 0
    with pytest.raises(ConfigError, match="ppo_epochs=0 must be a positive integer"):
        validate(c)


def test_gspo_with_grpo_sized_clip_warns_citing_the_paper():
    c = base.get_config()
    c.clip_low, c.clip_high = 0.2, 0.27
    with pytest.warns(ConfigWarning, match=r"3e-4.*4e-4"):
        validate(c)
    c.importance_sampling = "token"  # GRPO with GRPO's range: no warning
    _validate_quietly(c)


@pytest.mark.parametrize(
    "importance_sampling,mode",
    [("seq", "seq-mean-token-sum-norm"), ("seq_token", "seq-mean-token-sum")],
)
def test_gspo_with_token_sum_aggregation_warns_naming_luspo(importance_sampling, mode):
    c = base.get_config()
    c.importance_sampling, c.loss_agg_mode = importance_sampling, mode
    with pytest.warns(ConfigWarning, match=r"seq-mean-token-mean.*LUSPO.*configs/luspo.py"):
        validate(c)


def test_luspo_is_asked_for_by_name_and_does_not_warn():
    """seq + seq-mean-token-sum is LUSPO (length-unbiased GSPO): a method, not a mistake."""
    c = base.get_config()
    c.importance_sampling, c.loss_agg_mode = "seq", "seq-mean-token-sum"
    _validate_quietly(c)


@pytest.mark.parametrize(
    "fields,match",
    [
        ({"loss_mode": "ppo"}, r"config.loss_mode='ppo' is not one of \[.*'sapo'"),
        ({"loss_mode": "sapo", "sapo_tau_pos": 0.0}, r"config.sapo_tau_pos=0.0 must be"),
        ({"loss_mode": "sapo", "sapo_tau_neg": -1.0}, r"config.sapo_tau_neg=-1.0 must be"),
        ({"loss_mode": "cispo", "clip_high": 0.0}, r"config.clip_high=0.0: loss_mode='cispo'"),
        ({"dppo_max_weight": 0.0}, r"config.dppo_max_weight=0.0 must be"),
        (
            {"loss_mode": "gmpo", "importance_sampling": "seq"},
            r"config.loss_mode='gmpo' needs token log-ratios, but config.importance_sampling='seq'",
        ),
        (
            {"opsm_delta": 1e-4, "sampling.temperature": 0.0},
            r"config.opsm_delta=0.0001 reads the sampler's log-probs",
        ),
        ({"opsm_delta": -1.0}, r"config.opsm_delta=-1.0 must be"),
        ({"loss_mode": "sapo", "dual_clip_loss": True}, r"dual_clip_loss=True applies to"),
        (
            {"adv_estimator": "rloo", "num_return_sequences_in_group": 1},
            r"adv_estimator='rloo'.*num_return_sequences_in_group >= 2 \(got 1\)",
        ),
    ],
)
def test_bad_loss_mode_settings_are_one_line_errors_naming_the_field(fields, match):
    c = base.get_config()
    c.num_mini_batches = 1
    for field, value in fields.items():
        *parents, leaf = field.split(".")
        node = c
        for p in parents:
            node = node[p]
        node[leaf] = value
    with pytest.raises(ConfigError, match=match) as info:
        validate(c)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "field,value,switch,on",
    [
        ("sapo_tau_pos", 2.0, "loss_mode", "sapo"),
        ("dppo_delta_high", 0.05, "loss_mode", "dppo_kl"),
        ("norm_adv_by_std_in_grpo", False, "adv_estimator", "grpo"),
    ],
)
def test_a_loss_mode_option_without_its_mode_warns(field, value, switch, on):
    c = base.get_config()
    c[field] = value
    if switch == "adv_estimator":
        c.adv_estimator = "reinforce"
    with pytest.warns(ConfigWarning, match=rf"config.{field}=.* has no effect"):
        validate(c)
    c[switch] = on
    _validate_quietly(c)


def test_sampler_logprobs_with_filtering_warns_and_greedy_fails():
    c = base.get_config()
    c.old_logprobs_source = "sampler"
    c.sampling.top_k = 20
    with pytest.warns(sampling.BiasedPiOldWarning, match="biased"):
        validate(c)
    c.sampling.top_k = None
    c.sampling.temperature = 0.0
    with pytest.raises(ConfigError, match="temperature > 0"):
        validate(c)


def test_ranges():
    c = base.get_config()
    c.dual_clip_loss = True
    c.dual_clip_ratio = 0.5
    with pytest.raises(ConfigError, match="dual_clip_ratio=0.5 must be a finite number > 1"):
        validate(c)
    c = base.get_config()
    c.advantage_clip = -1.0
    with pytest.raises(
        ConfigError, match=r"advantage_clip=-1.0 must be a finite number > 0 \(or None\)"
    ):
        validate(c)
    c = base.get_config()
    c.data.name, c.data.config_name = "gsm8k", ""
    with pytest.raises(ConfigError, match="manual_dir"):
        validate(c)


def test_mesh_shape_resolution():
    c = base.get_config()
    assert mesh_shape(c, 8) == {"data": 8, "fsdp": 1, "tensor": 1, "expert": 1}
    c.mesh.tensor = 2
    assert mesh_shape(c, 8)["data"] == 4
    c.mesh.tensor = 3
    with pytest.raises(ConfigError, match="mesh.data"):
        mesh_shape(c, 8)
    c.mesh.tensor, c.mesh.fsdp = 2, -1
    with pytest.raises(ConfigError, match="only one mesh axis may be -1"):
        mesh_shape(c, 8)
    # multi-slice: the axes describe one slice, data is per slice times the slices
    c = base.get_config()
    c.mesh.dcn_data, c.mesh.fsdp = 2, 2
    assert mesh_shape(c, 8) == {"data": 4, "fsdp": 2, "tensor": 1, "expert": 1}
    c.mesh.dcn_data = 3
    with pytest.raises(ConfigError, match=r"mesh.dcn_data=3 does not divide the 8 devices"):
        mesh_shape(c, 8)
    c.mesh.dcn_data = 0
    with pytest.raises(ConfigError, match=r"mesh.dcn_data=0 must be a positive int"):
        mesh_shape(c, 8)


def test_batch_sizes():
    c = base.get_config()
    c.micro_batch_size = 4
    assert batch_sizes(c) == {"responses": 64, "mini_batch": 16, "micro_batch": 4}


def test_qwen3_gsm8k_config_needs_its_arguments_and_validates(tmp_path):
    from configs import qwen3_0p6b_gsm8k

    with pytest.raises(ValueError, match="hf_path=DIR,manual_dir=DIR"):
        qwen3_0p6b_gsm8k.get_config()
    for split in ("train", "test"):  # different problems: a copy would warn (overlap)
        (tmp_path / f"{split}.jsonl").write_text(f'{{"question": "{split}", "answer": "#### 1"}}\n')
    c = qwen3_0p6b_gsm8k.get_config(f"hf_path=tests/fixtures/models/qwen3,manual_dir={tmp_path}")
    assert (c.importance_sampling, c.clip_low, c.clip_high) == ("seq", 3e-4, 4e-4)
    assert c.model.dtype == "bfloat16" and c.data.name == "gsm8k"
    _validate_quietly(c, num_devices=8)


def test_multi_process_prompt_batches_must_split_over_devices():
    c = base.get_config()  # 8 prompts
    c.eval.batch_size = 64
    validate(c, num_devices=8, num_processes=2)
    c.rollout_batch_size, c.num_mini_batches = 4, 2
    with pytest.raises(ConfigError, match="rollout_batch_size=4 prompts do not split over the 8"):
        validate(c, num_devices=8, num_processes=2)
    validate(c, num_devices=8, num_processes=1)  # one process replicates small prompt batches


# ------------------------------------------------------------------ issue 12: nothing silent


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("optim.learning_rate", float("nan"), r"learning_rate=nan must be a finite number >= 0"),
        ("optim.learning_rate", -1e-6, r"learning_rate=-1e-06 must be a finite number >= 0"),
        ("optim.max_grad_norm", -1.0, r"max_grad_norm=-1.0 must be a finite number > 0"),
        ("optim.max_grad_norm", float("nan"), r"max_grad_norm=nan"),
        ("optim.b2", 1.5, r"optim.b2=1.5 must be a finite number in \[0, 1\)"),
        ("optim.b1", -0.1, r"optim.b1=-0.1"),
        ("optim.eps", 0.0, r"optim.eps=0.0 must be a finite number > 0"),
        ("optim.warmup_steps", -5, r"warmup_steps=-5 must be a non-negative integer"),
        ("optim.end_lr_ratio", 2.0, r"end_lr_ratio=2.0 must be a finite number in \[0, 1\]"),
        ("optim.weight_decay", float("inf"), r"weight_decay=inf"),
        ("checkpoint.max_to_keep", 0, r"max_to_keep=0 must be a positive integer"),
        ("checkpoint.every_steps", -5, r"checkpoint.every_steps=-5 must be a non-negative"),
        ("checkpoint.save_timeout_s", 0.0, r"save_timeout_s=0.0 must be a finite number > 0"),
        ("checkpoint.save_timeout_s", float("inf"), r"checkpoint.save_timeout_s=inf"),
        ("eval.num_prompts", 0, r"eval.num_prompts=0 must be a positive integer"),
        ("eval.batch_size", 0, r"eval.batch_size=0 must be a positive integer"),
        ("eval.every_steps", -1, r"eval.every_steps=-1"),
        ("reward.num_workers", -1, r"reward.num_workers=-1 must be a non-negative integer"),
        ("reward.timeout_s", 0.0, r"reward.timeout_s=0.0 must be a finite number > 0"),
        ("reward.max_failed_rollouts", -1, r"max_failed_rollouts=-1 must be a non-negative"),
        ("max_all_skipped_steps", -1, r"max_all_skipped_steps=-1 must be a non-negative"),
        ("logprob_chunk_size", 0, r"logprob_chunk_size=0 must be a positive integer"),
        ("clip_high", float("inf"), r"clip_high=inf"),
        ("sampling.temperature", float("nan"), r"temperature=nan"),
        ("seed", -1, r"seed=-1"),
        ("warm_start.teacher_error_rate", 1.5, r"teacher_error_rate=1.5"),
        ("warm_start.learning_rate", 0.0, r"warm_start.learning_rate=0.0"),
        ("warm_start.target_accuracy", 1.5, r"target_accuracy=1.5 must be a finite number in"),
        ("warm_start.target_accuracy", float("nan"), r"warm_start.target_accuracy=nan"),
        ("warm_start.check_every", 0, r"warm_start.check_every=0 must be a positive integer"),
        ("warm_start.max_steps", 1000, r"warm_start.max_steps=1000 must be an integer >= 1200"),
        ("kl_loss_coef", float("nan"), r"kl_loss_coef=nan"),
        ("sampling.prompt_buckets", (32, 0), r"prompt_buckets=\(32, 0\)"),
        ("sampling.engine", "fast", r"sampling.engine='fast' is not one of"),
        ("sampling.kv_dtype", "fp8", r"sampling.kv_dtype='fp8' is not one of"),
        ("sampling.num_slots", 0, r"sampling.num_slots=0 must be a positive integer"),
        ("sampling.page_size", 0, r"sampling.page_size=0 must be a positive integer"),
        ("sampling.kv_budget_tokens", 16, r"kv_budget_tokens=16 holds 1 pages of sampling.page"),
        ("data.overlong", "truncate", r"data.overlong='truncate' is not one of"),
        ("data.config_name", "add9", r"data.config_name='add9' is not one of"),
        ("model.head_dim", 15, r"config.model.head_dim=15"),
        ("model.intermediate_size", 0, r"model.intermediate_size=0 must be a positive integer"),
    ],
)
def test_values_that_cannot_be_meant_are_named_errors(field, value, match):
    """NaN, non-positive and out-of-range numbers used to be accepted (a NaN learning rate
    trained to an all-NaN export; max_to_keep=0 left no checkpoint) or silently turned
    into something else (a negative warm-up, eval.batch_size=0)."""
    c = default.get_config()
    *parents, leaf = field.split(".")
    node = c
    for p in parents:
        node = node[p]
    with c.unlocked():
        node[leaf] = value
    with pytest.raises(ConfigError, match=match):
        validate(c)


def test_int8_kv_with_the_static_engine_names_the_engine():
    """int8 KV pages exist only in the continuous engine: the static one is refused at
    start-up (its float kv_dtype choices are accepted)."""
    c = default.get_config()
    c.sampling.engine = "static"
    c.sampling.kv_dtype = "bfloat16"
    validate(c)
    c.sampling.kv_dtype = "int8"
    with pytest.raises(ConfigError, match=r'kv_dtype="int8" needs sampling.engine="continuous"'):
        validate(c)
    c.sampling.engine = "continuous"
    validate(c)
    assert specs.sampler_spec(c).kv_dtype == "int8"


@pytest.mark.parametrize(
    "field,value", [("num_slots", 4), ("page_size", 8), ("kv_budget_tokens", 512)]
)
def test_a_continuous_engine_option_with_the_static_engine_warns(field, value):
    """sampling.num_slots / page_size / kv_budget_tokens only shape the continuous engine's
    decode; with the static engine they were ignored without a word."""
    c = base.get_config()
    c.sampling.engine = "static"
    c.sampling[field] = value
    with pytest.warns(
        ConfigWarning, match=rf'config.sampling.{field}={value} has no effect.*engine="continuous"'
    ):
        validate(c)
    c.sampling.engine = "continuous"
    _validate_quietly(c)


@pytest.mark.parametrize(
    "field,value,switch",
    [
        ("kl_loss_coef", 0.5, "use_kl_loss"),
        ("token_level_kl_coef", 0.1, "add_token_level_kl"),
        ("reward_shift", True, "reward_norm"),
        ("reward_scale", True, "reward_norm"),
        ("dual_clip_ratio", 5.0, "dual_clip_loss"),
        ("kl_estimator", "k1", "use_kl_loss"),
    ],
)
def test_an_option_without_its_switch_warns(field, value, switch):
    """Ignored without a word before; the reverse case (switch on, coefficient 0) warned."""
    c = base.get_config()
    c[field] = value
    with pytest.warns(ConfigWarning, match=rf"config.{field}=.* has no effect.*{switch}"):
        validate(c)
    c = base.get_config()  # with the switch on: no warning about it
    c[field] = value
    c[switch] = True if switch != "reward_norm" else "batch"
    if field == "kl_estimator":
        c.kl_loss_coef = 0.1
    _validate_quietly(c)


@pytest.mark.parametrize(
    "field,value,switch,on",
    [
        ("eval.temperature", 0.5, "eval.pass_k", 4),
        ("model.lora_alpha", 8.0, "model.lora_rank", 8),
        ("model.lora_targets", "q_proj,v_proj", "model.lora_rank", 8),
        ("log.wandb_entity", "team", "log.wandb_project", "demo"),
        ("log.wandb_mode", "offline", "log.wandb_project", "demo"),
    ],
)
def test_an_eval_lora_or_wandb_option_without_its_switch_warns(field, value, switch, on):
    """eval.temperature without eval.pass_k, model.lora_alpha / lora_targets without
    model.lora_rank, log.wandb_entity / wandb_mode without log.wandb_project: ignored
    without a word before, as the DAPO and correction options are not."""
    if switch == "log.wandb_project":
        pytest.importorskip("wandb")  # a project without wandb installed is an error
    c = base.get_config()
    section, leaf = field.split(".")
    c[section][leaf] = value
    with pytest.warns(ConfigWarning, match=rf"config.{field}=.* has no effect.*{switch}"):
        validate(c)
    c[switch.split(".")[0]][switch.split(".")[1]] = on  # the switch on: no warning
    _validate_quietly(c)


def test_greedy_rollouts_warn():
    c = base.get_config()
    c.sampling.temperature = 0.0
    with pytest.warns(ConfigWarning, match=r"the 8 responses of a prompt are identical"):
        validate(c)


def test_reward_specs_are_checked_at_start_up():
    c = base.get_config()
    c.reward.spec = "math:1.0,no_such_reward:0.1"
    with pytest.raises(ConfigError, match=r"config.reward.spec: unknown reward 'no_such_reward'"):
        validate(c)
    c = base.get_config()
    c.reward.accuracy = "nope"
    with pytest.raises(ConfigError, match=r"config.reward.accuracy: unknown reward 'nope'"):
        validate(c)


def test_a_reward_registered_in_the_config_file_is_an_error_with_workers():
    """A config file's module cannot be imported by name in a worker process: that used to
    fail at the first rollout, after the data build and the warm start."""
    import types

    from gspo_jax.rewards import registry

    fn = types.FunctionType((lambda p, c, r: 1.0).__code__, {}, "cfg_reward")
    fn.__module__ = "config_config"  # what ml_collections names a loaded config file
    registry.register_reward("test_cfg_file_reward")(fn)
    try:
        c = base.get_config()
        c.reward.spec = "test_cfg_file_reward"
        with pytest.raises(ConfigError, match=r"module 'config_config'.*num_workers=0"):
            validate(c)
        c.reward.num_workers = 0  # in-process scoring: any registered callable works
        _validate_quietly(c)
    finally:
        registry.REWARDS.remove("test_cfg_file_reward")


def test_missing_paths_name_their_field(tmp_path):
    c = base.get_config()
    c.model.hf_path = str(tmp_path / "missing")
    with pytest.raises(ConfigError, match=r"config.model.hf_path='.*missing' does not exist"):
        validate(c)
    c.model.hf_path = str(tmp_path)  # a directory, but not a checkpoint
    with pytest.raises(ConfigError, match=r"config.model.hf_path=.* has no config.json"):
        validate(c)
    c = base.get_config()
    c.model.tokenizer_path = str(tmp_path / "tok")
    with pytest.raises(ConfigError, match=r"config.model.tokenizer_path=.* does not exist"):
        validate(c)
    c = base.get_config()
    c.data.name, c.data.config_name, c.data.manual_dir = "gsm8k", "", str(tmp_path)
    (tmp_path / "train.jsonl").write_text("")
    (tmp_path / "test.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n')
    with pytest.raises(ConfigError, match=r"manual_dir=.*empty: .*train.jsonl"):
        validate(c)


def test_a_tokenizer_larger_than_the_model_vocabulary_is_an_error(tmp_path):
    """Ids >= vocab_size have no embedding row: NaN log-probs, every update skipped, exit 0
    (before). Checked when the model config is read, before any data or weights."""
    from gspo_jax import data, models
    from gspo_jax.config.validate import check_model_against_tokenizer

    cfg = models.ModelConfig.from_hf_config(models.read_hf_config("tests/fixtures/models/qwen3"))
    tokenizer = data.make_char_tokenizer(tmp_path / "tok")
    c = base.get_config()
    c.model.hf_path = "tests/fixtures/models/qwen3"
    c.prompt_length = c.response_length = 64
    check_model_against_tokenizer(c, cfg, tokenizer)  # 100 ids in a 256-word model: fine
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(200)])
    with pytest.raises(ConfigError, match=r"token ids up to 299.*vocab_size=256"):
        check_model_against_tokenizer(c, cfg, tokenizer)
    c.prompt_length = cfg.max_position_embeddings
    small = data.make_char_tokenizer(tmp_path / "tok2")
    with pytest.raises(ConfigError, match=r"exceeds the .*max_position_embeddings"):
        check_model_against_tokenizer(c, cfg, small)


@pytest.mark.parametrize("hf", [False, True])
def test_model_config_carries_every_numerics_field(hf, tmp_path):
    """config.model.{param_dtype, dtype, remat, moe_impl, attention_impl, scan_layers, lora_*} reach
    the model (scan_layers=False differs from ModelConfig's default),
    from scratch and from a checkpoint (the scratch path once dropped attention_impl)."""
    from gspo_jax import data
    from gspo_jax.config import specs

    c = default.get_config()
    if hf:
        c.model.hf_path = "tests/fixtures/models/qwen3"
    c.model.update(
        param_dtype="bfloat16", dtype="bfloat16", remat="dots", moe_impl="dense",
        attention_impl="splash", scan_layers=False,
        lora_rank=4, lora_alpha=8.0, lora_targets="q_proj, v_proj",
    )  # fmt: skip
    cfg = specs.model_config(c, None if hf else data.make_char_tokenizer(str(tmp_path)))
    got = {k: getattr(cfg, k) for k in specs.model_numerics(c, cfg.num_layers)}
    assert got == {
        "param_dtype": "bfloat16",
        "dtype": "bfloat16",
        "remat": "dots",
        "moe_impl": "dense",
        "attention_impl": "splash",
        "scan_layers": False,
        "lora_rank": 4,
        "lora_alpha": 8.0,
        "lora_targets": ("q_proj", "v_proj"),
    }


def test_real_models_scan_their_layers_whatever_the_tiny_default_says(tmp_path):
    """configs/default.py's scan_layers=None: its 3-layer scratch model unrolled, a
    --preset's or a checkpoint's 28-layer architecture scanned; True / False still decide."""
    import json

    from gspo_jax import data
    from gspo_jax.config import specs
    from tools import aot

    c = gspo_paper.get_config()  # the tiny default underneath, as the documented aot command
    assert c.model.scan_layers is None
    validate(c, num_devices=1, num_processes=1)
    assert specs.model_config(c, data.make_char_tokenizer(str(tmp_path))).scan_layers is False
    assert {aot.model_config_for(c, p).scan_layers for p in aot.PRESETS} == {True}
    (tmp_path / "config.json").write_text(json.dumps(aot.PRESETS["Qwen3-0.6B"]))
    c.model.hf_path = str(tmp_path)
    assert specs.model_config(c, None).scan_layers is True
    c.model.scan_layers = False  # an explicit choice holds for any model
    assert specs.model_config(c, None).scan_layers is False
    assert aot.model_config_for(c, "Qwen3-8B").scan_layers is False
    assert base.get_config().model.scan_layers is True


def test_eval_save_per_problem_must_be_a_bool():
    c = base.get_config()
    with c.ignore_type():  # a config built without ml_collections' type check
        c.eval.save_per_problem = "yes"
    with pytest.raises(ConfigError, match=r"eval.save_per_problem='yes' must be True or False"):
        validate(c)


def test_a_warm_start_of_a_checkpoint_needs_on_checkpoint():
    """warm_start.steps with model.hf_path is ignored (and said) unless
    warm_start.on_checkpoint; on_checkpoint without a checkpoint says it does nothing. With
    both set the spec keeps the steps, and without on_checkpoint it has none."""
    from gspo_jax.config import specs

    c = base.get_config()
    c.model.hf_path = "tests/fixtures/models/qwen3"
    c.warm_start.steps = 5
    with pytest.warns(
        ConfigWarning, match=r"config.warm_start.steps=5 has no effect.*on_checkpoint"
    ):
        validate(c)
    assert specs._warm_start_spec(c).steps == 0
    c.warm_start.on_checkpoint = True
    _validate_quietly(c)
    assert specs._warm_start_spec(c).steps == 5
    c = base.get_config()
    c.warm_start.on_checkpoint = True
    with pytest.warns(
        ConfigWarning, match=r"config.warm_start.on_checkpoint=True has no effect.*model.hf_path"
    ):
        validate(c)
