"""Issue 42 (reliability, round three): the experiment's command line accepts only what it
knows (experiments/gspo_vs_grpo/cli.py; docs/failures.md)."""

import pytest

from experiments import gspo_vs_grpo
from experiments.gspo_vs_grpo import arms, sweep


def test_an_unknown_arm_is_named_with_the_valid_ones(tmp_path):
    # It was dropped while another name matched: dense/gspo alone ran.
    with pytest.raises(ValueError, match=r"unknown arm\(s\) \['dense/gpso'\]; the arms are"):
        gspo_vs_grpo.main(["--arms=dense/grpo,dense/gpso", f"--workdir={tmp_path}"])
    with pytest.raises(ValueError, match=r"unknown arm\(s\) \[''\]"):  # a stray comma
        gspo_vs_grpo.main(["--arms=dense/grpo,", f"--workdir={tmp_path}"])


def test_an_abbreviated_flag_is_refused(tmp_path, capsys):
    # argparse took --step for --steps and --seed for --seeds.
    with pytest.raises(SystemExit) as stopped:
        gspo_vs_grpo.main(["--step=3", f"--workdir={tmp_path}", "--report_only"])
    assert stopped.value.code == 2 and "--step=3" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags",
    [
        ["--report_only", "--noise_floor_only"],
        ["--vary=clip_low=1e-4,3e-4", "--noise_floor_only"],
        ["--no_noise_floor", "--noise_floor_only"],
        ["--quick", "--eval_every=5"],
    ],
)
def test_conflicting_flags_are_refused(tmp_path, flags):
    with pytest.raises(ValueError, match="cannot be used together"):
        gspo_vs_grpo.main([*flags, f"--workdir={tmp_path}"])


def test_an_unknown_varied_field_names_the_near_ones(tmp_path):
    (setting,) = sweep.parse_vary(["clip_lwo=1e-4"])
    arm = next(a for a in arms.ARMS if a.key == "dense/gspo")
    budget = gspo_vs_grpo.cli._budget(gspo_vs_grpo.cli._parser().parse_args(["--quick"]))
    with pytest.raises(ValueError, match=r"no field 'clip_lwo'; did you mean clip_low"):
        sweep.variants([arm], [setting], budget, str(tmp_path))
