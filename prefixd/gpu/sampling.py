"""Per-lane token sampling: penalties, filters, and a seeded inverse-CDF draw.

A lane's sampler is independent of every other lane: it owns its generator and draws
exactly one uniform number per `sample()` call, whatever the round holds, so a seeded
stream gives the same tokens alone, beside other lanes, or interleaved in any order.

Processing order for one logits row (the same order transformers applies them):

    repetition penalty -> drop padded ids -> greedy argmax
                                          -> temperature -> top-k -> top-p -> min-p -> draw

The draw walks the cumulative distribution in id order with one uniform number u, so a
token depends only on the row and u.

The filter functions are pure (row in, new row out; removed ids become -inf) so each can
be checked on its own against hand-made logits or a reference implementation.
"""

from __future__ import annotations

import secrets
from typing import Any, Sequence

import torch

from prefixd.scheduler.records import SamplingParams, TokenLogprob

_NEG_INF = float("-inf")
_MAX_SEED = 2**64  # torch.Generator.manual_seed accepts [0, 2**64)
_TOP_P_FIRST_K = 256


def validate_params(params: SamplingParams) -> None:
    """Raise ValueError when a field is outside its meaningful range."""
    if params.top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {params.top_k}")
    if not 0.0 < params.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
    if not 0.0 <= params.min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {params.min_p}")
    if not params.repetition_penalty > 0.0:
        raise ValueError(f"repetition_penalty must be > 0, got {params.repetition_penalty}")
    if params.seed is not None and not 0 <= params.seed < _MAX_SEED:
        raise ValueError(f"seed must be in [0, 2**64), got {params.seed}")


def repetition_penalty(row: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """Penalise ids where `seen` (bool, same length as `row`) is set.

    A positive logit is divided by `penalty`, a negative one multiplied (each id once,
    however often it occurred).
    """
    if penalty == 1.0:
        return row
    penalised = torch.where(row < 0, row * penalty, row / penalty)
    return torch.where(seen, penalised, row)


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
    keep = ids[(mass - probs) < p]  # mass of strictly more probable ids below p
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
    out = out / params.temperature
    out = top_k_filter(out, params.top_k)
    out = top_p_filter(out, params.top_p)
    return min_p_filter(out, params.min_p)


def greedy_token(row: torch.Tensor) -> int:
    """The id of the largest logit; on ties the lowest id."""
    # torch.argmax returns the first maximal index (documented), i.e. the lowest id.
    token = int(torch.argmax(row).item())
    if torch.isnan(row[token]):
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
    """Sampling state of one stream: params, a private generator, repetition history."""

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
        # A CPU generator: the uniform stream of a seed is the same on every device.
        self._generator = torch.Generator(device="cpu")
        self._generator.manual_seed(self.seed)
        self.num_draws = 0
        self.last_logprob: TokenLogprob | None = None  # of the last sampled token, when params.logprobs is set
        self._seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        if history:
            ids = torch.tensor(list(history), dtype=torch.long)
            if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
                raise ValueError(f"history holds an id outside [0, {vocab_size})")
            self._seen[ids.to(device)] = True

    def sample(self, logits: torch.Tensor) -> int:
        """Choose the next token from one (vocab_size,) float32 row; records it in the
        history and advances the generator by exactly one draw."""
        if logits.shape != (self.vocab_size,):
            raise ValueError(f"logits shape {tuple(logits.shape)} != ({self.vocab_size},)")
        u = float(torch.rand((), generator=self._generator, dtype=torch.float64).item())
        raw = logits
        self.num_draws += 1
        if self.constraint is not None:  # first: the filters then only see ids the grammar allows
            logits = self.constraint.apply(logits)
        row = apply_penalties_and_filters(logits, self.params, self._seen, self.tokenizer_vocab)
        token = greedy_token(row) if self.params.greedy else pick_token(row, u)
        if self.params.logprobs is not None:
            self.last_logprob = token_logprob(raw, token, self.params.logprobs)
        self.observe(token)
        return token

    def observe(self, token: int) -> None:
        """Add a token chosen elsewhere (e.g. an accepted draft) to the repetition history."""
        if not 0 <= token < self.vocab_size:
            raise ValueError(f"token {token} outside [0, {self.vocab_size})")
        self._seen[token] = True
        if self.constraint is not None:
            self.constraint.advance(token)
