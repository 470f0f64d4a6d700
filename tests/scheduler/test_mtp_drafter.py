"""The engine's side of `--draft mtp` (no device): a stream's MtpDrafter hands on only the
proposals that follow exactly its tokens so far, cut to the policy's length and the limit,
asks the device for one more proposal than the policy last took, and rounds that sample for
such a stream ask for proposals."""

from __future__ import annotations

from prefixd.scheduler.draftpolicy import RoundCosts
from prefixd.scheduler.lanes import Lane
from prefixd.scheduler.mtp import IDLE_ROUNDS, MtpDrafter, ask_proposals, offer_proposals
from prefixd.scheduler.records import LaneResult, LaneWork
from prefixd.scheduler.rounds import PlannedWork
from prefixd.scheduler.streams import Stream, StreamRequest


def drafter(max_k: int = 4) -> MtpDrafter:
    costs = RoundCosts()
    costs.observe(1, 1.0)  # a round costs the same whatever its rows: long drafts pay
    costs.observe(8, 1.0)
    return MtpDrafter(max_k, costs)


def test_proposals_are_used_only_right_after_the_token_they_follow():
    d = drafter()
    d.offer(3, (7, 8, 9), 0.9)
    assert d.propose([1, 2], limit=4) == ()  # proposed for a later point of the stream
    assert d.propose([1, 2, 3, 4], limit=4) == ()  # stale: a token came since
    assert d.propose([1, 2, 3], limit=2) == (7, 8)
    assert d.propose([1, 2, 3], limit=0) == ()


def test_the_device_is_asked_for_one_more_proposal_than_the_policy_took_and_rarely_while_idle():
    d = drafter(max_k=4)
    assert d.wants() == 4  # nothing verified yet: the most
    d.offer(1, (5, 6, 7, 8), 0.9)
    taken = d.propose([1], limit=4)
    assert 1 <= len(taken) and d.wants() == min(4, len(taken) + 1)
    for _ in range(20):  # a head that is never right: the policy stops drafting
        d.offer(1, (5,), 0.1)
        got = d.propose([1], limit=4)
        d.record(len(got), 0)
    assert got == ()
    asked = [d.wants() for _ in range(2 * IDLE_ROUNDS)]  # while drafting nothing: one now and then
    assert asked == ([0] * (IDLE_ROUNDS - 1) + [1]) * 2


def test_rounds_that_sample_for_an_mtp_stream_ask_for_proposals_and_take_them_back():
    req = StreamRequest(1, (1, 2, 3), 8)
    stream = Stream(req=req, submit_s=0.0, seq=0, schedule=None)
    stream.drafter = drafter(max_k=3)
    prefill = LaneWork(0, 0, (1, 2), (0,), True)
    last = LaneWork(0, 2, (3,), (0,), True, sample_rows=(0,))
    out = ask_proposals([PlannedWork(Lane(0), stream, w, None) for w in (prefill, last)])
    assert [p.work.propose for p in out] == [0, 3]
    stream.generated.append(9)
    offer_proposals(stream, LaneResult(0, sampled=(9,), proposals=(4, 5, 6), proposal_p=0.95))
    taken = stream.drafter.propose(stream.generated, limit=3)
    assert taken and taken == (4, 5, 6)[: len(taken)]
