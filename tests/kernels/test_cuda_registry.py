"""The kernel registry, first-use verification and autotune lookup, on a CPU (no CuPy, no GPU)."""

from __future__ import annotations

import json

import pytest
import torch

from wide_cli.runtime.cuda import autotune, builds, verify
from wide_cli.runtime.cuda.registry import KernelRegistry


@pytest.fixture
def reg(monkeypatch) -> KernelRegistry:
    fresh = KernelRegistry()
    monkeypatch.setattr(verify, "REGISTRY", fresh)
    monkeypatch.setattr(autotune, "REGISTRY", fresh)
    return fresh


def test_settings_come_from_the_environment_unless_overridden(reg, monkeypatch):
    monkeypatch.delenv("WIDE_CUPY_VERIFY", raising=False)
    monkeypatch.delenv("WIDE_CUPY_DENSE_ABOVE", raising=False)
    monkeypatch.delenv("WIDE_CUPY_GEMV_MAX_M", raising=False)
    assert reg.verify_enabled() and reg.dense_above() == 0.1 and not reg.autotune_enabled()
    assert reg.gemv_max_m() == 2
    monkeypatch.setenv("WIDE_CUPY_GEMV_MAX_M", "4")
    assert reg.gemv_max_m() == 4
    with reg.overrides(gemv_max_m=2):
        assert reg.gemv_max_m() == 2
    assert reg.gemv_max_m() == 4
    monkeypatch.setenv("WIDE_CUPY_DENSE_ABOVE", "0.3")
    monkeypatch.setenv("WIDE_CUPY_VERIFY", "0")
    assert reg.dense_above() == 0.3 and not reg.verify_enabled()
    with reg.overrides(dense_above=1.0, verify=True):
        assert reg.dense_above() == 1.0 and reg.verify_enabled()
        with reg.overrides(dense_above=0.9):
            assert reg.dense_above() == 0.9 and reg.verify_enabled()
        assert reg.dense_above() == 1.0
    assert reg.dense_above() == 0.3 and not reg.verify_enabled()  # restored, the environment again


def test_checked_verifies_once_and_disables_a_wrong_build(reg):
    calls = {"run": 0, "ref": 0}
    good = torch.ones(4, 4)

    def run_ok():
        calls["run"] += 1
        return good.clone()

    def ref():
        calls["ref"] += 1
        return good.clone()

    with reg.overrides(verify=True):
        assert torch.equal(verify.checked(("k", 1), "bf16", run_ok, ref), good)
        assert torch.equal(verify.checked(("k", 1), "bf16", run_ok, ref), good)
        assert calls == {"run": 2, "ref": 1}  # the reference only on first use
        wrong = verify.checked(("k", 2), "bf16", lambda: good * 2, ref)
        assert torch.equal(wrong, good)  # the reference's answer, never the wrong one
        assert reg.broken_builds() == ["('k', 2)"]
        assert torch.equal(verify.checked(("k", 2), "bf16", lambda: good * 2, ref), good)


def test_fallback_counts_and_logs_once(reg, caplog):
    caplog.set_level("WARNING", logger="wide.cupy")
    for _ in range(3):
        out = verify.fallback("gemm_mn", "dtype float32 has no kernel", lambda: torch.zeros(2))
    assert torch.equal(out, torch.zeros(2))
    assert reg.fallback_counts() == {"gemm_mn: dtype float32 has no kernel": 3}
    assert sum("has no kernel" in r.message for r in caplog.records) == 1


def test_rel_err():
    r = torch.tensor([3.0, 4.0])
    assert verify.rel_err(r, r) == 0.0
    assert verify.rel_err(r + torch.tensor([0.0, 0.5]), r) == pytest.approx(0.1)
    assert verify.rel_err(torch.tensor([float("nan"), 4.0]), r) == float("inf")


def test_pick_tile_heuristic_unless_autotuning_and_reads_the_stored_table(reg, monkeypatch, tmp_path):
    monkeypatch.setenv("WIDE_CACHE", str(tmp_path))
    tiles = list(builds.GEMM_MN_TILES[:3])

    def never(t):
        raise AssertionError("no timing when the table has the answer")

    assert autotune.pick_tile("key", tiles, tiles[0], never) is tiles[0]  # autotune off
    (tmp_path / "cupy_autotune.json").write_text(json.dumps({"key": tiles[2].name}))
    with reg.overrides(autotune=True):
        assert autotune.pick_tile("key", tiles, tiles[0], never) is tiles[2]
        assert autotune.pick_tile("other", tiles[:1], tiles[0], never) is tiles[0]  # one candidate


def test_dispatch_path_runs_gemv_for_decode_cublas_between_and_syncs_only_for_large_calls():
    from wide_cli.runtime.cupy_ops import AUTO_MIN_M, CUBLAS_MASKED, dispatch_path

    synced = []

    def live(x):
        return lambda: synced.append(x) or x

    auto = {"dense_above": 0.1, "gemv_max_m": 1}
    assert dispatch_path(1, live(0.9), **auto) == "GEMV"
    assert [dispatch_path(m, live(0.0), **auto) for m in (2, 8, 9, AUTO_MIN_M - 1)] == [CUBLAS_MASKED] * 4
    assert synced == []  # below AUTO_MIN_M no host sync reads the mask
    assert dispatch_path(AUTO_MIN_M, live(0.05), **auto) == "kernel"
    assert dispatch_path(AUTO_MIN_M, live(0.5), **auto) == CUBLAS_MASKED
    assert synced == [0.05, 0.5]
    assert dispatch_path(4096, live(0.0), **auto, capturing=True) == CUBLAS_MASKED  # no sync in capture
    assert synced == [0.05, 0.5]
    # WIDE_CUPY_DENSE_ABOVE=1: every masked call on the kernels (GEMV up to builds.GEMV_MAX_M tokens)
    forced = {"dense_above": 1.0, "gemv_max_m": 1}
    assert [dispatch_path(m, None, **forced) for m in (1, builds.GEMV_MAX_M, builds.GEMV_MAX_M + 1)] == [
        "GEMV", "GEMV", "kernel"
    ]
    assert dispatch_path(4, None, dense_above=0.1, gemv_max_m=4) == "GEMV"
