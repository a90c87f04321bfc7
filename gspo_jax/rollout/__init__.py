"""The rollout stage: sample -> score -> filter (DAPO) -> advantages -> a Rollout."""
