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

from prefixd.gpu import kernels

CHUNK = 16  # rows per UT block of the chunked form; fixed so its bits never depend on T
GROUP = 8  # blocks computed together by the chunked form


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
    return x * torch.rsqrt(kernels.sum_dim(x * x, -1).unsqueeze(-1) + eps)


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


def _to_blocks(x: torch.Tensor, out: torch.Tensor) -> None:
    """Rows (T, H, ...) into blocks `out` (n, H, C, ...), zero rows after the last one."""
    num_rows, size = x.shape[0], out.shape[2]
    full = num_rows // size
    if full:
        out[:full].copy_(x[:full * size].unflatten(0, (full, size)).transpose(1, 2))
    rem = num_rows - full * size
    if rem:
        out[full, :, :rem].copy_(x[full * size:].transpose(0, 1))
        out[full, :, rem:].zero_()


def _from_blocks(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """Blocks (n, H, C, ...) back into rows `out` (T, H, ...), dropping the padding rows."""
    num_rows, size = out.shape[0], blocks.shape[2]
    full = num_rows // size
    if full:
        out[:full * size].unflatten(0, (full, size)).copy_(blocks[:full].transpose(1, 2))
    rem = num_rows - full * size
    if rem:
        out[full * size:].copy_(blocks[full, :, :rem].transpose(0, 1))


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
            beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked form over T rows of one lane, starting from `state`.

    q, k: (T, Hv, dk) float32, already L2-normalized (q also scaled by dk^-0.5) and expanded
    to the value heads; v: (T, Hv, dv) float32; g, beta: (T, Hv) float32; state:
    (Hv, dk, dv) float32. Returns (out (T, Hv, dv) float32, new state). Blocks of CHUNK rows
    are counted from row 0 of this call, the last one padded with zero rows (k = 0,
    beta = 0, g = 0 write nothing and decay nothing). The gates of all blocks are computed
    at once, the rest GROUP blocks at a time (temporaries stay cache-sized); only the state
    hand-over runs block by block. On CPU the library products (bmm, the triangular solve) run
    on one thread, so the bits never depend on the thread count in use (kernels.one_thread).
    """
    if q.is_cuda:
        return _chunked(q, k, v, g, beta, state)
    return kernels.one_thread(_chunked, q, k, v, g, beta, state)


def _chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    num_rows, heads, dk = k.shape
    out = v.new_empty(v.shape)
    if num_rows == 0:
        return out, state
    num_blocks = -(-num_rows // CHUNK)
    gates = _Gates(g, beta, num_blocks)
    ws = _Workspace(min(GROUP, num_blocks), heads, dk, v.shape[-1], q.device)
    state = state.clone()  # updated in place block by block
    for first in range(0, num_blocks, GROUP):
        lo, hi = first * CHUNK, (first + GROUP) * CHUNK
        _group(q[lo:hi], k[lo:hi], v[lo:hi], gates.slice(first, first + GROUP), state, out[lo:hi], ws)
    return out, state


class _Gates:
    """Decay factors and write strengths of every block, (n, H, ...) float32."""

    def __init__(self, g: torch.Tensor, beta: torch.Tensor, num_blocks: int) -> None:
        heads, size = g.shape[1], CHUNK
        both = torch.empty(num_blocks, heads, size, 2, dtype=torch.float32, device=g.device)
        _to_blocks(torch.stack([g, beta], dim=-1), both)
        gc = both[..., 0].cumsum(dim=-1)  # (n, H, C) log-decay since the block start
        above = torch.ones(size, size, dtype=torch.bool, device=g.device).triu(1)
        # decay between rows j <= i; masked before exp so no inf ever appears
        self.decay = (gc.unsqueeze(-1) - gc.unsqueeze(-2)).masked_fill_(above, float("-inf")).exp_()
        self.beta_rows = both[..., 1:]  # (n, H, C, 1)
        self.beta_cols = both[..., 1].unsqueeze(-2)  # (n, H, 1, C)
        last = gc[..., -1:]
        self.from_start = gc.exp().unsqueeze(-1)  # (n, H, C, 1): decay since the block start
        self.to_end = (last - gc).exp().unsqueeze(-1)  # (n, H, C, 1): decay to the block end
        self.block = last.exp().unsqueeze(-1)  # (n, H, 1, 1): decay over the whole block

    def slice(self, lo: int, hi: int) -> _Gates:
        part = object.__new__(_Gates)
        for name, value in vars(self).items():
            setattr(part, name, value[lo:hi])
        return part


class _Workspace:
    """Buffers for up to `blocks` blocks, reused by every group of one call (fresh memory
    costs a page fault per page on first touch)."""

    def __init__(self, blocks: int, heads: int, dk: int, dv: int, device: torch.device) -> None:
        f32 = {"dtype": torch.float32, "device": device}
        size = CHUNK
        self.kq = torch.empty(blocks, heads, 2 * size, dk, **f32)  # [k; q] per block
        self.v = torch.empty(blocks, heads, size, dv, **f32)
        self.mix = torch.empty(blocks, heads, 2 * size, size, **f32)
        self.k_scaled = torch.empty(blocks, heads, size, dk, **f32)
        self.u = torch.empty(blocks, heads, 2 * size, dv, **f32)
        self.w = torch.empty(blocks, heads, 2 * size, dk, **f32)
        self.k_tail = torch.empty(blocks, heads, size, dk, **f32)
        self.eye = torch.eye(size, **f32)


def _bmm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """a @ b over leading dims (n, H) into `out` (contiguous), as one batched product."""
    torch.bmm(a.flatten(0, 1), b.flatten(0, 1), out=out.view(-1, *out.shape[2:]))
    return out


def _group(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: _Gates,
           state: torch.Tensor, out: torch.Tensor, ws: _Workspace) -> None:
    """`chunked` over at most GROUP blocks: writes `out` (T, H, dv), updates `state` in place.

    Per block, with D the causal decay matrix, A = (k k^T * D) beta-scaled by rows and
    inv = (I + strictly_lower(A))^-1 beta-scaled by columns:
        u = inv v, w = inv (k * exp(gc))          (value to write, old-state prediction)
        v_new = u - w S, out = q_dec S + (q k^T * D) v_new
              = (attn u) + (q_dec - attn w) S     (so one product with S gives both)
    """
    size, num_blocks = CHUNK, gates.block.shape[0]
    kq, vb = ws.kq[:num_blocks], ws.v[:num_blocks]
    kb, qb = kq[:, :, :size], kq[:, :, size:]
    for x, blocks in ((k, kb), (q, qb), (v, vb)):
        _to_blocks(x, blocks)
    mix = _bmm(kq, kb.transpose(-1, -2), ws.mix[:num_blocks])  # [k k^T; q k^T], then * D
    mix.unflatten(2, (2, size)).mul_(gates.decay.unsqueeze(2))
    ut = mix[:, :, :size].mul_(gates.beta_rows)  # only its strictly-lower part is used
    inv = torch.linalg.solve_triangular(ut, ws.eye.expand_as(ut), upper=False, unitriangular=True)
    ut.copy_(ws.eye)  # mix = [I; attn]: the products below give both halves
    mix = mix @ inv.mul_(gates.beta_cols)  # (n, H, 2C, C): [inv; attn inv]
    u = _bmm(mix, vb, ws.u[:num_blocks])  # (n, H, 2C, dv): [u; attn u]
    w = _bmm(mix, torch.mul(kb, gates.from_start, out=ws.k_scaled[:num_blocks]), ws.w[:num_blocks])
    w[:, :, size:].addcmul_(qb, gates.from_start, value=-1.0)  # (n, H, 2C, dk): [w; attn w - q_dec]
    k_tail = torch.mul(kb, gates.to_end, out=ws.k_tail[:num_blocks]).transpose(-1, -2)
    for u_i, w_i, v_new, k_i, decay in zip(u.unbind(), w.unbind(), u[:, :, :size].unbind(),
                                          k_tail.unbind(), gates.block.unbind()):
        u_i.baddbmm_(w_i, state, alpha=-1.0)  # [v_new; out] of block i
        state.mul_(decay).baddbmm_(k_i, v_new)
    _from_blocks(u[:, :, size:], out)


def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
         beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One row per lane, batched: q, k: (B, Hv, dk); v: (B, Hv, dv); g, beta: (B, Hv);
    state: (B, Hv, dk, dv). Returns (out (B, Hv, dv), new state); all float32.

    Element-wise products and sums over dk only, so a lane's bits do not depend on B.
    """
    state = state * g.exp()[..., None, None]
    read = kernels.sum_dim(state * k.unsqueeze(-1), -2)  # (B, Hv, dv) = k^T S
    delta = (v - read) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    out = kernels.sum_dim(state * q.unsqueeze(-1), -2)
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
