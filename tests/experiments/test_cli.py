"""The experiment's command line: where the results go (nothing under docs/ unless asked)."""

import argparse
import os

import pytest

from experiments.gspo_vs_grpo import cli


def _args(**kw):
    base = {"results": None, "publish": False, "quick": False, "vary": None, "workdir": "/w"}
    return argparse.Namespace(**(base | kw))


def _budget(task="add2", dev=False):
    return argparse.Namespace(task=task, dev=dev)


def test_results_go_beside_the_runs_unless_published():
    assert cli.results_path(_args(), _budget()) == os.path.join("/w", "results.md")
    assert cli.results_path(_args(quick=True), _budget()) == os.path.join("/w", "results.md")
    assert cli.results_path(_args(publish=True), _budget()) == "docs/results.md"
    scratch = _args(publish=True, workdir="/w/scratchpad_cpu")
    assert cli.results_path(scratch, _budget("scratchpad")) == "docs/results_scratchpad.md"
    assert cli.results_path(_args(results="/r.md", publish=True), _budget()) == "/r.md"


def test_a_sweep_publishes_under_docs_sweeps_and_otherwise_stays_in_the_workdir():
    vary = ["num_mini_batches=1,2"]
    assert cli.results_path(_args(vary=vary), _budget(dev=True)) == os.path.join(
        "/w", "num_mini_batches_dev.md"
    )
    assert cli.results_path(_args(vary=vary, publish=True), _budget(dev=True)) == os.path.join(
        "docs", "sweeps", "num_mini_batches_dev.md"
    )


def test_quick_never_publishes():
    with pytest.raises(ValueError, match="--quick is a smoke test: it never publishes"):
        cli.results_path(_args(quick=True, publish=True), _budget())
