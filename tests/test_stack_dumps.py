"""A job that outlives its timeout fails with where each rank still running waited (tests/stack_dumps.py)."""

import pytest
from multiprocess import run_ranks


def test_a_rank_past_the_timeout_reports_its_stack_before_it_is_killed():
    with pytest.raises(AssertionError) as failed:
        run_ranks("time:sleep", 1, 60, timeout=2)
    report = str(failed.value)
    assert "--- rank 0: timed out ---" in report, report
    assert "most recent call first" in report and 'rank_main.py", line' in report, report
