"""Gated DeltaNet math: chunked and step forms, causal conv, and what is bit-exact."""

from __future__ import annotations

import pytest
import torch

from prefixd.gpu.families import gdn

HV, DK, DV = 4, 16, 8


def _inputs(rows: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = gdn.l2_normalize(torch.randn(rows, HV, DK, generator=gen)) * DK ** -0.5
    k = gdn.l2_normalize(torch.randn(rows, HV, DK, generator=gen))
    v = torch.randn(rows, HV, DV, generator=gen)
    g = -2.0 * torch.rand(rows, HV, generator=gen)
    beta = torch.rand(rows, HV, generator=gen)
    state = 0.1 * torch.randn(HV, DK, DV, generator=gen)
    return q, k, v, g, beta, state


def _naive(q, k, v, g, beta, state):
    """The recurrence written per head with explicit matrix products (float64)."""
    s = state.double().clone()
    outs = []
    for t in range(q.shape[0]):
        s = s * g[t].double().exp()[:, None, None]
        kt, vt = k[t].double(), v[t].double()
        read = torch.einsum("hk,hkv->hv", kt, s)
        s = s + torch.einsum("hk,hv->hkv", kt, (vt - read) * beta[t].double()[:, None])
        outs.append(torch.einsum("hk,hkv->hv", q[t].double(), s))
    return torch.stack(outs), s


@pytest.mark.parametrize("rows", [1, 5, 63, 64, 65, 150, gdn.CHUNK * gdn.GROUP * 2 + 7])
def test_chunked_and_step_forms_compute_the_gated_delta_rule(rows: int) -> None:
    q, k, v, g, beta, state = _inputs(rows)
    want_out, want_state = _naive(q, k, v, g, beta, state)
    out_c, state_c = gdn.chunked(q, k, v, g, beta, state)
    out_s, states_s = gdn.steps(q, k, v, g, beta, state)
    for out, final in ((out_c, state_c), (out_s, states_s[-1])):
        torch.testing.assert_close(out.double(), want_out, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(final.double(), want_state, atol=2e-5, rtol=1e-5)


def test_chunked_and_step_forms_differ_in_bits() -> None:
    """Why the family has invariant_rows = False: decoded rows are not prefilled rows."""
    q, k, v, g, beta, state = _inputs(96, seed=3)
    out_c, state_c = gdn.chunked(q, k, v, g, beta, state)
    out_s, states_s = gdn.steps(q, k, v, g, beta, state)
    assert not torch.equal(out_c, out_s)
    assert not torch.equal(state_c, states_s[-1])


def test_chunked_call_is_reproducible_and_split_calls_compose() -> None:
    q, k, v, g, beta, state = _inputs(130, seed=4)
    out_a, state_a = gdn.chunked(q, k, v, g, beta, state)
    out_b, state_b = gdn.chunked(q, k, v, g, beta, state.clone())
    assert torch.equal(out_a, out_b) and torch.equal(state_a, state_b)
    # a schedule 0..70, 70..130 run twice gives the same bits both times
    runs = []
    for _ in range(2):
        o1, s1 = gdn.chunked(q[:70], k[:70], v[:70], g[:70], beta[:70], state)
        o2, s2 = gdn.chunked(q[70:], k[70:], v[70:], g[70:], beta[70:], s1)
        runs.append((torch.cat([o1, o2]), s2))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    torch.testing.assert_close(runs[0][0], out_a, atol=2e-6, rtol=1e-5)


def test_step_bits_do_not_depend_on_the_batch() -> None:
    lanes = [_inputs(1, seed=10 + i) for i in range(8)]
    batched = [torch.cat([lane[j] for lane in lanes]) for j in range(5)]
    states = torch.stack([lane[5] for lane in lanes])
    out_b, state_b = gdn.step(*batched, states)
    for i, lane in enumerate(lanes):
        out_1, state_1 = gdn.step(*lane[:5], lane[5].unsqueeze(0))
        assert torch.equal(out_1[0], out_b[i]) and torch.equal(state_1[0], state_b[i])


def test_steps_record_the_state_after_every_row() -> None:
    q, k, v, g, beta, state = _inputs(5, seed=5)
    _, states = gdn.steps(q, k, v, g, beta, state)
    for j in range(1, 6):
        _, prefix_states = gdn.steps(q[:j], k[:j], v[:j], g[:j], beta[:j], state)
        assert torch.equal(states[j - 1], prefix_states[-1])


@pytest.mark.parametrize("taps", [2, 3, 4])
def test_causal_conv_row_bits_do_not_depend_on_chunking(taps: int) -> None:
    gen = torch.Generator().manual_seed(taps)
    x = torch.randn(40, 12, generator=gen)
    weight = torch.randn(12, taps, generator=gen)
    zero = torch.zeros(taps - 1, 12)
    whole, state_whole = gdn.causal_conv(x, zero, weight)
    pieces, state = [], zero
    for lo, hi in ((0, 1), (1, 7), (7, 8), (8, 40)):
        out, state = gdn.causal_conv(x[lo:hi], state, weight)
        pieces.append(out)
    assert torch.equal(torch.cat(pieces), whole)
    assert torch.equal(state, state_whole)
    assert torch.equal(state_whole, x[-(taps - 1):])
    # reference: zero-padded depthwise conv1d followed by SiLU
    ref = torch.nn.functional.conv1d(x.T.unsqueeze(0), weight.unsqueeze(1), padding=taps - 1,
                                     groups=12)[0, :, :40].T
    torch.testing.assert_close(whole, torch.nn.functional.silu(ref), atol=1e-6, rtol=1e-5)


def test_conv_states_after_rows_are_the_sliding_windows() -> None:
    x = torch.arange(12.0).view(4, 3)
    start = -torch.ones(2, 3)
    windows = gdn.conv_states_after_rows(x, start)
    for j in range(4):
        _, state = gdn.causal_conv(x[:j + 1], start, torch.ones(3, 3))
        assert torch.equal(windows[j], state)


@pytest.mark.slow
def test_forms_match_transformers_reference_functions() -> None:
    from transformers.models.qwen3_5 import modeling_qwen3_5 as ref

    gen = torch.Generator().manual_seed(7)
    rows, hk = 100, 2
    q, k = torch.randn(1, rows, hk, DK, generator=gen), torch.randn(1, rows, hk, DK, generator=gen)
    v = torch.randn(1, rows, HV, DV, generator=gen)
    g, beta = -torch.rand(1, rows, HV, generator=gen), torch.rand(1, rows, HV, generator=gen)
    state = 0.1 * torch.randn(1, HV, DK, DV, generator=gen)
    want, want_state = ref.torch_chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ours_q = (gdn.l2_normalize(q[0]) * DK ** -0.5).repeat_interleave(HV // hk, dim=1)
    ours_k = gdn.l2_normalize(k[0]).repeat_interleave(HV // hk, dim=1)
    out, final = gdn.chunked(ours_q, ours_k, v[0], g[0], beta[0], state[0])
    torch.testing.assert_close(out, want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, want_state[0], atol=1e-5, rtol=1e-5)
    want_s, want_state_s = ref.torch_recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    out_s, states = gdn.steps(ours_q, ours_k, v[0], g[0], beta[0], state[0])
    torch.testing.assert_close(out_s, want_s[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states[-1], want_state_s[0], atol=1e-5, rtol=1e-5)
