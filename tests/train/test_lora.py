"""Stage-2 LoRA: merge equals the unmerged adapter, strict adapter loading (a missing or extra
adapter tensor is an error), fp32 adapters under a bf16 backbone (bf16 updates round away), only
LoRA and router parameters train."""

import pytest
import torch

from wide_cli.errors import CheckpointError
from wide_cli.models.tiny import tiny_model
from wide_cli.pipeline.settings import Stage2Config
from wide_cli.routing import RoutingConfig, attach_routers
from wide_cli.train.config import TrainConfig
from wide_cli.train.loop import train_stage
from wide_cli.train.lora import adapter_state_dict, load_adapter, merge_lora, wrap_lora

IDS = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(0))
CFG = Stage2Config(lora_rank=4, lora_alpha=8.0, lora_dropout=0.0)


def _routed(seed=0, **over):
    m = tiny_model("llama", seed=seed, **over)
    torch.manual_seed(seed)
    attach_routers(m, RoutingConfig(attn_group_size=2, ffn_group_size=32))
    return m


def _randomise_b(peft_model):
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def test_merged_equals_unmerged_and_changes_every_target():
    base = _routed()
    ref_w = {n: p.detach().clone() for n, p in base.named_parameters()}
    pm = wrap_lora(base, CFG)
    _randomise_b(pm)
    pm.eval()
    with torch.no_grad():
        unmerged = pm(input_ids=IDS).logits
    merged = merge_lora(pm)
    with torch.no_grad():
        got = merged(input_ids=IDS).logits
    torch.testing.assert_close(got, unmerged, atol=1e-5, rtol=0)
    for n, p in merged.named_parameters():
        targeted = any(f".{t}." in n for t in CFG.target_modules) and n.endswith("weight")
        assert (not torch.equal(p, ref_w[n])) == targeted, n


def test_merge_formula_is_alpha_over_r_b_at_a():
    base = _routed()
    w0 = base.model.layers[0].self_attn.q_proj.weight.detach().clone()
    pm = wrap_lora(base, CFG)
    _randomise_b(pm)
    lin = pm.base_model.model.model.layers[0].self_attn.q_proj
    a, b = lin.lora_A["default"].weight.detach().clone(), lin.lora_B["default"].weight.detach().clone()
    merged = merge_lora(pm)
    torch.testing.assert_close(merged.model.layers[0].self_attn.q_proj.weight, w0 + (8.0 / 4) * b @ a)


def test_b22_adapter_with_renamed_keys_or_other_shapes_is_rejected():
    pm = wrap_lora(_routed(), CFG)
    _randomise_b(pm)
    sd = adapter_state_dict(pm)
    renamed = {k.replace("model.layers", "model.blocks", 1) if i == 0 else k: v for i, (k, v) in enumerate(sd.items())}
    with pytest.raises(CheckpointError, match="LoRA adapter does not match the model: missing"):
        load_adapter(wrap_lora(_routed(), CFG), renamed)
    other = wrap_lora(_routed(intermediate_size=64), CFG)
    with pytest.raises(CheckpointError, match="shape mismatch"):
        load_adapter(other, sd)
    fresh = wrap_lora(_routed(), CFG)
    load_adapter(fresh, sd)
    assert all(torch.equal(adapter_state_dict(fresh)[k], v) for k, v in sd.items())


def test_stage2_trains_only_lora_and_routers(tmp_path):
    base = _routed()
    before = {n: p.detach().clone() for n, p in base.named_parameters()}
    for p in base.parameters():
        p.requires_grad_(False)
    pm = wrap_lora(base, CFG)
    for n, p in pm.named_parameters():
        if ".router_" in n:
            p.requires_grad_(True)
    data = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(2))
    train_stage(pm, data, TrainConfig(steps=3, batch_size=2, seq_len=16, lr=1e-2, checkpoint_every=0),
                stage_dir=tmp_path, identity={}, progress=False)
    for n, p in pm.named_parameters():
        short = n.removeprefix("base_model.model.").replace(".base_layer", "")
        if "lora_" in n:
            continue
        changed = not torch.equal(p.detach(), before[short])
        assert changed == (".router_" in n), n
    assert any(p.abs().sum() > 0 for n, p in pm.named_parameters() if "lora_B" in n)


def test_b11_adapters_stay_fp32_on_bf16_backbone(tmp_path):
    base = tiny_model("llama", dtype=torch.bfloat16)
    attach_routers(base, RoutingConfig(attn_group_size=2, ffn_group_size=32))
    for p in base.parameters():
        p.requires_grad_(False)
    pm = wrap_lora(base, CFG)
    for n, p in pm.named_parameters():
        if ".router_" in n:
            p.requires_grad_(True)
    trainable = [(n, p) for n, p in pm.named_parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for _, p in trainable)
    data = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(2))
    res = train_stage(pm, data, TrainConfig(steps=5, batch_size=2, seq_len=16, lr=5e-3, checkpoint_every=0),
                      stage_dir=tmp_path, identity={}, progress=False)
    assert torch.isfinite(torch.tensor(res.final["loss"]))
