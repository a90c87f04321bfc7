"""python -m experiments.gspo_vs_grpo [flags] (see the package docstring, or --help)."""

from experiments.gspo_vs_grpo.cli import main

if __name__ == "__main__":
    main()
