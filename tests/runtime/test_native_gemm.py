"""The native prefill GEMM (``wide_gemm`` in ``kernels/cpu_decode.c``) against PyTorch, and the cpu
backend's prefill on it against the reference backend.

Tolerances: fp32 sums in another order than PyTorch (relative 1e-5 of the output range); bf16
operands are exact in fp32, so an fp32 output differs by summation order only (1e-5), a bf16
output by one rounding (2 ** -8 relative, plus order).
"""

from __future__ import annotations

import pytest
import torch

from wide_cli.runtime import cpu_native, cpu_proj
from wide_cli.runtime.cpu_plan import SMALL_M
from wide_cli.runtime.engine import Runtime

FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _libraries():
    """(name, library) of the builds this machine runs: the one the runtime uses and the portable
    C twin; without a compiler, none (the tests skip)."""
    try:
        return {"native": cpu_native.load(cpu_native.build()),
                "portable": cpu_native.load(cpu_native.build(portable=True))}  # fmt: skip
    except (RuntimeError, OSError) as e:
        pytest.skip(f"the native library does not build here: {e}")


@pytest.fixture(scope="module")
def libs():
    return _libraries()


@pytest.mark.parametrize("build", ["native", "portable"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layout", ["rows", "w_t"])
@pytest.mark.parametrize("out_fmt", ["fp32", "same"])
@pytest.mark.parametrize("shape", [(37, 50, 64), (8, 32, 2), (100, 96, 130), (1, 17, 6), (16, 33, 130), (3, 64, 64)])
def test_gemm_gathers_scatters_and_accumulates_like_torch(build, fmt, layout, out_fmt, shape, libs):
    M, N, K = shape  # off the kernels' tile sizes (tails); M <= 16 with rows: the few-rows kernel
    dt = FORMATS[fmt]
    odt = torch.float32 if out_fmt == "fp32" else dt
    g = torch.Generator().manual_seed(M * N + K)
    a = torch.randn(M + 5, K, generator=g).to(dt)
    w = torch.randn(N, K, generator=g).to(dt)
    wl = w if layout == "rows" else w.t().contiguous()
    arows = torch.randperm(M + 5, generator=g)[:M]
    orows = torch.randperm(M + 3, generator=g)[:M]
    out = torch.randn(M + 3, N, generator=g).to(odt)
    want = out.float().clone()
    want[orows] += a[arows].float() @ w.float().t()
    assert cpu_native.gemm(a, wl, layout, out, arows=arows, orows=orows, accumulate=True, lib=libs[build])
    tol = (2.0**-8 if odt == torch.bfloat16 else 1e-5) * float(want.abs().max())
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=0)
    # rows outside orows are untouched
    rest = torch.ones(M + 3, dtype=torch.bool)
    rest[orows] = False
    torch.testing.assert_close(out.float()[rest], want[rest], atol=0, rtol=0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_gemm_overwrites_without_accumulate(fmt, libs):
    dt = FORMATS[fmt]
    a, w = torch.randn(20, 64).to(dt), torch.randn(48, 64).to(dt)
    out = torch.full((20, 48), float("nan"), dtype=torch.float32)
    assert cpu_native.gemm(a, w, "rows", out, lib=libs["native"])
    torch.testing.assert_close(out, a.float() @ w.float().t(), atol=1e-4, rtol=1e-5)


def test_gemm_declines_what_it_does_not_take(libs):
    lib = libs["native"]
    out = torch.zeros(4, 8)
    # another dtype, mixed operand dtypes, an odd bf16 reduction: the caller runs PyTorch instead
    assert not cpu_native.gemm(torch.zeros(4, 6, dtype=torch.float64), torch.zeros(8, 6, dtype=torch.float64), "rows", out, lib=lib)
    assert not cpu_native.gemm(torch.zeros(4, 6), torch.zeros(8, 6, dtype=torch.bfloat16), "rows", out, lib=lib)
    assert not cpu_native.gemm(torch.zeros(4, 5, dtype=torch.bfloat16), torch.zeros(8, 5, dtype=torch.bfloat16), "rows", out, lib=lib)
    assert torch.equal(out, torch.zeros(4, 8))
    with pytest.raises(ValueError, match="gemm shapes"):
        cpu_native.gemm(torch.zeros(4, 6), torch.zeros(8, 7), "rows", out, lib=lib)


@pytest.mark.parametrize("weights", ["bf16", "int8"])
@pytest.mark.parametrize("p_skip", [0.0, 0.5, 1.0])
def test_low_precision_prefill_on_the_native_gemm_matches_reference(weights, p_skip, routed_model, random_masks, monkeypatch):
    if cpu_native.gemm_library() is None:
        pytest.skip("no native GEMM with vector code on this CPU (the prefill runs PyTorch's)")
    monkeypatch.setattr(cpu_proj, "_native_dtypes", lambda: frozenset({torch.bfloat16}))  # whatever this CPU's default
    calls = []
    real = cpu_native.gemm
    monkeypatch.setattr(cpu_native, "gemm", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = routed_model("qwen2")  # q/k/v biases: a bias must not leak into skipped groups
    T = 4 * SMALL_M + 3
    ids = torch.randint(5, 100, (2, T), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, T, dtype=torch.bool)
    mask[1, :7] = False  # left padding
    forced = random_masks(model, 2, T, p_skip, seed=2)
    ref = Runtime.from_model(model, backend="reference", weight_format=weights)
    cpu = Runtime.from_model(model, backend="cpu", weight_format=weights)
    ref.forced = cpu.forced = forced
    want, got = ref.forward(ids, mask), cpu.forward(ids, mask)
    assert calls or p_skip == 1.0
    # both compute in bf16; they differ in summation order and where partial sums round
    torch.testing.assert_close(got[mask], want[mask], atol=0.02 * float(want.abs().max()), rtol=0)
    assert cpu.stats.summary() == ref.stats.summary()


@pytest.mark.parametrize("flags", ["fpu avx2 fma", "fpu avx2 fma avx512f avx512_bf16"])
@pytest.mark.parametrize("choice", ["auto", "native", "torch"])
def test_the_gemm_choice_follows_the_cpu_and_the_override(flags, choice, monkeypatch):
    monkeypatch.setattr(cpu_native, "cpu_flags", lambda: "flags\t\t: " + flags)
    monkeypatch.setenv("WIDE_CPU_GEMM", choice)
    got = cpu_proj._native_gemm_dtypes()
    assert torch.float32 not in got  # fp32 stays on PyTorch's GEMMs
    fast_bf16 = "avx512_bf16" in flags
    assert (torch.bfloat16 in got) == (choice == "native" or (choice == "auto" and not fast_bf16))


@pytest.mark.parametrize("weights", ["bf16", "int8"])
def test_batched_low_precision_decode_matches_reference(weights, routed_model, random_masks, monkeypatch):
    monkeypatch.setattr(cpu_proj, "_native_dtypes", lambda: frozenset({torch.bfloat16}))
    model = routed_model("llama")
    B, T, steps = 4, 6, 8
    ids = torch.randint(5, 100, (B, T), generator=torch.Generator().manual_seed(9))
    ref = Runtime.from_model(model, backend="reference", weight_format=weights)
    cpu = Runtime.from_model(model, backend="cpu", weight_format=weights)
    cpu.native_decode = False  # the PyTorch step's GEMMs (the native step: test_cpu_native.py)
    ref.forced = cpu.forced = random_masks(model, B, T + steps, 0.5, seed=4)
    c_ref, c_cpu = ref.new_cache(B, T + steps), cpu.new_cache(B, T + steps)
    lr, lc = ref.step(ids, None, c_ref), cpu.step(ids, None, c_cpu)
    for _ in range(steps):
        torch.testing.assert_close(lc, lr, atol=0.02 * float(lr.abs().max()), rtol=0)
        nxt = lr.argmax(-1)[:, None]
        lr, lc = ref.step(nxt, None, c_ref), cpu.step(nxt, None, c_cpu)
    assert cpu.stats.summary() == ref.stats.summary()


@pytest.mark.parametrize("build", ["native", "portable"])  # the OpenMP team; the pthread pool
@pytest.mark.parametrize("M", [5, 40])
def test_two_threads_give_the_same_gemm_as_one(M, build, libs):
    g = torch.Generator().manual_seed(M)
    a, w = torch.randn(M, 96, generator=g).to(torch.bfloat16), torch.randn(200, 96, generator=g).to(torch.bfloat16)
    outs = []
    before = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = torch.empty(M, 200)
            assert cpu_native.gemm(a, w, "rows", out, lib=libs[build])
            outs.append(out)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])  # threads split output columns: the same sums per column


def test_a_struct_mirror_that_differs_from_the_library_is_refused(libs, monkeypatch):
    import ctypes

    cpu_native._check_layout(libs["native"])  # the shipped mirror matches
    bad = type("_WModel", (ctypes.Structure,), {"_fields_": cpu_native._WModel._fields_[:-1]})
    monkeypatch.setattr(cpu_native, "_WModel", bad)
    with pytest.raises(RuntimeError, match="struct layout"):
        cpu_native._check_layout(libs["native"])


@pytest.mark.parametrize("build", ["native", "portable"])
def test_a_forked_child_runs_the_gemm_after_the_parent_used_two_threads(build, libs):
    """The child has none of the parent's worker threads (GNU OpenMP's team and the pthread pool's
    workers do not survive fork): the library notices the fork and runs the child's calls on one
    thread instead of waiting for threads that do not exist."""
    import os

    lib = libs[build]
    a, w = torch.randn(40, 64).to(torch.bfloat16), torch.randn(96, 64).to(torch.bfloat16)
    want = torch.empty(40, 96)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert cpu_native.gemm(a, w, "rows", want, lib=lib)  # starts the parent's worker
    finally:
        torch.set_num_threads(before)
    r, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: same call, then report through the pipe
        ok = 0
        try:
            got = torch.empty(40, 96)
            torch.set_num_threads(2)
            ok = int(cpu_native.gemm(a, w, "rows", got, lib=lib) and torch.equal(got, want))
        finally:
            os.write(wfd, bytes([ok]))
            os._exit(0)
    os.close(wfd)
    import select
    import signal

    if not select.select([r], [], [], 120)[0]:  # a child waiting for threads that do not exist
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's call did not return within 120 s")
    _, status = os.waitpid(pid, 0)
    assert os.read(r, 1) == b"\x01" and status == 0


def test_the_library_and_pytorch_share_one_openmp_runtime(libs):
    """The native build's worker threads are PyTorch's OpenMP team: a second runtime (a second
    libgomp, or a pool of its own) would spin against PyTorch's threads between the two's calls."""
    import os

    if not os.path.exists("/proc/self/maps"):
        pytest.skip("needs /proc/self/maps (Linux)")
    torch.set_num_threads(torch.get_num_threads())  # PyTorch (and its libgomp) is loaded
    import re

    # Files of the soname libgomp.so.1 (PyTorch's copy, or the system's); wheels that vendor their
    # own under a hashed name (sentencepiece's libgomp-<hash>.so) are separate runtimes of theirs.
    with open("/proc/self/maps") as f:
        gomp = {line.split()[-1] for line in f if re.search(r"/libgomp\.so\.1(\.\d+)*$", line.strip())}
    assert len(gomp) == 1, gomp
