"""GSPO vs GRPO at laptop scale: the paper's claims (arXiv 2507.18071 §5.2-§5.4) checked on
the synthetic task, with the command that regenerates docs/results.md.

  python -m experiments.gspo_vs_grpo                 # the published run's design; results
                                                     # in <workdir>/results.md
  python -m experiments.gspo_vs_grpo --publish       # ... written to docs/results.md
  python -m experiments.gspo_vs_grpo --steps=40 --seeds=2 --results=/tmp/r.md
  python -m experiments.gspo_vs_grpo --quick         # minutes: a smoke test (never publishes)
  python -m experiments.gspo_vs_grpo --arms=dense/gspo,dense/grpo --seeds=10 \
      --independent_warm_starts --steps=100 --eval_every=10 --eval_prompts=500
  python -m experiments.gspo_vs_grpo --task=scratchpad          # long responses (CPU scale)
  python -m experiments.gspo_vs_grpo --task=scratchpad --scale=gpu   # under jax[cuda]
  python -m experiments.gspo_vs_grpo --arms=dense/gspo,dense/grpo --dev \
      --vary num_mini_batches=1,2,4,8                  # a sweep (sweep.py), on a dev split

Tasks (--task): add2 is configs/default.py's (2-digit sums, 16-token answers, a 0.1M model);
scratchpad is configs/scratchpad.py's (long sums worked column by column: 32-125 response
tokens and a 0.8M model at --scale=cpu, 66-245 tokens and 2.9M at --scale=gpu), in
<workdir>/scratchpad_<scale>/, results in docs/results_scratchpad.md. --scale=gpu also sizes
the budget for one GPU (10 seeds with independent warm starts, 200 steps of 16 prompts).

Sweeps (--vary FIELD=V1,V2,..., repeatable and zipped): every chosen arm under every value,
with the same seeds and warm starts, and a report of its own (docs/sweeps/<field>.md):
the off-policy dose-response (num_mini_batches), learning rates per arm and GSPO's ε on a
dev split (--dev: train[500:] for training, train[:500] held out, the test split unread),
π_old from the sampler against recomputed (old_logprobs_source).

Arms (each from scratch, one run per seed, equal rollout budgets: every arm samples
num_steps x rollout_batch_size x G responses and splits each rollout into 4 mini-batches):

  moe/gspo      configs/moe_tiny.py algo=gspo                   (paper §5.3: no replay needed)
  moe/grpo_rr   configs/moe_tiny.py algo=grpo,routing_replay=true
  moe/grpo      configs/moe_tiny.py algo=grpo
  dense/gspo    configs/gspo_paper.py   (the default task and model)
  dense/grpo    configs/grpo_paper.py

Every run of a model starts from one warm start, exported as a Hugging Face checkpoint and
loaded through model.hf_path, as the paper's runs all start from one base model: seeds vary
the RL (sampling, data order), arms the algorithm. With --independent_warm_starts the warm
start becomes a factor the seeds vary too: seed k's runs (every arm) start from seed k's own
warm start, trained with seed k (initial weights, teacher noise, data order; the MoE's is
upcycled from it with seed k's noise and router), made once and cached in
<workdir>/warm_start_<model>_seed<k>/ as the shared one is in <workdir>/warm_start_<model>/;
a difference between arms then holds across base models, not for one. Dense:
configs/default.py's supervised warm start. MoE (--moe_testbed): "specialised" (the
default) upcycles that dense model to 16 experts, top-4 (each expert a copy of the dense MLP
with 10 % noise, see `upcycle`), then trains the MoE itself for 600 supervised steps so its
experts and router specialise (`specialise`, measured by specialisation.py); "copied" is
docs/results_moe.md's 8 experts, top-2, 1 % noise, untrained. The arms add their replay. A
noise-floor measurement (learning rate 0, bf16 vs f32, π_old recomputed by the train step /
taken from the sampler / from one whole-batch pass, the way π_old was computed before) is
written alongside, and the same measurement against response length (16, 64, 256, 1024
tokens: whether averaging the per-token gap over |y_i| brings s_i within ε).

Statistics (stats.py; the design is pre-registered in results_template.md's "Design"):
mean ± sample std (ddof = 1) over seeds; each claim's primary metric compared by a paired
bootstrap 95 % interval of GSPO − GRPO (runs paired by seed index; held-out accuracy also
by problem, from the per-problem scores every evaluation saves, eval.save_per_problem),
10,000 resamples from a fixed seed, with a two-sided p-value; the verdict is read off the
interval. --seeds sets n for every arm, --moe_seeds a smaller n for the three MoE arms.

Outputs: <workdir>/<model>_<arm>/seed<k>/ (each run's metrics.jsonl, curves.png,
TensorBoard, eval_problems/step<s>_p0.npz), <workdir>/summary.json, and --results (default
docs/results.md) with its plots next to it in results/.

Modules, by concern:

  arms.py      Arm, ARMS (+ FAMILY_ARMS: SAPO, CISPO, GMPO, LUSPO, DPPO, run when --arms
               names them), Budget, arm_config: what each arm runs, set up for one seed
  run.py       warm starts (upcycle, specialise), run_arm, noise_floor, the wall-time ledger
  specialisation.py  how specialised an MoE's experts are (spread, load entropy, max load)
  noise_length.py  the noise floor against response length (--noise_floor_lengths): s_i's
               spread and clipping at lr 0 for L = 16 ... 1024, full-length responses
  analysis.py  metrics.jsonl read back, arm_stats over seeds, verdicts per paper claim
  stats.py     mean / sample std, paired bootstrap intervals and p-values, verdict wording
  report.py    plot, write_results: results_template.md (+ noise_floor_template.md) filled
  sweep.py     --vary: variant arms, their runs' report (table, GSPO − GRPO, best value, plot)
  cli.py       main: the flags, the budget, a run, a sweep or --report_only
"""

from experiments.gspo_vs_grpo.analysis import arm_stats, pm, verdicts
from experiments.gspo_vs_grpo.arms import (
    ALL_ARMS,
    ARMS,
    EPS_GSPO,
    FAMILY_ARMS,
    MOE_TESTBEDS,
    PAPER_EXPERT_CHANGE,
    UPCYCLE_NOISE,
    Arm,
    Budget,
    arm_config,
)
from experiments.gspo_vs_grpo.cli import main
from experiments.gspo_vs_grpo.report import PLOTS, plot, write_results
from experiments.gspo_vs_grpo.run import noise_floor, run_arm, specialise, upcycle, warm_start

__all__ = [
    "ALL_ARMS",
    "ARMS",
    "EPS_GSPO",
    "FAMILY_ARMS",
    "MOE_TESTBEDS",
    "PAPER_EXPERT_CHANGE",
    "PLOTS",
    "UPCYCLE_NOISE",
    "Arm",
    "Budget",
    "arm_config",
    "arm_stats",
    "main",
    "noise_floor",
    "plot",
    "pm",
    "run_arm",
    "specialise",
    "upcycle",
    "verdicts",
    "warm_start",
    "write_results",
]
