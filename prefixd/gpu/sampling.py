"""Per-lane token sampling: penalties, filters, and a seeded inverse-CDF draw.

A sampled token is a pure function of (logits row, params, seed, repetition history,
absolute position): the uniform number for the token at position p is a counter-based hash
of (seed, p) (`position_uniform`), not the next draw of a stateful generator. So a seeded
stream gives the same tokens alone, beside other lanes, interleaved in any order, and when
verify rows sample positions a later round samples again (drafted equals undrafted).

Processing order for one logits row (the same order transformers applies them):

    repetition penalty -> drop padded ids -> greedy argmax
                                          -> temperature -> top-k -> top-p -> min-p -> draw

Every finite value of every field that validate_params accepts keeps a finite row drawable:
penalties saturate at float32's range and temperatures past it fall back to a shifted form
(`apply_temperature`), so no edge of the spec can end a stream with NaN.

The draw walks the cumulative distribution in id order with one uniform number u, so a
token depends only on the row and u.

The filter functions are pure (row in, new row out; removed ids become -inf) so each can
be checked on its own against hand-made logits or a reference implementation.
"""

from __future__ import annotations

import math
import secrets
from typing import Any, Sequence

import numpy as np
import torch

from prefixd.scheduler.records import SamplingParams, TokenLogprob

_NEG_INF = float("-inf")
_TOP_P_FIRST_K = 256
_MASK64 = 2**64 - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection on 64-bit ints with full avalanche."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def position_uniform(seed: int, position: int) -> float:
    """The uniform number in [0, 1) that draws the token at absolute `position` of a stream
    seeded with `seed`: 53 bits of a two-round splitmix64 hash of (seed, position). Plain
    integer arithmetic, so it is the same on every device and needs no generator state."""
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position}")
    key = _mix64((seed + 0x9E3779B97F4A7C15) & _MASK64)
    bits = _mix64((key ^ (position * 0x9E3779B97F4A7C15)) & _MASK64)
    return (bits >> 11) * 2.0**-53
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _as_float32(x: float) -> float:
    """`x` as a float32 scalar would hold it (what torch multiplies a float32 row by)."""
    return float(torch.tensor(x, dtype=torch.float32))


def validate_params(params: SamplingParams) -> None:
    """Raise ValueError when a field is outside its meaningful range (SamplingParams.problem)."""
    problem = params.problem()
    if problem is not None:
        raise ValueError(problem)


def repetition_penalty(row: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """Penalise ids where `seen` (bool, same length as `row`) is set.

    A positive logit is divided by `penalty`, a negative one multiplied (each id once,
    however often it occurred). A result past the float32 range saturates at its finite end,
    so any penalty > 0 keeps a finite row finite.
    """
    if penalty == 1.0:
        return row
    if 0.0 < _as_float32(penalty) < math.inf:  # in float32 like the row: transformers' bits
        penalised = torch.where(row < 0, row * penalty, row / penalty)
    else:  # 1e-300 or 1e300 round to 0 or inf in float32: 0/0 and inf*0 would be NaN
        wide = row.double()
        penalised = torch.where(row < 0, wide * penalty, wide / penalty)
    penalised = penalised.clamp(-_FLOAT32_MAX, _FLOAT32_MAX).to(row.dtype)
    return torch.where(seen, penalised, row)


def apply_temperature(row: torch.Tensor, temperature: float) -> torch.Tensor:
    """row / temperature. Where that leaves the float32 range (a temperature near 0 or past
    float32's largest), (row - max) / temperature in float64 instead: the top logits stay
    finite (0 at the max) and the rest may fall to -inf, so a tiny temperature is an argmax
    over the top logits and a huge one a uniform draw over the kept ids. Ordinary
    temperatures keep the plain division's bits."""
    out = row / temperature
    if bool(torch.isnan(out).any()) or bool((torch.isinf(out) & torch.isfinite(row)).any()):
        wide = row.double()
        out = ((wide - wide.max()) / temperature).to(row.dtype)
    return out


def drop_padded(row: torch.Tensor, tokenizer_vocab: int) -> torch.Tensor:
    """Ids >= tokenizer_vocab (padded embedding rows) can never be chosen."""
    if tokenizer_vocab >= row.shape[0]:
        return row
    out = row.clone()
    out[tokenizer_vocab:] = _NEG_INF
    return out


def top_k_filter(row: torch.Tensor, k: int) -> torch.Tensor:
    """Keep every id whose logit is >= the k-th largest (ties at the edge all survive)."""
    if k <= 0 or k >= row.shape[0]:
        return row
    kth = torch.topk(row, k).values[-1]
    return row.masked_fill(row < kth, _NEG_INF)


def top_p_filter(row: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the most probable ids until their mass reaches p (the top id always stays)."""
    if p >= 1.0:
        return row
    log_total = torch.logsumexp(row, dim=0)
    num_ids = row.shape[0]
    k = min(num_ids, _TOP_P_FIRST_K)
    while True:  # a full sort is slow; the mass usually lies in the first few hundred ids
        values, ids = torch.topk(row, k)  # descending
        probs = torch.exp(values - log_total)
        mass = torch.cumsum(probs, dim=0)
        if k == num_ids or bool(mass[-1] >= p):
            break
        k = min(num_ids, k * 8)
    below = (mass - probs) < p  # mass of strictly more probable ids below p
    below[0] = True  # the top id, also where p rounds to 0 in float32 (p = 1e-300)
    keep = ids[below]
    out = torch.full_like(row, _NEG_INF)
    out[keep] = row[keep]
    return out


def min_p_filter(row: torch.Tensor, p: float) -> torch.Tensor:
    """Drop ids whose probability is below p times the top probability."""
    if p <= 0.0:
        return row
    probs = torch.softmax(row, dim=0)
    return row.masked_fill(probs < p * probs.max(), _NEG_INF)


def apply_penalties_and_filters(
    row: torch.Tensor, params: SamplingParams, seen: torch.Tensor, tokenizer_vocab: int
) -> torch.Tensor:
    """The row a token is drawn from: penalised, padded ids dropped, and, unless greedy,
    divided by the temperature and filtered. Does not modify `row`."""
    out = drop_padded(repetition_penalty(row, seen, params.repetition_penalty), tokenizer_vocab)
    if params.greedy:
        return out
    out = apply_temperature(out, params.temperature)
    out = top_k_filter(out, params.top_k)
    out = top_p_filter(out, params.top_p)
    return min_p_filter(out, params.min_p)


def greedy_token(row: torch.Tensor) -> int:
    """The id of the largest logit; on ties the lowest id."""
    # Both return the first maximal index, i.e. the lowest id, and the first NaN's index when
    # there is one. On the CPU numpy's argmax reads a 49K row in ~8 us, torch's in ~45 us: at
    # 8 lanes with drafts a round samples tens of rows.
    if row.device.type == "cpu" and row.dtype == torch.float32:
        values = row.numpy()
        token = int(values.argmax())
        nan = bool(np.isnan(values[token]))  # a numpy scalar: two torch ops fewer a sampled row
    else:
        token = int(torch.argmax(row).item())
        nan = bool(torch.isnan(row[token]))
    if nan:
        raise RuntimeError("logits row contains NaN")
    return token


def pick_token(row: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw over the ids in ascending order: the id whose cumulative
    probability interval holds u in [0, 1). Filtered (-inf) ids have empty intervals."""
    probs = torch.softmax(row, dim=0)
    cdf = torch.cumsum(probs.double(), dim=0)
    total = cdf[-1]
    if not bool(torch.isfinite(total)) or not bool(total > 0):
        raise RuntimeError("logits row has no finite probability mass")
    target = (total * u).reshape(1)
    pos = int(torch.searchsorted(cdf, target, right=True).item())
    if pos >= row.shape[0] or not bool(probs[pos] > 0):
        pos = int(torch.nonzero(probs).flatten()[-1].item())  # u * total rounded up to total
    return pos


def token_logprob(row: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """`token`'s log-probability under the fp32 row, and the k most likely (id, logprob),
    ties to the lowest id."""
    logprobs = torch.log_softmax(row.float(), dim=0)
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        # A stable descending sort orders ties by id; topk's tie order is unspecified.
        values, ids = torch.sort(logprobs, descending=True, stable=True)
        top = tuple((int(i), float(v)) for i, v in zip(ids[:k].tolist(), values[:k].tolist()))
    return TokenLogprob(float(logprobs[token]), top)


class LaneSampler:
    """Sampling state of one stream: params, its seed, repetition history.

    The stream's first generated token sits at `first_position` (the history's length: the
    history is the prompt)."""

    def __init__(
        self,
        params: SamplingParams,
        history: Sequence[int],
        *,
        vocab_size: int,
        tokenizer_vocab: int,
        device: torch.device,
        constraint: Any = None,
    ) -> None:
        validate_params(params)
        if not 0 < tokenizer_vocab <= vocab_size:
            raise ValueError(f"tokenizer_vocab {tokenizer_vocab} not in (0, {vocab_size}]")
        self.params = params
        self.constraint = constraint  # gpu.constrain.GrammarMask, or None
        self.vocab_size = vocab_size
        self.tokenizer_vocab = tokenizer_vocab
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.first_position = len(history)
        self.last_logprob: TokenLogprob | None = None  # of the last sampled token, when params.logprobs is set
        self._seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        # on the CPU a token is recorded through numpy's view of the same memory: a torch index
        # assignment was a sixth of a one-lane decode round's host work
        self._seen_host = self._seen.numpy() if self._seen.device.type == "cpu" else None
        if history:
            ids = torch.tensor(list(history), dtype=torch.long)
            if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
                raise ValueError(f"history holds an id outside [0, {vocab_size})")
            self._seen[ids.to(device)] = True

    def sample(self, logits: torch.Tensor, position: int) -> int:
        """Choose the token at absolute `position` (the row after the one that gave `logits`)
        from one (vocab_size,) float32 row, and record it in the repetition history. The draw
        depends on (seed, position) only: sampling a position again gives the same token for
        the same row and history."""
        if logits.shape != (self.vocab_size,):
            raise ValueError(f"logits shape {tuple(logits.shape)} != ({self.vocab_size},)")
        u = position_uniform(self.seed, position)
        raw = logits
        if self.constraint is not None:  # first: the filters then only see ids the grammar allows
            logits = self.constraint.apply(logits)
        row = apply_penalties_and_filters(logits, self.params, self._seen, self.tokenizer_vocab)
        token = greedy_token(row) if self.params.greedy else pick_token(row, u)
        if self.params.logprobs is not None:
            self.last_logprob = token_logprob(raw, token, self.params.logprobs)
        self.observe(token)
        return token

    @property
    def greedy_alone(self) -> bool:
        """Whether this lane's token is the greedy pick of its raw row below `tokenizer_vocab`
        and nothing else of the row is needed (no penalty, grammar or logprobs): what
        `take_pick` takes from a pick made elsewhere (the head's call, `cpu_kernels.head_picks`)."""
        p = self.params
        return p.greedy and p.repetition_penalty == 1.0 and self.constraint is None and p.logprobs is None

    def take_pick(self, token: int) -> int:
        """`sample`'s result for a `greedy_alone` lane whose row's pick, `token`, was made
        elsewhere: recorded in the history as `sample` records it."""
        self.observe(token)
        return token

    def observe(self, token: int) -> None:
        """Add a token chosen elsewhere (e.g. an accepted draft) to the repetition history."""
        if not 0 <= token < self.vocab_size:
            raise ValueError(f"token {token} outside [0, {self.vocab_size})")
        if self._seen_host is not None:
            self._seen_host[token] = True
        else:
            self._seen[token] = True
        if self.constraint is not None:
            self.constraint.advance(token)

    def verify(self, rows: torch.Tensor, drafts: Sequence[int], position: int) -> list[int]:
        """Sample verify rows: `rows` (1 + k, vocab_size) are the logits after the last accepted
        token and after each of the k `drafts`; `position` is where the first sampled token
        goes. Row i is sampled only while every earlier sampled token equalled its draft, so
        the repetition history never holds a rejected draft. Returns the accepted drafts plus
        one more token (the first that differed, or the token after the last draft): exactly
        what sampling the positions one round at a time gives."""
        if rows.shape[0] != len(drafts) + 1:
            raise ValueError(f"{rows.shape[0]} verify rows for {len(drafts)} drafts")
        out: list[int] = []
        for i in range(rows.shape[0]):
            token = self.sample(rows[i], position + i)
            out.append(token)
            if i == len(drafts) or token != drafts[i]:
                break
        return out
