"""Issue 42 (reliability, round three): a sampling call that cannot fit fails at start-up
naming the field, and a later out-of-memory error names the fields too (docs/failures.md)."""

import pytest

from configs import default
from gspo_jax.config.validate import ConfigError
from gspo_jax.trainer import memory
from gspo_jax.trainer.setup import setup


def test_a_held_out_sampling_that_cannot_fit_fails_at_start_up_naming_the_field(tmp_path):
    # 10^7 samples per prompt used to reach XLA's "Error dispatching computation" after the
    # model load, the warm start and the first evaluation's compile.
    c = default.get_config()
    c.eval.pass_k = 10**7
    c.data.data_dir = str(tmp_path / "data")
    with pytest.raises(ConfigError, match=r"config.eval.pass_k: .* GiB per device"):
        setup(c, str(tmp_path / "run"))
    assert not (tmp_path / "data").exists()  # before the data is built


def test_an_out_of_memory_error_later_names_the_fields():
    class XlaRuntimeError(RuntimeError):
        pass

    evaluation = memory.name_the_field("the held-out evaluation", "eval.pass_k")
    oom = r"the held-out evaluation ran out of memory .* lower eval.pass_k"
    with pytest.raises(MemoryError, match=oom), evaluation:
        raise XlaRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")
    evaluation = memory.name_the_field("the held-out evaluation", "eval.pass_k")
    with pytest.raises(ValueError, match="unrelated"), evaluation:  # others pass unchanged
        raise ValueError("unrelated")
