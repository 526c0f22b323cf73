"""The documentation runs: code blocks of README.md and docs/*.md, docstring examples of remat, policy coverage.

* Every fenced ```python block of a page runs; the blocks of one page share a
  namespace and run in order, like a notebook. A block preceded by the line
  ``<!-- skip-test -->`` is skipped (keep that for GPU-only snippets).
* Every docstring example (``>>>``) in the modules of the ``remat`` package runs
  as a doctest.
* Every public name of ``remat.policies`` is documented in docs/policies.md.
"""

from __future__ import annotations

import doctest
import importlib
import inspect
import pkgutil
import re
import sys
import types
from pathlib import Path

import pytest
import torch

import remat
import remat.offload
import remat.policies

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
SKIP = "<!-- skip-test -->"
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def python_blocks(text: str) -> list[tuple[int, str, bool]]:
    """(line number, code, skipped) of each ```python block."""
    blocks = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        blocks.append((line, m.group(1), before == SKIP))
    return blocks


@pytest.mark.parametrize("page", [p for p in PAGES if p.exists()], ids=lambda p: str(p.relative_to(ROOT)))
def test_code_blocks_run(page: Path) -> None:
    blocks = python_blocks(page.read_text())
    # a real module: torch.compile looks up the module of the functions it compiles by name
    module = types.ModuleType(f"docs_{page.stem}")
    namespace = module.__dict__
    sys.modules[module.__name__] = module
    torch.manual_seed(0)
    try:
        for line, code, skipped in blocks:
            if skipped:
                continue
            try:
                exec(compile(code, f"{page.relative_to(ROOT)}:{line}", "exec"), namespace)
            except Exception as e:
                raise AssertionError(f"{page.relative_to(ROOT)}, code block at line {line} failed: {e!r}") from e
    finally:
        del sys.modules[module.__name__]


def test_block_extraction() -> None:
    text = "a\n```python\nx = 1\n```\n<!-- skip-test -->\n```python\nraise SystemExit\n```\n```bash\nls\n```\n"
    assert python_blocks(text) == [(2, "x = 1\n", False), (6, "raise SystemExit\n", True)]


def test_docs_pages_exist_and_are_linked() -> None:
    index = (ROOT / "docs" / "index.md").read_text()
    for name in ["getting-started.md", "policies.md", "how-it-works.md", "comparison.md", "transforms.md",
                 "offloading.md", "inspecting.md", "benchmarks.md", "models.md"]:
        assert f"({name})" in index, f"docs/index.md does not link {name}"
    for name in ["index.md", "getting-started.md", "policies.md", "how-it-works.md", "comparison.md", "models.md"]:
        assert python_blocks((ROOT / "docs" / name).read_text()) or name in ("index.md", "how-it-works.md"), name


MODULES = sorted(m.name for m in pkgutil.walk_packages(remat.__path__, "remat.") if m.name != "remat.bench.__main__")


@pytest.mark.parametrize("module", ["remat", *MODULES])
def test_docstring_examples(module: str) -> None:
    mod = importlib.import_module(module)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(mod, module, globs={}):
        if test.examples and (test.filename is None or test.filename == getattr(mod, "__file__", None)):
            runner.run(test)
    res = runner.summarize(verbose=False)
    assert res.failed == 0, f"{res.failed} of {res.attempted} docstring examples failed in {module}"


PUBLIC = [(mod.__name__, name, getattr(mod, name)) for mod in (remat, remat.offload, remat.policies)
          for name in mod.__all__]


def test_public_api_has_docstring_examples() -> None:
    """Every public class and function carries a runnable example (so the doctests above are not vacuous).

    Aliases (``checkpoint``, ``checkpoint_dots``...) share their target's docstring; the
    decision instances (``Saveable``, ``Recompute``) and constants are neither.
    """
    objs = [(f"{m}.{n}", o) for m, n, o in PUBLIC if inspect.isclass(o) or inspect.isfunction(o)]
    assert len(objs) >= 28, [n for n, _ in objs]  # the check covers the whole public API
    missing = [n for n, o in objs if not re.search(r"^\s*Example:?\s*$", o.__doc__ or "", re.MULTILINE)
               or ">>>" not in (o.__doc__ or "")]
    assert not missing, f"public objects without an Example section with >>> in their docstring: {missing}"
    # and the examples run: each object is defined in a module of the package, whose doctests run above
    outside = [n for n, o in objs if not o.__module__.startswith("remat.")]
    assert not outside, f"public objects defined outside the remat package (their doctests would not run): {outside}"


def test_every_public_policy_is_documented() -> None:
    text = (ROOT / "docs" / "policies.md").read_text()
    missing = [n for n in remat.policies.__all__ if f"`{n}" not in text]
    assert not missing, f"docs/policies.md does not document {missing}"
