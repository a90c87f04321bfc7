"""config.imports: the user's modules imported at start-up, before the config is checked."""

import sys
import textwrap

import pytest

from configs import default
from gspo_jax.config import imports
from gspo_jax.config.validate import ConfigError, validate
from gspo_jax.rewards import registry


def _write(path, text):
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_a_file_outside_the_repo_registers_a_reward_the_same_config_can_use(tmp_path):
    f = _write(
        tmp_path / "imports_test_rewards_a.py",
        """
        import gspo_jax.rewards

        @gspo_jax.rewards.register_reward("imports_test_reward_a")
        def reward(prompt, completion, reference):
            return float(reference in completion)
        """,
    )
    c = default.get_config()
    c.imports, c.reward.spec = f, "imports_test_reward_a"
    try:
        validate(c)  # workers (num_workers > 0) import it by name from the file's folder
        assert str(tmp_path) in sys.path
        assert registry.build_reward("imports_test_reward_a").modules == ("imports_test_rewards_a",)
    finally:
        registry.REWARDS.remove("imports_test_reward_a")


def test_without_the_import_the_reward_name_is_unknown():
    c = default.get_config()
    c.reward.spec = "imports_test_never_registered"
    with pytest.raises(ConfigError, match=r"config.reward.spec: .*imports_test_never_registered"):
        validate(c)


@pytest.mark.parametrize(
    ("source", "error"),
    [
        (None, r"config.imports: '.*missing_rewards.py': no such file"),
        ("def broken(:\n", r"config.imports: '.*broken_rewards.py' failed to import: SyntaxError"),
        ("raise RuntimeError('boom')\n", r"failed to import: RuntimeError: boom"),
    ],
)
def test_a_file_that_cannot_be_imported_is_one_line_naming_it(tmp_path, source, error):
    name = {None: "missing", "def broken(:\n": "broken"}.get(source, "raising")
    path = tmp_path / f"{name}_rewards.py"
    if source is not None:
        path.write_text(source)
    c = default.get_config()
    c.imports = str(path)
    with pytest.raises(ConfigError, match=error):
        validate(c)


def test_a_file_whose_name_is_taken_is_refused(tmp_path):
    path = tmp_path / "json.py"
    path.write_text("X = 1\n")
    with pytest.raises(imports.ImportsError, match=r"'json' is already taken by"):
        imports.import_all(str(path))


def test_module_names_and_lists_are_accepted():
    assert imports.entries(" a.b , c.py,,") == ["a.b", "c.py"]
    assert imports.entries(["x", " y "]) == ["x", "y"]
    assert imports.import_all("gspo_jax.rewards.testing") == ["gspo_jax.rewards.testing"]
