"""The engine's side of `--draft mtp` (no device): a stream's MtpDrafter offers only the
proposals that follow exactly its tokens so far, cut to its most and the limit, hands on what
the round granted, asks the device for one more proposal than it was last granted, and rounds
that sample for such a stream ask for proposals."""

from __future__ import annotations

from prefixd.scheduler.lanes import Lane
from prefixd.scheduler.mtp import IDLE_ROUNDS, MtpDrafter, ask_proposals, offer_proposals
from prefixd.scheduler.records import LaneResult, LaneWork
from prefixd.scheduler.rounds import PlannedWork
from prefixd.scheduler.streams import Stream, StreamRequest


def test_proposals_are_offered_only_right_after_the_token_they_follow():
    d = MtpDrafter(4)
    d.receive(3, (7, 8, 9), 0.9)
    assert d.offer([1, 2], limit=4) is None  # proposed for a later point of the stream
    assert d.take(3) == ()
    assert d.offer([1, 2, 3, 4], limit=4) is None  # stale: a token came since
    offer = d.offer([1, 2, 3], limit=2)
    assert offer.tokens == (7, 8) and len(offer.chances) == 2
    assert offer.chances[0] >= offer.chances[1] > 0
    assert d.take(1) == (7,)
    assert d.offer([1, 2, 3], limit=0) is None


def test_a_confident_head_offers_higher_chances_once_it_has_been_right():
    d = MtpDrafter(4)
    for _ in range(8):  # confident proposals, always accepted; unsure ones, never
        d.receive(0, (5, 6), 0.95)
        d.offer([], limit=4)
        d.record(len(d.take(2)), 2)
        d.receive(0, (5, 6), 0.1)
        d.offer([], limit=4)
        d.record(len(d.take(2)), 0)
    d.receive(0, (5,), 0.95)
    sure = d.offer([], limit=4).chances[0]
    d.receive(0, (5,), 0.1)
    unsure = d.offer([], limit=4).chances[0]
    assert sure > 0.8 > 0.2 > unsure


def test_the_device_is_asked_for_one_more_proposal_than_the_round_granted_and_rarely_while_idle():
    d = MtpDrafter(4)
    assert d.wants() == 4  # nothing granted yet: the most
    d.receive(1, (5, 6, 7, 8), 0.9)
    d.offer([1], limit=4)
    assert d.take(2) == (5, 6) and d.wants() == 3
    d.receive(1, (5,), 0.1)
    d.offer([1], limit=4)
    assert d.take(0) == ()  # the round granted nothing
    asked = [d.wants() for _ in range(2 * IDLE_ROUNDS)]  # while granted nothing: one now and then
    assert asked == ([0] * (IDLE_ROUNDS - 1) + [1]) * 2


def test_rounds_that_sample_for_an_mtp_stream_ask_for_proposals_and_take_them_back():
    req = StreamRequest(1, (1, 2, 3), 8)
    stream = Stream(req=req, submit_s=0.0, seq=0, schedule=None)
    stream.drafter = MtpDrafter(3)
    prefill = LaneWork(0, 0, (1, 2), (0,), True)
    last = LaneWork(0, 2, (3,), (0,), True, sample_rows=(0,))
    out = ask_proposals([PlannedWork(Lane(0), stream, w, None) for w in (prefill, last)])
    assert [p.work.propose for p in out] == [0, 3]
    stream.generated.append(9)
    offer_proposals(stream, LaneResult(0, sampled=(9,), proposals=(4, 5, 6), proposal_p=0.95))
    assert stream.drafter.offer(stream.generated, limit=3).tokens == (4, 5, 6)
    assert stream.drafter.take(2) == (4, 5)
