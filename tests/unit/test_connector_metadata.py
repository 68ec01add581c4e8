"""Reports of P's workers about their WRITEs: merged per step by vLLM, tallied over
steps by the scheduler, so a push ends only when every rank's share has ended."""

from __future__ import annotations

from connector.protocol.side_channel import TransferId
from connector.protocol.step import PushEnd, PushReport, WriteTally

A, B = TransferId("a"), TransferId("b")


def test_one_rank_ends_a_write_at_once() -> None:
    tally = WriteTally(ranks=1)
    assert tally.add(PushReport({A: PushEnd(None, 0.01, 4)})) == {A: PushEnd(None, 0.01, 4)}
    assert len(tally) == 0


def test_ranks_reporting_in_different_steps_end_the_write_with_the_last() -> None:
    tally = WriteTally(ranks=2)
    assert tally.add(PushReport({A: PushEnd(None, 0.01, 4)})) == {}
    assert len(tally) == 1  # rank 0 done; rank 1 still writing
    done = tally.add(PushReport({A: PushEnd(None, 0.03, 4)}))
    assert done == {A: PushEnd(None, 0.03, 4, ranks=2)}
    assert len(tally) == 0


def test_one_failed_rank_fails_the_write_even_after_the_others_succeeded() -> None:
    tally = WriteTally(ranks=3)
    assert tally.add(PushReport({A: PushEnd(None, 0.01, 2)})) == {}
    assert tally.add(PushReport({A: PushEnd("WRITE failed", 0.02, 2, holding_ranks=1)})) == {}
    done = tally.add(PushReport({A: PushEnd(None, 0.01, 2)}))
    assert done[A].error == "WRITE failed" and done[A].ranks == 3
    assert done[A].holding_ranks == 1, "only the failed rank kept its blocks: no READ offer"


def test_a_step_merges_its_ranks_reports_and_keeps_transfers_apart() -> None:
    rank0 = PushReport({A: PushEnd(None, 0.01, 4), B: PushEnd(None, 0.02, 1)})
    rank1 = PushReport({A: PushEnd("peer gone", 0.05, 4, holding_ranks=1)})
    merged = rank0.aggregate(rank1)
    assert merged.ended == {A: PushEnd("peer gone", 0.05, 4, ranks=2, holding_ranks=1),
                            B: PushEnd(None, 0.02, 1)}
    assert rank0.ended[A].ranks == 1  # the inputs are left as they were
    tally = WriteTally(ranks=2)
    assert tally.add(merged) == {A: merged.ended[A]}
    assert len(tally) == 1  # B waits for its second rank
