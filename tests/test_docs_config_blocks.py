"""Every JSON config block of the documentation and the README is a config partita's loader
accepts. A block that is deliberately a fragment says so in its fence: ```json partial."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from partita.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parent.parent
_FENCE = re.compile(r"^(?P<indent> *)(?P<ticks>```+)(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=indent)(?P=ticks)[ \t]*$",
                    re.M | re.S)


def json_blocks(text: str) -> list[tuple[int, str]]:
    """(line, body) of each ```json block that is not marked partial."""
    blocks = []
    for match in _FENCE.finditer(text):
        info = match.group("info").split()
        if info[:1] != ["json"] or "partial" in info[1:]:
            continue
        indent = len(match.group("indent"))
        body = "\n".join(line[indent:] for line in match.group("body").splitlines())
        blocks.append((text.count("\n", 0, match.start()) + 1, body))
    return blocks


def _all_blocks() -> list[tuple[str, str]]:
    pages = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
    return [(f"{page.relative_to(ROOT)}:{line}", body) for page in pages for line, body in json_blocks(page.read_text())]


BLOCKS = _all_blocks()


def test_the_docs_have_config_blocks() -> None:
    assert len(BLOCKS) >= 8, [where for where, _ in BLOCKS]
    assert any(where.startswith("README.md:") for where, _ in BLOCKS)


@pytest.mark.parametrize("where, body", BLOCKS, ids=[where for where, _ in BLOCKS])
def test_config_block_loads(where: str, body: str) -> None:
    try:
        config = json.loads(body)
    except json.JSONDecodeError as error:
        pytest.fail(f"{where}: not JSON ({error}); mark a fragment as ```json partial")
    load_config(config)


def test_a_bad_block_is_found_and_refused_and_partial_is_skipped() -> None:
    text = ('text\n```json\n{"zero_optimization": {"stgae": 2}}\n```\n'
            '  ```json partial\n  "bf16": {"enabled": true}\n  ```\n'
            '```python\nx = 1\n```\n')
    blocks = json_blocks(text)
    assert blocks == [(2, '{"zero_optimization": {"stgae": 2}}')]
    with pytest.raises(ConfigError, match="stgae"):
        load_config(json.loads(blocks[0][1]))
