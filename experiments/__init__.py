"""Experiments that regenerate the project's published results (docs/results.md)."""
