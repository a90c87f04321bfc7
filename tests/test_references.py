"""Every path, module and dotted name that README.md, docs/ and the code's docstrings and
comments cite exists: a moved or renamed file leaves no stale reference behind.

What is checked, statically (nothing is imported, so a tool's absl flags never clash):
- bare file names (`loop.py`): some file of the repository has that name;
- repository paths (`gspo_jax/trainer/loop.py`, `tests/trainer/test_loop.py`, `docs/tpu.md`, and the
  package-relative form `trainer/loop.py` or `models/paged.py`): the file or folder exists;
- markdown links (`[text](tpu.md)`): the target exists beside the page;
- dotted names under gspo_jax, tools, configs, experiments and benchmarks
  (`gspo_jax.trainer.loop.run`, `tools.aot`): the module exists and, where the name goes on,
  its first attribute is defined at the module's top level (def, class, assignment, import),
  and any further attribute is defined somewhere in that module.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gspo_jax", "tools", "configs", "experiments", "benchmarks")
# Aliases registered in gspo_jax/__init__.py (the public paths of the paper's math).
ALIASES = {
    "gspo_jax.objectives": "gspo_jax.algorithm.objectives",
    "gspo_jax.advantages": "gspo_jax.algorithm.advantages",
}
# Bare file names the docs use for the user's own files (`my_rewards.py`), not the repo's.
USER_FILES = ("my_",)
# First components of a repository path, and of a path relative to gspo_jax/.
TOP = ("gspo_jax", "tests", "configs", "docs", "benchmarks", "tools", "launch", "experiments")
TOP += ("colabs", ".ci")
SUB = tuple(p.name for p in (ROOT / "gspo_jax").iterdir() if p.is_dir() and p.name[0] != "_")
_PATH = re.compile(
    r"(?<![\w./<>$~-])((?:" + "|".join(map(re.escape, TOP + SUB)) + r")/[\w./-]*(?:\.[a-z]+|/))"
)  # a file (with its suffix) or a folder (with its slash): `rollout/groups_kept` is a metric
_BARE = re.compile(r"(?<![\w./<>$*+-])([A-Za-z_][\w-]*\.(?:py|sh|md|ipynb))(?![\w/])")
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
_DOTTED = re.compile(r"(?<![\w./])((?:" + "|".join(PACKAGES) + r")(?:\.[A-Za-z_]\w*)+)(?![\w/])")
_SUFFIXES = ("md", "py", "sh", "json", "jsonl", "png", "txt", "ipynb")
# In code, only names under the library and the tools are references (`configs` and
# `benchmarks` are also ordinary variable names there).
_CODE_PACKAGES = ("gspo_jax.", "tools.", "experiments.")


def sources() -> list[Path]:
    """The texts checked: README.md, docs/ and the experiment's templates, and every .py /
    .sh outside tests/."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    files += sorted((ROOT / "experiments").rglob("*.md"))  # the results templates
    for folder in ("gspo_jax", "tools", "configs", "experiments", "benchmarks", "launch"):
        files += sorted((ROOT / folder).rglob("*.py")) + sorted((ROOT / folder).rglob("*.sh"))
    return files


def _path_exists(ref: str, page: Path) -> bool:
    ref = ref.rstrip(".")
    bases = (ROOT, ROOT / "gspo_jax", ROOT / "tests", page.parent)
    return any((base / ref).exists() for base in bases)


@functools.cache
def _basenames() -> frozenset[str]:
    """Every file name in the repository (a bare `loop.py` must name one of them)."""
    skip = {".git", ".venv", ".libtpu", "workdirs", "node_modules"}
    names = set()
    for path in ROOT.rglob("*"):
        if not skip.intersection(path.relative_to(ROOT).parts):
            names.add(path.name)
    return frozenset(names)


@functools.cache
def _module_file(module: str) -> Path | None:
    for name in (ALIASES.get(module, module), module):
        base = ROOT / name.replace(".", "/")
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


@functools.cache
def _top_level_names(path: Path) -> frozenset[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return frozenset(names)


# Names gspo_jax/__init__.py provides lazily (module __getattr__).
LAZY = {"gspo_jax.train": "gspo_jax.trainer.api.train"}


def _dotted_exists(name: str) -> bool:
    name = name.rstrip(".")
    for short, full in LAZY.items():
        if name == short or name.startswith(short + "."):
            name = full + name[len(short) :]
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        path = _module_file(".".join(parts[:cut]))
        if path is None:
            continue
        rest = parts[cut:]
        if not rest:
            return True
        if rest[0] not in _top_level_names(path):
            sub = _module_file(".".join(parts[: cut + 1]))
            return sub is not None
        text = path.read_text()
        return all(re.search(rf"\b{re.escape(r)}\b", text) for r in rest[1:])
    return False


def stale_references() -> list[str]:
    stale = []
    for page in sources():
        text = page.read_text(encoding="utf-8")
        where = page.relative_to(ROOT)
        for ref in _PATH.findall(text):
            if not _path_exists(ref, page):
                stale.append(f"{where}: path {ref}")
        for ref in _BARE.findall(text):
            if ref not in _basenames() and not ref.startswith(USER_FILES):
                stale.append(f"{where}: file {ref}")
        if page.suffix == ".md":
            for ref in _LINK.findall(text):
                if "://" not in ref and not (page.parent / ref).exists():
                    stale.append(f"{where}: link {ref}")
        for ref in _DOTTED.findall(text):
            if ref.rsplit(".", 1)[-1] in _SUFFIXES:
                continue  # a file name (`benchmarks.md`), checked as a path or link
            if page.suffix != ".md" and not ref.startswith(_CODE_PACKAGES):
                continue
            if not _dotted_exists(ref):
                stale.append(f"{where}: name {ref}")
    return sorted(set(stale))


def test_every_cited_path_and_name_exists():
    stale = stale_references()
    assert not stale, f"{len(stale)} stale references:\n" + "\n".join(stale)


def test_the_checker_finds_what_is_stale(tmp_path):
    """The check itself can fail: a missing module, attribute, path and link are reported."""
    page = ROOT / "docs" / "README.md"
    assert _dotted_exists("gspo_jax.trainer.loop.run")
    assert _dotted_exists("gspo_jax.objectives.policy_loss")
    assert not _dotted_exists("gspo_jax.trainer.train.run")
    assert not _dotted_exists("gspo_jax.trainer.loop.no_such_function")
    assert _path_exists("trainer/loop.py", page) and _path_exists("tpu.md", page)
    assert not _path_exists("gspo_jax/sharding.py", page)
    assert "loop.py" in _basenames() and "train.py" not in _basenames()
    assert _BARE.findall("`train.py` calls it (docs/tpu.md, gspo_jax/x.py)") == ["train.py"]
    assert _PATH.findall("see `gspo_jax/train.py`, trainer/x.py and rollout/groups_kept") == [
        "gspo_jax/train.py",
        "trainer/x.py",
    ]


def test_the_map_lists_every_module_tool_benchmark_and_launch_script():
    """docs/architecture.md's tree names every .py / .sh of the package, tools/, benchmarks/
    and launch/ (a file name that occurs in several folders, as often as it occurs)."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    tree = doc[doc.index("## The tree") : doc.index("## Glossary")]
    files: dict[str, int] = {}
    for folder in ("gspo_jax", "tools", "benchmarks", "launch"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".sh") and path.name != "__init__.py":
                files[path.name] = files.get(path.name, 0) + 1
    missing = [
        name
        for name, count in sorted(files.items())
        if len(re.findall(rf"(?<![\w/]){re.escape(name)}", tree)) < count
    ]
    assert not missing, f"docs/architecture.md's tree does not list: {missing}"
