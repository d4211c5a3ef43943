"""Memory plan: the activation estimate against the bytes autograd really saves,
refusal with a suggestion, and ``--grad-checkpointing`` computing exactly the same training."""

from __future__ import annotations

import pytest
import torch

from wide_cli.cli.app import main
from wide_cli.errors import ConfigError
from wide_cli.models.tiny import tiny_model
from wide_cli.routing import RoutingConfig, attach_routers
from wide_cli.routing.model import router_state_dict
from wide_cli.train.config import TrainConfig
from wide_cli.train.loop import train_stage
from wide_cli.train.memory import MemoryPlanError, check_plan, parse_bytes, plan_training

TINY = ["--steps", "2", "--seq-len", "32", "--batch-size", "2", "--attn-group-size", "2",
        "--ffn-group-size", "32", "--eval-max-tokens", "2048"]


def _routed(arch="llama", dtype=torch.float32, *, lora=False, ckpt=False, seed=0, attn="sdpa"):
    m = tiny_model(arch)
    m.config._attn_implementation = attn
    for p in m.parameters():
        p.requires_grad_(False)
    torch.manual_seed(seed)
    attach_routers(m, RoutingConfig(attn_group_size=2, ffn_group_size=32, sparsity=0.5))
    m.to(dtype)
    for n, p in m.named_parameters():
        if ".router_" in n:
            p.data = p.data.float()
            p.requires_grad_(True)
    st = m.wide_routing
    st.set_mode("gumbel")
    st.generator = torch.Generator().manual_seed(123)
    st.grad_checkpointing = ckpt
    if lora:
        from wide_cli.pipeline.settings import Stage2Config
        from wide_cli.train.lora import wrap_lora

        m = wrap_lora(m, Stage2Config())
        for n, p in m.named_parameters():  # stage 2 keeps training the routers (train_stage2)
            if ".router_" in n:
                p.requires_grad_(True)
    m.train()
    return m


def _saved_bytes(model, ids) -> int:
    """Bytes of distinct non-parameter storages autograd saves for backward in one forward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids, use_cache=False)
    return sum(seen.values())


def test_parse_bytes():
    assert parse_bytes("24GiB") == 24 * 2**30
    assert parse_bytes("512 MB") == 512 * 10**6
    assert parse_bytes("1.5gib") == int(1.5 * 2**30)
    assert parse_bytes("4096") == 4096
    for bad in ("lots", "12 parsecs", "0GiB", "-1GB"):
        with pytest.raises(ConfigError, match="max-memory"):
            parse_bytes(bad)
    with pytest.raises(ConfigError, match="max-memory 'ten' is not a size"):
        TrainConfig(max_memory="ten")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lora", [False, True], ids=["stage1", "stage2-lora"])
def test_activation_estimate_tracks_saved_tensors(arch, dtype, lora):
    m = _routed(arch, dtype, lora=lora)
    ids = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(1))
    measured = _saved_bytes(m, ids)
    plan = plan_training(m, batch_size=4, seq_len=64, compute_dtype=dtype, grad_checkpointing=False,
                         max_memory=2**40)
    assert 0.75 <= plan.activations / measured <= 1.3, (plan.activations, measured)


def test_checkpointing_keeps_layer_inputs_only():
    ids = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(1))
    full, ck = _routed(), _routed(ckpt=True)
    m_full, m_ck = _saved_bytes(full, ids), _saved_bytes(ck, ids)
    plan = plan_training(ck, batch_size=4, seq_len=64, compute_dtype=torch.float32, grad_checkpointing=True,
                         max_memory=2**40)
    # fp32: the kept layer inputs and the loss are counted exactly
    assert plan.activations == pytest.approx(m_ck, rel=0.01)
    assert m_ck < 0.2 * m_full
    assert plan.workspace > plan_training(full, batch_size=4, seq_len=64, compute_dtype=torch.float32,
                                          grad_checkpointing=False, max_memory=2**40).workspace


def _loss_and_grads(m, ids):
    st = m.wide_routing
    st.records.clear()
    out = m(input_ids=ids, labels=ids, use_cache=False)
    s_hat = st.measured_s_hat()
    loss = out.loss + 20 * sum((v - 0.5).abs() for v in s_hat.values())
    loss.backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}
    return loss.item(), grads, len(st.records), st.generator.get_state()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("lora", [False, True], ids=["routers", "lora-dropout"])
def test_grad_checkpointing_same_loss_grads_and_gumbel_stream(lora, attn):
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(5)  # LoRA dropout draws from the global RNG
    a = _loss_and_grads(_routed(lora=lora, attn=attn), ids)
    torch.manual_seed(5)
    b = _loss_and_grads(_routed(lora=lora, ckpt=True, attn=attn), ids)
    assert a[0] == pytest.approx(b[0], abs=1e-6)
    assert set(a[1]) == set(b[1]) and a[1]
    for n in a[1]:
        torch.testing.assert_close(a[1][n], b[1][n], atol=1e-6, rtol=1e-5, msg=n)
    assert a[2] == b[2] == 2 * 2  # one record per routed module and layer, none from the replay
    assert torch.equal(a[3], b[3])  # the replay rewound and restored the Gumbel generator


def test_train_stage_with_checkpointing_matches(tmp_path):
    data = torch.randint(0, 128, (16, 16), generator=torch.Generator().manual_seed(0))
    out = {}
    for ck in (False, True):
        m = tiny_model("llama")
        for p in m.parameters():
            p.requires_grad_(False)
        torch.manual_seed(0)
        attach_routers(m, RoutingConfig(attn_group_size=2, ffn_group_size=32, sparsity=0.5))
        cfg = TrainConfig(steps=4, batch_size=2, seq_len=16, lr=1e-2, grad_checkpointing=ck)
        res = train_stage(m, data, cfg, stage_dir=tmp_path / str(ck), identity={}, progress=False)
        assert res.memory_plan["grad_checkpointing"] is ck and res.memory_plan["fits"]
        assert not m.wide_routing.grad_checkpointing  # switched off after training
        out[ck] = router_state_dict(m)
    for k in out[False]:
        torch.testing.assert_close(out[False][k], out[True][k], atol=1e-6, rtol=1e-5)


def _refusal(batch_size, max_memory, seq_len=64, ckpt=False):
    plan = plan_training(_routed(), batch_size=batch_size, seq_len=seq_len, compute_dtype=torch.float32,
                         grad_checkpointing=ckpt, max_memory=parse_bytes(max_memory))
    assert plan.total == plan.weights + plan.gradients + plan.optimizer + plan.activations + plan.workspace
    with pytest.raises(MemoryPlanError) as e:
        check_plan(plan, batch_size=batch_size, grad_accum=1)
    return plan, str(e.value)


def test_plan_refuses_with_suggestions():
    plan, msg = _refusal(8, "2MiB")
    assert not plan.fits and plan.total > plan.usable
    assert "exceeds the 1.8 MiB usable on cpu (2.0 MiB less 10 % headroom)" in msg
    # the largest divisor of 8 that fits, keeping 8 sequences per step
    assert "--batch-size 2 --grad-accum 4 (same sequences per step)" in msg
    assert "--grad-checkpointing" in msg and "--max-memory" in msg
    _, msg = _refusal(5, "2MiB")
    assert "--batch-size 1 --grad-accum 5" in msg  # 2 does not divide 5
    _, msg = _refusal(8, "2MiB", ckpt=True)
    assert "--grad-checkpointing" not in msg  # already on
    # weights + optimizer alone too big: no batch-size advice that could not work
    _, msg = _refusal(8, "256KiB")
    assert "weights and optimizer state alone" in msg and "--batch-size" not in msg
    big = plan_training(_routed(), batch_size=8, seq_len=64, compute_dtype=torch.float32, grad_checkpointing=True,
                        max_memory=2**30)
    check_plan(big, batch_size=8, grad_accum=1)  # fits: no error
    assert "grad checkpointing" in big.render() and "1.00 GiB available on cpu" in big.render()


def test_frozen_weights_count_at_stored_size_unless_cast():
    m = _routed()
    kw = {"batch_size": 1, "seq_len": 8, "grad_checkpointing": False, "max_memory": 2**30}
    stored = plan_training(m, compute_dtype=torch.bfloat16, **kw).weights  # CUDA autocast: fp32 stays
    cast = plan_training(m, compute_dtype=torch.bfloat16, cast_frozen=True, **kw).weights  # CPU bf16 cast
    trainable = sum(p.numel() for p in m.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in m.parameters() if not p.requires_grad)
    assert stored == 4 * (trainable + frozen) and cast == 4 * trainable + 2 * frozen


def test_cli_refuses_before_training_and_writes_no_export(tmp_path, text_file, capsys):
    run = tmp_path / "r"
    code = main(["prune", "tiny-llama", "--data", str(text_file), "--run-dir", str(run), *TINY,
                 "--max-memory", "900KiB"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("error: estimated peak memory") and "--grad-checkpointing" in err[-1], err
    assert "--batch-size 1 --grad-accum 2" in err[-1]
    assert any(line.startswith("memory plan (estimate): weights") for line in err)
    assert not (run / "export").exists() and not (run / "stage1" / "routers.safetensors").exists()


def test_cli_grad_checkpointing_flag_reaches_training(tmp_path, text_file, capsys):
    import json

    run = tmp_path / "r"
    code = main(["prune", "tiny-llama", "--data", str(text_file), "--run-dir", str(run), *TINY,
                 "--grad-checkpointing", "--max-memory", "8GiB"])
    assert code == 0, capsys.readouterr().err
    res = json.loads((run / "stage1" / "result.json").read_text())
    assert res["memory_plan"]["grad_checkpointing"] is True and res["memory_plan"]["capacity"] == 8 * 2**30
    # not part of the resume identity: toggling it does not invalidate a checkpoint
    assert "grad_checkpointing" not in res["identity"]["train"]


def test_checkpointing_refuses_a_kv_cache():
    m = _routed(ckpt=True)
    ids = torch.randint(0, 128, (1, 8))
    with pytest.raises(RuntimeError, match="use_cache=False"):
        m(input_ids=ids, labels=ids, use_cache=True)
