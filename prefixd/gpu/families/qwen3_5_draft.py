"""MTP drafting inside a round: the head's rows for every lane, then its proposals.

After the round's forward and samples, every lane that ran rows gets its MTP rows, one per
position whose next token is now known (`qwen3_5_mtp` for the row itself):

    lane rows [s, s + n), kept rows m (n, or the accepted prefix of a verify), token y sampled
    MTP rows at positions s-1 .. s+m-1 read  (carry, h_s .. h_{s+m-1})
                                      with  (t_s .. t_{s+m-1}, y)

The first row is the *carry* row: the lane's last row of the round before waited for its next
token (the carry is in the lane state, so a snapshot holds it). A lane that samples nothing
(a prefill chunk before the last) leaves its last row as the new carry. A lane that samples y
has its row at s+m-1 computed with y now (the next round computes it again as its carry row,
to the same bits: MTP rows are row-invariant), and that row's logits give the first draft;
with `LaneWork.propose` > 1 the head runs again on its own output row and the draft, once per
further draft (the published recipe for one MTP layer), the k-th pass at position s+m-1+k-1.

Every MTP row writes its K/V into the MTP's KV layer of the lane's pages; attention reads
only positions up to the row's own, so rows past the lane's kept rows are overwritten before
anything reads them. The MTP row at a page's last position depends on the token after the
page: with a draft head the device keys pages with one token of lookahead, so a shared page
holds what any lane with the same key writes there. Chained passes may run past the lane's
last page: each lane has one scratch page after the scheduler's pages for that.

Drafts are the head's argmax (greedy, whatever the request's sampling): verification keeps
only tokens the model itself samples, so proposals never change an emitted bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from prefixd.scheduler.records import LaneResult, LaneWork


@dataclass(frozen=True)
class _LaneRows:
    work: LaneWork  # MTP rows: start = first position, tokens = the token after each row
    hidden: torch.Tensor  # (rows, hidden) float32: what each row reads
    propose: int  # drafts wanted after the last row (0: rows only)


class MtpDrafts:
    """The draft step of a runner with a draft head: `carries` before the forward, `run` after
    the samples. Lane `l`'s scratch page is `scratch_base + l`."""

    def __init__(self, model, kv, *, scratch_base: int) -> None:
        if not getattr(model, "mtp", None):
            raise ValueError("this model has no MTP layers: it cannot draft with --draft mtp")
        self.model, self.kv, self.scratch_base = model, kv, scratch_base

    def carries(self, works: Sequence[LaneWork]) -> dict[int, torch.Tensor]:
        """Each lane's carry as it is before the forward (the forward replaces it)."""
        lanes = [w.lane for w in works if w.start > 0]
        if not lanes:
            return {}
        idx = torch.tensor(lanes, dtype=torch.long, device=self.model.device)
        rows = self.model.states.live.carry.index_select(0, idx)
        return {lane: rows[i:i + 1] for i, lane in enumerate(lanes)}

    def run(self, works: Sequence[LaneWork], first_rows: Sequence[int], hidden: torch.Tensor,
            carries: Mapping[int, torch.Tensor], results: Mapping[int, LaneResult]) -> dict[int, tuple[tuple[int, ...], float]]:
        """MTP rows for every lane of the round that did not fail (`first_rows`: each work's
        first row in `hidden`); returns lane -> (proposals, the first one's probability) for
        lanes that asked for proposals and sampled."""
        lanes = [rows for w, row in zip(works, first_rows)
                 if (rows := self._lane_rows(w, row, hidden, carries, results[w.lane])) is not None]
        if not lanes:
            return {}
        out = self.model.mtp_works(torch.cat([x.hidden for x in lanes]), [x.work for x in lanes], self.kv)
        ends = torch.tensor(list(_ends(lanes)), dtype=torch.long, device=out.device)
        proposing = [i for i, x in enumerate(lanes) if x.propose > 0]
        if not proposing:
            return {}
        last = out.index_select(0, ends[proposing])
        return self._chain([lanes[i] for i in proposing], last)

    def _lane_rows(self, w: LaneWork, row: int, hidden: torch.Tensor, carries: Mapping[int, torch.Tensor],
                   res: LaneResult) -> _LaneRows | None:
        if res.error is not None:
            return None
        kept = len(res.sampled) if w.drafts else len(w.tokens)
        h = hidden[row:row + kept]
        tokens = list(w.tokens[:kept])
        if res.sampled:
            tokens.append(res.sampled[-1])
        else:
            h = h[:-1]  # the last row waits for its next token: it is the new carry
        start = w.start - 1
        if w.start > 0:
            h = torch.cat([carries[w.lane], h])
        else:
            tokens, start = tokens[1:], 0
        if not tokens:
            return None
        table = (*w.page_table, self.scratch_base + w.lane)
        propose = w.propose if res.sampled else 0
        return _LaneRows(LaneWork(w.lane, start, tuple(tokens), table, prefill=True), h, propose)

    def _chain(self, lanes: list[_LaneRows], rows: torch.Tensor) -> dict[int, tuple[tuple[int, ...], float]]:
        """Drafts from `rows` (each lane's last MTP row), then further passes of the head on its
        own rows while a lane wants more drafts and its pages (scratch included) have room: the
        j-th further pass runs at the position after the (j-1)-th."""
        logits = self.model.logits(rows)
        first = logits.argmax(dim=-1)
        p = torch.softmax(logits, dim=-1).gather(1, first[:, None])[:, 0].tolist()
        drafts = [[t] for t in first.tolist()]
        page = self.kv.page_size
        limit = [min(x.propose, len(x.work.page_table) * page - _end(x.work) + 1) for x in lanes]
        active, step = list(range(len(lanes))), 1
        while keep := [k for k, i in enumerate(active) if len(drafts[i]) < limit[i]]:
            active = [active[k] for k in keep]
            rows = rows.index_select(0, torch.tensor(keep, dtype=torch.long, device=rows.device))
            works = [LaneWork(lanes[i].work.lane, _end(lanes[i].work) - 1 + step, (drafts[i][-1],),
                              lanes[i].work.page_table, prefill=True) for i in active]
            rows = self.model.mtp_works(rows, works, self.kv, step=step)
            for i, t in zip(active, self.model.logits(rows).argmax(dim=-1).tolist()):
                drafts[i].append(t)
            step += 1
        return {x.work.lane: (tuple(d), pi) for x, d, pi in zip(lanes, drafts, p)}


def _end(w: LaneWork) -> int:
    """One past the position of the work's last row."""
    return w.start + len(w.tokens)


def _ends(lanes: Sequence[_LaneRows]):
    """Index of each lane's last MTP row in the concatenated rows."""
    at = 0
    for x in lanes:
        at += len(x.work.tokens)
        yield at - 1
