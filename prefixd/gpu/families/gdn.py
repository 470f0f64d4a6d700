"""Gated DeltaNet math: the causal depthwise conv, the chunked (prefill) form and the step
(decode) form of the gated delta rule, for one lane at a time.

Per value head the recurrent state S is a (dk, dv) float32 matrix. For each row t:

    S <- S * exp(g_t)                           # decay (g_t <= 0, log space)
    S <- S + k_t (beta_t (v_t - k_t^T S))^T     # delta-rule write
    o_t = q_t^T S

The chunked form computes the same recurrence CHUNK rows at a time with a unit-lower-
triangular (UT) inverse inside each block. Blocks are counted from the first row of the
call and padded to exactly CHUNK rows, and every lane runs alone, so a prefill chunk's bits
depend only on its own rows and the state at its start, never on the other lanes in the
round. The two forms agree to rounding, not to the bit (see docs/runtime.md, Hybrid).
"""

from __future__ import annotations

import torch

CHUNK = 32  # rows per UT block of the chunked form; fixed so its bits never depend on T
GROUP = 16  # blocks computed together by the chunked form


# torch's fused silu/sigmoid/softplus compute vector tails with other code (other bits), so a
# row's value would depend on the tensor's size: build them from exp/log1p/div, which do not.
def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) in float32, bit-identical for an element whatever the tensor's shape."""
    xf = x.float()
    return xf / (1.0 + torch.exp(-xf))


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)) in float32 (shape-independent bits)."""
    return 1.0 / (1.0 + torch.exp(-x.float()))


def softplus(x: torch.Tensor) -> torch.Tensor:
    """log(1 + exp(x)), x itself above 20 (as torch's threshold), float32, shape-independent."""
    xf = x.float()
    return torch.where(xf > 20.0, xf, torch.log1p(torch.exp(xf)))


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (float32 in, float32 out)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-decay g = -exp(A_log) * softplus(a + dt_bias) and write strength beta = sigmoid(b).

    a, b: (T, Hv) in any dtype; returns two float32 (T, Hv) tensors.
    """
    g = -a_log.float().exp() * softplus(a.float() + dt_bias.float())
    return g, sigmoid(b)


def causal_conv(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU over new rows, continuing from `conv_state`.

    x: (..., T, C) new inputs; conv_state: (..., K-1, C) the previous K-1 inputs (zeros at
    start); weight: (C, K). Returns (out (..., T, C) in x's dtype, new conv state). Taps are
    summed one by one in a fixed order, so a row's bits depend only on its K inputs (the same
    in the chunked and the step form, alone or batched with other lanes).
    """
    num_taps = weight.shape[1]
    num_rows = x.shape[-2]
    window = torch.cat([conv_state.to(torch.float32), x.to(torch.float32)], dim=-2)
    w = weight.to(torch.float32)
    acc = window[..., 0:num_rows, :] * w[:, 0]
    for j in range(1, num_taps):
        acc = acc + window[..., j:j + num_rows, :] * w[:, j]
    new_state = window[..., num_rows:, :].to(conv_state.dtype)  # the last K-1 inputs
    return silu(acc).to(x.dtype), new_state


def conv_states_after_rows(x: torch.Tensor, conv_state: torch.Tensor) -> torch.Tensor:
    """Conv state after each row of x: (T, K-1, C), row j = the K-1 inputs ending at row j."""
    keep = conv_state.shape[0]
    window = torch.cat([conv_state, x.to(conv_state.dtype)], dim=0)
    return torch.stack([window[j + 1:j + 1 + keep] for j in range(x.shape[0])])


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x
    pad = x.new_zeros((rows - x.shape[0], *x.shape[1:]))
    return torch.cat([x, pad], dim=0)


_BLOCK = 16  # sub-block of the UT inverse: substitution inside, matmuls across


def _unit_lower_inverse(ut: torch.Tensor) -> torch.Tensor:
    """(I + strictly_lower(ut))^-1 for a batch of (C, C) blocks (batched triangular solves
    are slow on small blocks). Diagonal 16x16 blocks are inverted by forward substitution,
    the blocks below them by block forward substitution:
    X_ij = -X_ii (sum_{k<i} L_ik X_kj)."""
    size = ut.shape[-1]
    lower = ut.tril(-1)
    inv = torch.zeros_like(ut)
    eye = torch.eye(_BLOCK, dtype=ut.dtype, device=ut.device)
    for lo in range(0, size, _BLOCK):
        hi = lo + _BLOCK
        block = -lower[..., lo:hi, lo:hi]
        for i in range(1, _BLOCK):
            row = block[..., i:i + 1, :i].clone()
            block[..., i:i + 1, :i] = row + row @ block[..., :i, :i]
        inv[..., lo:hi, lo:hi] = block + eye
        if lo:
            below = lower[..., lo:hi, :lo] @ inv[..., :lo, :lo]
            inv[..., lo:hi, :lo] = -(inv[..., lo:hi, lo:hi] @ below)
    return inv


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
            beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked form over T rows of one lane, starting from `state`.

    q, k: (T, Hv, dk) float32, already L2-normalized (q also scaled by dk^-0.5) and expanded
    to the value heads; v: (T, Hv, dv) float32; g, beta: (T, Hv) float32; state:
    (Hv, dk, dv) float32. Returns (out (T, Hv, dv) float32, new state). Blocks of CHUNK rows
    are counted from row 0 of this call, the last one padded with zero rows (k = 0,
    beta = 0, g = 0 write nothing and decay nothing). GROUP blocks at a time are computed
    together (temporaries stay cache-sized); only the state hand-over runs block by block.
    """
    if q.shape[0] == 0:
        return v.new_zeros(v.shape), state
    outs = []
    step_rows = CHUNK * GROUP
    for lo in range(0, q.shape[0], step_rows):
        hi = lo + step_rows
        out, state = _blocks(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], state)
        outs.append(out)
    return torch.cat(outs) if len(outs) > 1 else outs[0], state


def _blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
            beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunked` over at most GROUP blocks, computed together."""
    num_rows, heads, dk = k.shape
    num_blocks = -(-num_rows // CHUNK)
    padded = num_blocks * CHUNK

    def blocks(x: torch.Tensor) -> torch.Tensor:  # (T, H, ...) -> (n, H, C, ...) contiguous
        x = _pad_rows(x, padded).reshape(num_blocks, CHUNK, heads, *x.shape[2:])
        return x.transpose(1, 2).contiguous()

    q, k, v, g, beta = (blocks(t) for t in (q, k, v, g, beta))
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    gc = g.cumsum(dim=-1)  # (n, H, C)
    # decay between rows j <= i; masked before exp so no inf ever appears
    decay = (gc.unsqueeze(-1) - gc.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    k_t = k.transpose(-1, -2).contiguous()  # (n, H, dk, C)
    # beta scales rows of the UT matrix and columns of its inverse: no (C, d)-sized products
    ut = (k @ k_t) * decay * beta.unsqueeze(-1)  # only its strictly-lower part is used
    inv = _unit_lower_inverse(ut)
    gc_exp = gc.exp()
    u = (inv * beta.unsqueeze(-2)) @ v  # (n, H, C, dv): values to write
    w = (inv * (beta * gc_exp).unsqueeze(-2)) @ k  # what the old state predicts for them
    q_decayed = q * gc_exp.unsqueeze(-1)
    attn = (q @ k_t) * decay  # (n, H, C, C), diagonal included
    last = gc[..., -1:]  # (n, H, 1)
    k_tail = k_t * (last - gc).exp().unsqueeze(-2)  # (n, H, dk, C)
    block_decay = last.exp().unsqueeze(-1)  # (n, H, 1, 1)
    out = torch.empty_like(u)
    for i in range(num_blocks):
        v_new = torch.baddbmm(u[i], w[i], state, alpha=-1.0)
        torch.matmul(q_decayed[i], state, out=out[i])
        out[i].baddbmm_(attn[i], v_new)
        state = (state * block_decay[i]).baddbmm_(k_tail[i], v_new)  # a new tensor, then in place
    out = out.transpose(1, 2).reshape(padded, heads, -1)[:num_rows]
    return out, state


def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
         beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One row per lane, batched: q, k: (B, Hv, dk); v: (B, Hv, dv); g, beta: (B, Hv);
    state: (B, Hv, dk, dv). Returns (out (B, Hv, dv), new state); all float32.

    Element-wise products and sums over dk only, so a lane's bits do not depend on B.
    """
    state = state * g.exp()[..., None, None]
    read = (state * k.unsqueeze(-1)).sum(dim=-2)  # (B, Hv, dv) = k^T S
    delta = (v - read) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    out = (state * q.unsqueeze(-1)).sum(dim=-2)
    return out, state


def steps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
          beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Step form over T rows of one lane, keeping every intermediate state.

    Shapes as in `chunked`. Returns (out (T, Hv, dv), states (T, Hv, dk, dv)) where
    states[j] is the state after row j: the rollback record of a 1+k-row verify.
    """
    outs, states = [], []
    for t in range(q.shape[0]):
        out, state = step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1],
                          state.unsqueeze(0))
        state = state.squeeze(0)
        outs.append(out[0])
        states.append(state)
    return torch.stack(outs), torch.stack(states)
