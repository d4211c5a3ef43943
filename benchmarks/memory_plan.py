# Memory plan check on a real model: the activation estimate vs the bytes autograd saves for one
# training forward of SmolLM2-135M with routers (batch 4 x 256, bf16/fp32, with/without checkpointing).
# Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/memory_plan.py (about a minute on CPU).
import torch, sys, json
sys.path.insert(0, "tests/train")
from test_memory import _saved_bytes
from wide_cli.models.loader import load_model
from wide_cli.routing import RoutingConfig, attach_routers
from wide_cli.train.memory import plan_training
out = {}
for dt, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
    for ck in (False, True):
        lm = load_model("smollm2-135m", dtype=torch.float32, device="cpu")
        m = lm.model
        for p in m.parameters(): p.requires_grad_(False)
        attach_routers(m, RoutingConfig(attn_group_size=3, ffn_group_size=128, sparsity=0.5))
        for n, p in m.named_parameters():
            if ".router_" in n: p.requires_grad_(True)
            elif p.is_floating_point(): p.data = p.data.to(dt)
        st = m.wide_routing; st.set_mode("gumbel"); st.generator = torch.Generator().manual_seed(0); st.grad_checkpointing = ck
        m.train()
        ids = torch.randint(0, 49152, (4, 256))
        meas = _saved_bytes(m, ids)
        plan = plan_training(m, batch_size=4, seq_len=256, compute_dtype=dt, grad_checkpointing=ck, max_memory=2**40)
        out[f"{name}{'-ckpt' if ck else ''}"] = {"measured_saved_bytes": meas, "plan_activations": plan.activations, "ratio": round(plan.activations / meas, 3), "plan_total": plan.total}
        print(name, ck, out[f"{name}{'-ckpt' if ck else ''}"], flush=True)
json.dump({"what": "memory plan activations vs bytes autograd saves, SmolLM2-135M routed, batch 4 x 256", "results": out}, open("docs/results/memory-plan.json", "w"), indent=1)
