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


def test_reliability_describes_a_transaction_committed_once_caught_up_fenced_by_the_group() -> None:
    """A batch's outcomes and offsets in one Kafka transaction, committed once
    the worker has caught up and spanning batches only under a backlog, whose
    offsets carry the consumer group's metadata (KIP-447); the removed
    faust-path machinery is not described as current."""
    settings = Settings()
    assert settings.commit_caught_up and settings.commit_interval_s > 0  # the defaults it describes
    text = (REPO / "RELIABILITY.md").read_text()
    how = text.split("\nHow:\n", 1)[1]
    first, second = how.split("\n- ", 3)[1:3]
    assert first.startswith("**A batch's outcomes and offsets in one Kafka transaction**")
    for named in ("FRAUD_COMMIT_CAUGHT_UP", "FRAUD_COMMIT_INTERVAL_S", "send_offsets_to_transaction"):
        assert named in first, named
    assert second.startswith("**Fenced by the consumer group's metadata**") and "KIP-447" in second
    assert "consumer_group_metadata()" in second and "require_stable" in second
    for gone in ("FRAUD_TRANSACTION_SCOPE", "app/transactional.py", "app/group_fencing.py", "app/offsets.py"):
        assert gone not in text, gone
