"""The plain-torch reference for the CUDA rows of bench/runtime.py: what torch alone reaches on
the default model's shape, so that every GPU ratio is taken on one machine in one run.

A llama of SmolLM2-135M's shape (30 layers, hidden 576, 9 query / 3 KV heads of 64, MLP 1536,
vocab 49152, tied embeddings), random bf16 weights, written as ordinary torch ops over a static
KV cache of one slot per lane: prefill with torch's SDPA (causal), and one greedy decode step
run eagerly and captured in one CUDA graph. Nothing here is exact or paged: it is the speed a
user gets for free, not a design to follow.

    python bench/torch_reference.py        # CUDA only; prints two markdown tables
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB = 30, 576, 9, 3, 64, 1536, 49152
THETA, EPS = 100000.0, 1e-5


class Reference:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        g = torch.Generator(device=device).manual_seed(seed)

        def weight(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, device=device, generator=g) * 0.02).to(torch.bfloat16)

        qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM
        self.layers = [{"qkv": weight(qkv, HIDDEN), "o": weight(HIDDEN, HEADS * HEAD_DIM),
                        "gate_up": weight(2 * MLP, HIDDEN), "down": weight(HIDDEN, MLP)} for _ in range(LAYERS)]
        self.embed = weight(VOCAB, HIDDEN)
        steps = torch.arange(0, HEAD_DIM, 2, device=device, dtype=torch.float32) / HEAD_DIM
        self.inv_freq = 1.0 / THETA ** steps

    @staticmethod
    def norm(x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)).to(torch.bfloat16)

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (..., rows, heads, D) rotated at positions (rows,)."""
        angles = positions.float()[:, None] * self.inv_freq  # (rows, D/2)
        cos = angles.cos()[:, None, :].to(x.dtype)
        sin = angles.sin()[:, None, :].to(x.dtype)
        a, b = x[..., :HEAD_DIM // 2], x[..., HEAD_DIM // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    def _mlp(self, x: torch.Tensor, layer: dict) -> torch.Tensor:
        gate, up = F.linear(self.norm(x), layer["gate_up"]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, layer["down"])

    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of the last of `tokens` (T,), attention by SDPA over the whole prompt."""
        t = tokens.shape[0]
        positions = torch.arange(t, device=self.device)
        x = self.embed[tokens]  # (T, hidden)
        for layer in self.layers:
            q, k, v = F.linear(self.norm(x), layer["qkv"]).split(
                [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
            q = self.rope(q.view(t, HEADS, HEAD_DIM), positions).transpose(0, 1)[None]
            k = self.rope(k.view(t, KV_HEADS, HEAD_DIM), positions).transpose(0, 1)[None]
            v = v.view(t, KV_HEADS, HEAD_DIM).transpose(0, 1)[None]
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + F.linear(a[0].transpose(0, 1).reshape(t, HEADS * HEAD_DIM), layer["o"])
            x = x + self._mlp(x, layer)
        return F.linear(self.norm(x[-1:]), self.embed)

    def decode_step(self, lanes: int, context: int):
        """A step over static buffers: every lane's next token from the one before, at its
        position (all lanes at context - 1), with a KV cache of `context` slots a lane."""
        shape = (lanes, KV_HEADS, context, HEAD_DIM)
        k_cache = [torch.zeros(shape, device=self.device, dtype=torch.bfloat16) for _ in range(LAYERS)]
        v_cache = [torch.zeros(shape, device=self.device, dtype=torch.bfloat16) for _ in range(LAYERS)]
        token = torch.zeros(lanes, dtype=torch.long, device=self.device)
        position = torch.full((lanes,), context - 1, dtype=torch.long, device=self.device)
        visible = (torch.arange(context, device=self.device)[None, :] <= position[:, None])[:, None, None, :]
        slot = position.view(lanes, 1, 1, 1).expand(lanes, KV_HEADS, 1, HEAD_DIM)

        def step() -> None:
            x = self.embed[token]  # (lanes, hidden)
            for i, layer in enumerate(self.layers):
                q, k, v = F.linear(self.norm(x), layer["qkv"]).split(
                    [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
                q = self.rope(q.view(lanes, HEADS, HEAD_DIM), position)[:, :, None]  # (lanes, heads, 1, D)
                k = self.rope(k.view(lanes, KV_HEADS, HEAD_DIM), position)[:, :, None]
                k_cache[i].scatter_(2, slot, k)
                v_cache[i].scatter_(2, slot, v.view(lanes, KV_HEADS, 1, HEAD_DIM))
                a = F.scaled_dot_product_attention(q, k_cache[i], v_cache[i], attn_mask=visible, enable_gqa=True)
                x = x + F.linear(a.reshape(lanes, HEADS * HEAD_DIM), layer["o"])
                x = x + self._mlp(x, layer)
            token.copy_(F.linear(self.norm(x), self.embed).argmax(-1))

        return step


def seconds(fn, repeats: int) -> float:
    """Median seconds of fn over `repeats` timed runs of 5 calls each, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / 5)
    return statistics.median(times)


def captured(step):
    """`step` captured in one CUDA graph (after warm-up on a side stream): its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("torch_reference: needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    ref = Reference(device)
    print(f"plain torch {torch.__version__} on {torch.cuda.get_device_name(0)}, bf16, the default model's shape")
    print()
    print("| tok/s | plain torch, eager | plain torch, one CUDA graph |")
    print("|---|---:|---:|")
    with torch.inference_mode():
        for tokens in (512, 2048, 4096):
            prompt = torch.randint(0, VOCAB, (tokens,), device=device)
            rate = tokens / seconds(lambda: ref.prefill(prompt), args.repeats)
            print(f"| prefill {tokens} tok | {rate:,.1f} | - |")
        for lanes, context in ((1, 4096), (1, 512), (8, 512), (32, 512)):
            step = ref.decode_step(lanes, context)
            eager = lanes / seconds(step, args.repeats)
            graph = lanes / seconds(captured(step), args.repeats)
            label = f"decode {lanes} lane{'s' if lanes > 1 else ''} @ {context} ctx" + (
                " (aggregate)" if lanes > 1 else "")
            print(f"| {label} | {eager:,.1f} | {graph:,.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
