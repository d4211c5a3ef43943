"""``gpu_check`` on a CPU: the case lists, the JSON it writes, the no-GPU error, and the naive
gather-compute-scatter baselines it times against (they must compute the operators exactly)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from wide_cli.gpu_check import cases, e2e, workload
from wide_cli.gpu_check.main import main
from wide_cli.runtime import ops
from wide_cli.runtime.cuda.registry import REGISTRY


def test_case_lists_cover_the_brief():
    lists = cases.build_cases()
    check, bench = lists["check"], lists["bench"]
    assert {c.model for c in check} == set(cases.MODELS)
    assert {c.m for c in check if c.op in cases.GEMM_OPS} == set(cases.MS)
    assert {c.sparsity for c in check} == set(cases.SPARSITIES)
    assert {c.mask for c in check} == {"random", "structured"}
    assert {c.op for c in check} == {*cases.GEMM_OPS, "attn_prefill", "attn_decode"}
    assert len({c.name for c in bench}) == len(bench)
    for (op, model, m, s), _ in cases.TARGETS.values():  # every target is measured first
        assert any(c.op == op and c.model == model and c.m == m and c.sparsity == s for c in bench[:10])


def test_dry_run_without_compile_writes_json(tmp_path, monkeypatch):
    monkeypatch.setenv("WIDE_CUPY_DENSE_ABOVE", "0.45")
    monkeypatch.delenv("WIDE_CUPY_VERIFY", raising=False)
    rc = main(["--out", str(tmp_path), "--dry-run", "--sections", "none"])
    assert os.environ["WIDE_CUPY_DENSE_ABOVE"] == "0.45" and "WIDE_CUPY_VERIFY" not in os.environ  # untouched
    assert REGISTRY.dense_above() == 0.45 and REGISTRY.verify_enabled()  # its overrides ended with it
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert rc == 0 and data["dry_run"] is True and data["auto_dense_threshold"] == 0.45
    assert data["case_counts"]["check"] == len(data["cases"]["check"]) > 500


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_gpu_run_without_gpu_is_a_clear_error(tmp_path):
    rc = main(["--out", str(tmp_path), "--sections", "check"])
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert rc == 2 and "no CUDA device" in data["error"] and "--dry-run" in data["error"]


def _masks(M, G, seed):
    return torch.rand(M, G, generator=torch.Generator().manual_seed(seed)) < 0.5


@pytest.mark.parametrize("M", [1, 9, 40])
def test_naive_gemm_baselines_match_the_references(M):
    g = torch.Generator().manual_seed(M)
    a, w, w2 = (torch.randn(*s, generator=g) for s in ((M, 64), (96, 64), (96, 64)))
    mask = _masks(M, 3, M)
    # fp32 sums of 64-96 products: BLAS blocks the reduction differently with the thread count and
    # the matrix shape, so the two paths round differently by a few ulp of values of order 1-10.
    tol = {"atol": 1e-4, "rtol": 1e-5}
    close = torch.testing.assert_close
    close(workload._naive_mn(a, w, None, mask, 32), ops.gemm_mn(a, w, mask, 32), **tol)
    close(workload._naive_mn(a, w, w2, mask, 32), ops.gemm_mn_swiglu(a, w, w2, mask, 32), **tol)
    wk = torch.randn(48, 96, generator=g)
    ak = torch.randn(M, 96, generator=g)
    close(workload._naive_k(ak, wk, mask, 32), ops.gemm_k(ak, wk, mask, 32), **tol)


def test_naive_attention_baselines_match_the_references():
    g = torch.Generator().manual_seed(0)
    T, H, Hkv, d, hg = 37, 6, 2, 16, 3
    q, k, v = (
        torch.randn(1, T, H, d, generator=g),
        torch.randn(1, T, Hkv, d, generator=g),
        torch.randn(1, T, Hkv, d, generator=g),
    )
    hm = _masks(T, H // hg, 1).repeat_interleave(hg, dim=-1)[None]
    got = workload._naive_prefill(q, k, v, hm, hg, d**-0.5)
    torch.testing.assert_close(got, ops.attention_prefill(q, k, v, hm, scale=d**-0.5), atol=1e-5, rtol=1e-4)
    B, S = 3, 50
    qd, kc, vc = (
        torch.randn(B, H, d, generator=g),
        torch.randn(B, Hkv, S, d, generator=g),
        torch.randn(B, Hkv, S, d, generator=g),
    )
    hmd = _masks(B, Hkv, 2).repeat_interleave(H // Hkv, dim=-1)
    kv = torch.ones(B, S, dtype=torch.bool)
    got = workload._naive_decode(qd, kc, vc, hmd, H // Hkv, d**-0.5)
    torch.testing.assert_close(
        got, ops.attention_decode(qd, kc, vc, hmd, kv, scale=d**-0.5), atol=1e-5, rtol=1e-4
    )


def test_e2e_timing_helper_runs_a_runtime():
    """The end-to-end section's timing loop, on the CPU backend and a tiny routed model."""
    import warnings

    from wide_cli.models.tiny import tiny_model
    from wide_cli.routing import RoutingConfig, attach_routers
    from wide_cli.runtime.engine import Runtime

    model = tiny_model("llama", seed=0, intermediate_size=96)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        attach_routers(model, RoutingConfig(attn_group_size=2, ffn_group_size=32)).set_mode("argmax")
    rt = Runtime.from_model(model, backend="cpu")
    out = e2e._e2e_system(rt, True, 0.5, prompt_len=16, batch=2, steps=3)
    assert out["prefill"]["tokens"] == 16 and out["decode"]["tokens"] == 6
    assert out["prefill"]["seconds"] > 0 and out["decode"]["tokens_per_s"] > 0
    assert rt.forced == {}
