"""tests/harness.py: a rank that hangs is reported with every thread's stack (faulthandler), so a
hang in CI says where it hung instead of only that it did."""

from __future__ import annotations

import time

import pytest

from tests.harness import run_distributed


def sleeps_forever() -> None:
    time.sleep(600)


def test_a_hung_rank_is_reported_with_its_stacks():
    with pytest.raises(TimeoutError) as error:
        run_distributed(sleeps_forever, 1, timeout=2)
    message = str(error.value)
    assert message.startswith("hang: ranks [0] of 1 did not finish within 2 s")
    assert "--- rank 0 stacks ---" in message and "in sleeps_forever" in message
