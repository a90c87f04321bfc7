"""Run orchestration: the only code that reads the experiment ConfigDict.

config.py      validate(config): every field checked at start-up, one line naming it
setup.py       setup(config, workdir) -> Run: every fixed piece of a run, built once
loop.py        run(config, workdir): the RL loop (rollout -> train step), evaluation,
               checkpoints, export
rollout.py     collect(...): sample, score, π_ref, advantages -> the train batch
state.py       RunState: everything that changes, saved and restored as one
checkpoint.py  orbax save / restore of a RunState; Hugging Face export
workdir.py     the workdir's checks and run lock; config.json and a restart's config diff
preemption.py  SIGTERM / SIGINT / SIGHUP / SIGUSR1 ... -> a checkpoint at the next step boundary
evaluation.py  greedy held-out accuracy
warm_start.py  the supervised warm start of a scratch model
writers.py     metrics.jsonl, TensorBoard, curves.png
"""
