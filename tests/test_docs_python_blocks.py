"""The documentation's runnable Python blocks (fenced as ```python runnable) run under Sybil,
each page in a fresh process of its own (a world of one gloo rank, as `python script.py`), its
blocks in order in one namespace; an exception or a failed assert fails the page."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import run_distributed

ROOT = Path(__file__).resolve().parent.parent
FENCE = "```python runnable\n"
PAGES = sorted(p for p in list((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"] if FENCE in p.read_text())


def _sybil():
    from sybil import Sybil
    from sybil.evaluators.python import PythonEvaluator
    from sybil.parsers.myst import CodeBlockParser

    # The whole fence info must read "python runnable": plain ```python blocks are illustrations.
    return Sybil(parsers=[CodeBlockParser(language="python runnable", evaluator=PythonEvaluator())], path=str(ROOT))


def _run_page(path: str) -> int:
    document = _sybil().parse(Path(path))
    examples = list(document.examples())
    for example in examples:
        example.evaluate()
    return len(examples)


def test_pages_with_runnable_blocks_exist() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert {"docs/getting-started/training-loop.md", "docs/guides/troubleshooting.md", "docs/guides/zero.md",
            "docs/guides/checkpoints.md", "docs/guides/tensor-parallelism.md", "docs/guides/pipeline-parallelism.md",
            "docs/guides/expert-parallelism.md", "docs/guides/sequence-parallelism.md",
            "docs/guides/monitoring.md", "docs/getting-started/from-deepspeed.md"} <= names, names
    assert sum(p.read_text().count(FENCE) for p in PAGES) >= 15  # a block turned back into an illustration shows here


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_runnable_blocks_run(page: Path) -> None:
    (count,) = run_distributed(_run_page, 1, str(page), timeout=300.0)
    assert count == page.read_text().count(FENCE)


def test_a_failing_block_fails_the_page(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("```python runnable\nvalue = 1\n```\n\n```python\nnot run = at all\n```\n\n"
                    "```python runnable\nassert value == 2, 'the second block sees the first one'\n```\n")
    with pytest.raises(Exception, match="the second block sees the first one"):
        _run_page(str(page))
