"""What the front documents promise, held to the code: README's size and quick
start, RELIABILITY.md's transaction cut."""

from __future__ import annotations

import re
from pathlib import Path

from app.settings import Settings

REPO = Path(__file__).resolve().parents[2]

#: The front door stays short; detail lives in docs/.
README_MAX_BYTES = 12_000


def test_the_readme_is_at_most_12_kb_and_keeps_the_two_quick_start_commands() -> None:
    readme = (REPO / "README.md").read_bytes()
    assert len(readme) <= README_MAX_BYTES, f"README.md is {len(readme):,} bytes: move detail to docs/"
    quick_start = readme.decode().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```sh\n(.*?)```", quick_start, re.S)
    assert block is not None
    assert [line.split("#")[0].strip() for line in block.group(1).splitlines()] == ["make demo", "make test"]


def test_reliability_describes_the_default_transaction_scope() -> None:
    """The default scope cuts one Kafka transaction per batch, not per batch and input partition."""
    assert Settings().transaction_scope == "batch"
    text = (REPO / "RELIABILITY.md").read_text()
    how = text.split("\nHow:\n", 1)[1]
    first = how.split("\n- ", 2)[1]
    assert first.startswith("**One Kafka transaction per batch**") and "the default" in first
    assert "per batch and input partition**" not in text
