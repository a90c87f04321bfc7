"""The report of experiments/gspo_vs_grpo/volatility.py: the finding in words, the table,
docs/results_moe_volatility.md, and the addendum the §5.3 verdict (analysis.py) cites."""

from __future__ import annotations

import json
import os

from experiments.gspo_vs_grpo.volatility import LEARN_MARGIN, PAPER, RESULTS, THRESHOLD

LOW_REWARD = 0.1  # below this control reward, `learns` is said to mean little


def finding(table: list[dict]) -> str:
    """In words: does any learning rate give >= THRESHOLD expert change while learning?"""
    live = [s for s in table if s["lr"] > 0]
    both = [s for s in live if s["expert_change"] >= THRESHOLD and s["learns"]]
    if both:
        lrs = ", ".join(f"{s['lr']:g}" for s in both)
        return (
            f"at lr {lrs} one update changes >= {THRESHOLD:.0%} of the activated experts "
            "while training still learns"
        )
    learning = [s for s in live if s["learns"]]
    text = f"no learning rate gives >= {THRESHOLD:.0%} expert change while training still learns"
    if learning:
        top = max(learning, key=lambda s: s["expert_change"])
        text += (
            f"; the most that still learns is {top['expert_change']:.2%} (range "
            f"{top['expert_change_min']:.2%}-{top['expert_change_max']:.2%} over n = {top['n']} "
            f"rollouts; lr {top['lr']:g}: "
            f"{top['clipfrac_range']:.1%} of token ratios out of the clip range, KL k3 "
            f"{top['kl_k3']:.1e}, mean abs Δ log π free vs replayed {top['gap_mean']:.1e})"
        )
    floor = table[0]["control_last_half"]
    if floor < LOW_REWARD:
        text += (
            f" (caveat: the lr-0 control's training reward is {floor:.3f}, too low for a few "
            "steps to show learning or collapse)"
        )
    high = [s for s in live if s["expert_change"] >= THRESHOLD]
    if high:
        lrs = ", ".join(f"{s['lr']:g}" for s in high)
        text += f"; >= {THRESHOLD:.0%} only at lr {lrs}, "
        text += "where the training reward falls below the lr-0 control"
    return text


def published_note(path: str | None = None) -> str:
    """The §5.3 verdict's addendum (analysis.py) from the published JSON ("" before it
    exists): the deeper MoE's GRPO finding, in words."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = path or os.path.join(root, RESULTS.replace(".md", ".json"))
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        result = json.load(f)
    sc, table = result["scale"], result["tables"]["grpo"]
    return (
        f"; a deeper MoE ({sc['num_layers']} layers, {sc['num_experts']} "
        f"experts top-{sc['top_k']}, load balancing; {RESULTS}), GRPO, one update from one "
        f"checkpoint, n = {table[0]['n']} rollouts per learning rate: {finding(table)}"
    )


def _table(table: list[dict]) -> list[str]:
    head = (
        "| lr | expert change, 1 update (min-max, n) | ours, pooled | clip frac. (binding) "
        "| ratio out of range | approx KL (step) | KL k3 | mean abs log ratio "
        "| abs Δ log π free vs replayed: mean | p99 | max | reward step 1 "
        "| reward, last half (lr-0 control) | expert change in RL (update 1) | learns (no collapse) |"
    )
    lines = [head, "|" + "---|" * 15]
    for s in table:
        lines.append(
            f"| {s['lr']:g} | {s['expert_change']:.2%} ({s['expert_change_min']:.2%}-"
            f"{s['expert_change_max']:.2%}, n = {s['n']}) | {s['expert_change_own']:.2%} "
            f"| {s['clipfrac']:.2e} | {s['clipfrac_range']:.2e} | {s['approx_kl']:.2e} "
            f"| {s['kl_k3']:.2e} | {s['abs_log_ratio']:.2e} "
            f"| {s['gap_mean']:.2e} | {s['gap_p99']:.2e} | {s['gap_max']:.2e} "
            f"| {s['reward_first']:.3f} | {s['reward_last_half']:.3f} "
            f"({s['control_last_half']:.3f}) | {s['rl_expert_change']:.2%} "
            f"| {'yes' if s['learns'] else 'no'} |"
        )
    return lines


def _same_first_update(result: dict) -> list[str]:
    """A paragraph when every algorithm's one-update expert change is the same (it should be:
    the first update is on-policy), else none."""
    tables = list(result["tables"].values())
    if len(tables) > 1 and all(
        [s["expert_change"] for s in t] == [s["expert_change"] for s in tables[0]] for t in tables
    ):
        return [
            (
                "The one-update columns (expert change, KL, abs Δ log π) are the same for every "
                "algorithm: the first update of a step is on-policy (every ratio 1, nothing "
                "clipped), where GRPO's token ratio and GSPO's sequence ratio give the same gradient "
                "(seq-mean-token-mean), so the matched update is one update, and this is a check. "
                "Their clip fractions differ (GSPO's range is 3e-4 / 4e-4, per sequence); the "
                "objectives part from the second update on, in the RL columns (one seed, "
                f"{result['scale']['rl_steps']} steps)."
            ),
            "",
        ]
    return []


def markdown(result: dict) -> str:
    """docs/results_moe_volatility.md from the result (`run`'s JSON)."""
    sc, sp = result["scale"], result["specialisation"]
    lines = [
        "# §5.3 expert volatility at a matched update size (MoE)",
        "",
        (
            "Generated by the command below (do not edit by hand: rerun it). Method: "
            "experiments/gspo_vs_grpo/volatility.py's docstring. The paper (arXiv 2507.18071 "
            f"§5.3): ~{PAPER:.0%} of the activated experts change after one update of a 48-layer, "
            "128-expert MoE under GRPO."
        ),
        "",
        "```",
        result["command"],
        "```",
        "",
        (
            f"- Model: {sc['num_layers']} layers, hidden {sc['hidden_size']}, {sc['num_experts']} "
            f"experts top-{sc['top_k']} (moe_impl={sc['moe_impl']}), each expert the dense MLP (width "
            f"{sc['intermediate_size']}) times 1 + {sc['noise']:g}·N(0, 1), upcycled from a dense "
            f"warm start (configs/default.py's task, to 30 % train accuracy, at most "
            f"{sc['warm_max_steps']} steps), then {sp['steps']} supervised steps of {sc['specialise_batch']} demonstrations of the MoE with "
            f"router_aux_loss_coef = {sc['router_aux_loss_coef']:g} (also on in RL); "
            f"{result['parameters'] / 1e6:.1f}M parameters."
        ),
        (
            f"- Specialisation (256 demonstrations): load entropy {sp['before']['load_entropy']:.3f} "
            f"-> {sp['after']['load_entropy']:.3f} (1: uniform), worst layer's max load "
            f"{sp['before']['max_load']:.2f} -> {sp['after']['max_load']:.2f} (x uniform), expert "
            f"spread {sp['before']['expert_spread']:.3f} -> {sp['after']['expert_spread']:.3f}."
        ),
        (
            f"- Per learning rate: one update from the specialised checkpoint on each of n = "
            f"{sc['measure_rollouts']} rollouts of {sc['prompts']} prompts x 8 responses (the same "
            "rollouts for every learning rate), read on the 3 mini-batches the update did not train "
            "on; then "
            f"{sc['rl_steps']} RL steps (4 updates each) from the same checkpoint on the same prompts "
            f"and sampling stream. `learns`: the training reward over the last half of those steps "
            f"is at least the lr-0 control's minus {LEARN_MARGIN}, and at least half of it."
        ),
        (
            f"- Wall time of this invocation: {result['seconds'] / 60:.0f} min on {result['machine']} "
            "(what the workdir held already, e.g. a cached warm start, was reused, not re-timed). "
            f"Code at commit `{result['commit']}`."
        ),
        "",
    ]
    for algo, table in result["tables"].items():
        lines += [f"## {algo.upper()}", "", f"**Finding: {finding(table)}.**", ""]
        lines += _table(table) + [""]
    lines += _same_first_update(result)
    lines += [
        (
            "Columns: expert change is the train step's `updates/expert_change` at updates 1-3 "
            "(weights after one update, rows it did not train on), the mean of the three "
            "updates' rates; *ours* recomputes it from the routing on the same rows and weights, "
            "pooled over the rows (a check); clip fraction (binding) and ratio out of range are "
            "the same updates' `updates/clipfrac` and `updates/clipfrac_range` (token ratios "
            "outside the clip range), approx KL (step) their `updates/approx_kl` (a k1 estimate: "
            "it can be negative); KL k3 (exp(d) − d − 1, d = log π_old − log π) and mean abs d "
            "are over the same rows' response tokens; abs Δ log π is per response token at the "
            "updated weights, the router's own choice against π_old's experts replayed (what "
            "Routing Replay changes); all averaged over the n rollouts. The RL column is "
            "`updates/expert_change/1` averaged over the RL steps; *learns* means the reward did "
            "not collapse (the rule above), not that it rose."
        ),
        "",
    ]
    return "\n".join(lines)
