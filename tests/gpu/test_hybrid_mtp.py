"""The qwen3_5 MTP head: loading `mtp.*`, its forward against a reference built from
transformers' own Qwen3.5 blocks (transformers drops `mtp.*`, so the head is assembled here
from the published structure), row invariance of MTP rows, and the draft carry in snapshots.

Tolerance as in test_hybrid_reference: float32 on both sides, ATOL 1e-4 on logits, greedy
tokens identical.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from prefixd.gpu.config import config_from_hf, tensor_shapes
from prefixd.gpu.families.qwen3_5 import HybridModel
from prefixd.gpu.families.qwen3_5_config import hybrid_config
from prefixd.gpu.families.qwen3_5_gguf import gguf_names
from prefixd.gpu.families.qwen3_5_tiny import make_tiny_hybrid_dir
from prefixd.gpu.kv_pool import KVPool
from prefixd.scheduler.records import LaneWork

pytestmark = pytest.mark.slow

ATOL = 1e-4
CPU = torch.device("cpu")
PAGES = tuple(range(32))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    from safetensors.torch import load_file

    path = make_tiny_hybrid_dir(tmp_path_factory.mktemp("mtp"), seed=3, mtp_layers=1, initializer_range=0.1)
    config = config_from_hf(json.loads((Path(path) / "config.json").read_text()))
    tensors = load_file(str(Path(path) / "model.safetensors"))
    return path, config, tensors


def build(config, tensors, num_lanes: int = 2):
    model = HybridModel(hybrid_config(config), tensors, device=CPU, dtype=torch.float32)
    model.new_lane_states(num_lanes)
    kv = KVPool(num_layers=model.num_kv_layers, num_pages=64, page_size=16,
                num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, device=CPU,
                dtype=torch.float32)
    return model, kv


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def work(tokens, start: int, lane: int = 0, pages=PAGES, prefill: bool = True) -> LaneWork:
    return LaneWork(lane=lane, start=start, tokens=tuple(tokens), page_table=tuple(pages), prefill=prefill)


def test_the_checkpoint_lists_and_loads_the_mtp_tensors(tiny):
    _, config, tensors = tiny
    hc = hybrid_config(config)
    assert hc.num_mtp_layers == 1
    shapes = tensor_shapes(config)
    assert shapes["mtp.fc.weight"] == (64, 128)
    assert shapes["mtp.layers.0.self_attn.q_proj.weight"] == (128, 64)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == shapes
    model, _ = build(config, tensors)
    assert model.num_kv_layers == len(hc.full_layers) + 1  # the MTP's own KV layer


def test_gguf_names_put_the_mtp_layer_after_the_main_blocks(tiny):
    _, config, _ = tiny
    names = gguf_names(hybrid_config(config))
    assert names["mtp.fc.weight"] == "blk.4.nextn.eh_proj.weight"
    assert names["mtp.pre_fc_norm_embedding.weight"] == "blk.4.nextn.enorm.weight"
    assert names["mtp.pre_fc_norm_hidden.weight"] == "blk.4.nextn.hnorm.weight"
    assert names["mtp.norm.weight"] == "blk.4.nextn.shared_head_norm.weight"
    assert names["mtp.layers.0.self_attn.q_proj.weight"] == "blk.4.attn_q.weight"
    assert names["mtp.layers.0.mlp.down_proj.weight"] == "blk.4.ffn_down.weight"


def reference_mtp_logits(path: Path, tokens: list[int]) -> torch.Tensor:
    """MTP logits for rows 0..n-2 (hidden of row i with token i+1), from transformers'
    Qwen3.5 blocks: the main model's final-normed hidden states, Qwen3_5RMSNorm for the
    norms, a Qwen3_5DecoderLayer (full attention, causal SDPA) for the MTP layer."""
    from safetensors.torch import load_file
    from transformers import Qwen3_5ForCausalLM
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

    ref = Qwen3_5ForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="sdpa").eval()
    cfg = ref.config
    w = {k: v for k, v in load_file(str(path / "model.safetensors")).items() if k.startswith("mtp.")}
    full = cfg.layer_types.index("full_attention")
    layer = Qwen3_5DecoderLayer(cfg, layer_idx=full).float().eval()
    layer.load_state_dict({k[len("mtp.layers.0."):]: v for k, v in w.items() if k.startswith("mtp.layers.0.")})

    def norm(name: str) -> Qwen3_5RMSNorm:
        n = Qwen3_5RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        n.weight.data.copy_(w[name])
        return n

    with torch.no_grad():
        ids = torch.tensor([tokens])
        hidden = ref.model(ids).last_hidden_state[:, :-1]  # (1, n-1, H), final-normed
        e = norm("mtp.pre_fc_norm_embedding.weight")(ref.model.embed_tokens(ids[:, 1:]))
        x = torch.cat([e, norm("mtp.pre_fc_norm_hidden.weight")(hidden)], dim=-1) @ w["mtp.fc.weight"].T
        pos = torch.arange(len(tokens) - 1).view(1, 1, -1).expand(3, 1, -1)
        x = layer(x, position_embeddings=ref.model.rotary_emb(x, pos), attention_mask=None, position_ids=pos[0])
        return ref.lm_head(norm("mtp.norm.weight")(x))[0]


def test_mtp_logits_match_the_reference(tiny):
    path, config, tensors = tiny
    model, kv = build(config, tensors)
    tokens = prompt(40, seed=1)
    hidden = model.forward_works([work(tokens, 0)], kv)
    ours = model.logits(model.mtp_works(hidden[:-1], [work(tokens[1:], 0)], kv))
    theirs = reference_mtp_logits(Path(path), tokens)
    assert ours.shape == theirs.shape == (39, 512)
    assert torch.allclose(ours, theirs, atol=ATOL, rtol=0)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_mtp_rows_are_row_invariant(tiny):
    """A draft from a resumed lane equals a cold one: MTP rows computed one at a time (as
    decode drafts them) have the bits of the same rows computed in one call."""
    _, config, tensors = tiny
    model, kv = build(config, tensors)
    tokens = prompt(21, seed=2)
    hidden = model.forward_works([work(tokens, 0)], kv)
    whole = model.mtp_works(hidden[:-1], [work(tokens[1:], 0)], kv)
    pages = tuple(range(32, 64))
    model.forward_works([work(tokens, 0, lane=1, pages=pages)], kv)
    one_by_one = torch.cat([model.mtp_works(hidden[i:i + 1], [work(tokens[i + 1:i + 2], i, lane=1, pages=pages)], kv)
                            for i in range(20)])
    assert torch.equal(whole, one_by_one)


def test_the_draft_carry_is_the_last_row_and_rides_in_a_snapshot(tiny):
    _, config, tensors = tiny
    model, kv = build(config, tensors)
    tokens = prompt(24, seed=4)
    hidden = model.forward_works([work(tokens[:16], 0), work(tokens, 0, lane=1, pages=range(32, 64))], kv)
    assert torch.equal(model.draft_carry(0), hidden[15])
    assert torch.equal(model.draft_carry(1), hidden[-1])
    snap = model.capture(1)
    model.reset(1)
    assert not model.draft_carry(1).any()
    model.restore(0, snap)
    assert torch.equal(model.draft_carry(0), hidden[-1])


def test_a_rollback_brings_the_carry_back_to_the_last_accepted_row(tiny):
    _, config, tensors = tiny
    model, kv = build(config, tensors)
    tokens = prompt(20, seed=5)
    model.forward_works([work(tokens[:16], 0)], kv)
    verify = model.forward_works([work(tokens[16:20], 16, prefill=False)], kv)  # 4 verify rows
    assert torch.equal(model.draft_carry(0), verify[3])
    model.rollback(0, 2)  # keep the first 2 rows
    assert torch.equal(model.draft_carry(0), verify[1])
