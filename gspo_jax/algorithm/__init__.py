"""The paper's math in one folder: ratios and losses (`objectives`), advantages,
log-probs, pi_old and rollout correction (`old_policy`), masked reductions."""
