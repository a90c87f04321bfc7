"""The loop and its I/O: setup (the run's fixed pieces, built once), the RL loop, the run
state, evaluation, the warm start, signals, and io/ (checkpoints, workdir, writers).

Each module's docstring says what it does; docs/architecture.md is the map.
"""
