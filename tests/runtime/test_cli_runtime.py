"""`wide generate` and `wide bench` on a tiny export: every flag reaches the library (a flag
that is parsed but ignored is a silent bug)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from wide_cli.cli.app import app


def _run(args):
    r = CliRunner().invoke(app, args, catch_exceptions=False)
    return r


def _gen_json(exp, *extra):
    r = _run(["generate", str(exp), "-p", "hello", "--threads", "1", "--json", *extra])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_generate_streams_text_and_reports_stats(tiny_export):
    r = _run(["generate", str(tiny_export), "-p", "hello", "--max-new-tokens", "6", "--ignore-eos", "--threads", "1"])
    assert r.exit_code == 0
    assert "tok/s" in r.stderr and "measured sparsity" in r.stderr and "tok/s" not in r.stdout
    doc = _gen_json(tiny_export, "--max-new-tokens", "6", "--ignore-eos")
    assert r.stdout.strip() == doc["texts"][0].strip()


def test_generate_flags_take_effect(tiny_export):
    base = _gen_json(tiny_export, "--max-new-tokens", "8", "--ignore-eos")
    assert len(base["tokens"][0]) == 8 and base["routing"] and base["backend"] == "cpu"
    assert len(_gen_json(tiny_export, "--max-new-tokens", "3", "--ignore-eos")["tokens"][0]) == 3
    ref = _gen_json(tiny_export, "--max-new-tokens", "8", "--ignore-eos", "--backend", "reference")
    assert ref["backend"] == "reference" and ref["tokens"] == base["tokens"]
    dense = _gen_json(tiny_export, "--max-new-tokens", "8", "--ignore-eos", "--no-routing")
    assert dense["sparsity"]["total"] == 0.0 and base["sparsity"]["total"] > 0.0
    s1 = _gen_json(tiny_export, "--max-new-tokens", "8", "--ignore-eos", "--temperature", "2.0", "--seed", "1")
    s1b = _gen_json(tiny_export, "--max-new-tokens", "8", "--ignore-eos", "--temperature", "2.0", "--seed", "1")
    s2 = _gen_json(tiny_export, "--max-new-tokens", "8", "--ignore-eos", "--temperature", "2.0", "--seed", "2")
    assert s1["tokens"] == s1b["tokens"] and s1["tokens"] != s2["tokens"]
    tp = _gen_json(tiny_export, "--max-new-tokens", "8", "--ignore-eos", "--temperature", "2.0", "--seed", "1", "--top-p", "0.000001")
    assert tp["tokens"] == base["tokens"]  # a tiny nucleus leaves the argmax token only
    assert _gen_json(tiny_export, "--dtype", "bf16", "--max-new-tokens", "2")["dtype"] == "bfloat16"
    stop = base["texts"][0][2:4]
    st = _gen_json(tiny_export, "--max-new-tokens", "8", "--ignore-eos", "--stop", stop)
    assert st["finish_reasons"] == ["stop"] and stop not in st["texts"][0]
    two = _run(["generate", str(tiny_export), "-p", "ab", "-p", "cde", "--max-new-tokens", "2", "--threads", "1"])
    assert two.exit_code == 0 and "[0]" in two.stdout and "[1]" in two.stdout


def test_generate_errors_are_one_line(tiny_export, tmp_path):
    from wide_cli.cli.app import main

    assert main(["generate", str(tmp_path / "nope"), "-p", "x"]) == 2
    assert main(["generate", str(tiny_export), "-p", "x", "--top-p", "0"]) == 2
    assert main(["generate", str(tiny_export), "-p", "x", "--backend", "tpu"]) == 2


def test_bench_flags_reach_the_config(tiny_export, monkeypatch, capsys):
    from wide_cli.bench import run
    from wide_cli.bench.report import BenchReport

    seen = {}

    def fake(path, cfg, log=None):
        seen["cfg"] = cfg
        return BenchReport(str(path), cfg, [], {"dtype": "float32", "threads": 1}, {}, [])

    monkeypatch.setattr(run, "run_bench", fake)
    args = ["bench", str(tiny_export), "--prefill-lengths", "5,7", "--decode-batches", "3", "--new-tokens", "4",
            "--decode-prompt-len", "6", "--repeats", "2", "--warmup", "0", "--systems", "dense,cpu",
            "--dense-backend", "reference", "--dtype", "bf16", "--threads", "1", "--forced-sparsity", "0.25",
            "--seed", "9", "--json"]  # fmt: skip
    r = _run(args)
    assert r.exit_code == 0, r.output
    cfg = seen["cfg"]
    assert (cfg.prefill_lengths, cfg.decode_batches, cfg.new_tokens, cfg.decode_prompt_len) == ((5, 7), (3,), 4, 6)
    assert (cfg.repeats, cfg.warmup, cfg.systems, cfg.dense_backend) == (2, 0, ("dense", "cpu"), "reference")
    assert (cfg.dtype, cfg.threads, cfg.forced_sparsity, cfg.seed) == ("bf16", (1,), 0.25, 9)
    assert cfg.weights == ("bf16",)
    r = _run(["bench", str(tiny_export), "--weights", "fp32,int8", "--threads", "1,2", "--json"])
    assert (seen["cfg"].weights, seen["cfg"].threads) == (("fp32", "int8"), (1, 2))
    r = _run(["bench", str(tiny_export), "--quick", "--new-tokens", "3", "--json"])
    assert seen["cfg"].prefill_lengths == (32, 128) and seen["cfg"].new_tokens == 3
    r = _run(["bench", str(tiny_export), "--protocol", "llama-bench", "--repeats", "2", "--json"])
    cfg = seen["cfg"]
    assert (cfg.prefill_lengths, cfg.decode_batches, cfg.new_tokens, cfg.decode_prompt_len) == ((512,), (1,), 128, 1)
    assert cfg.repeats == 2  # an explicit flag wins over the protocol
    from wide_cli.cli.app import main

    assert main(["bench", str(tiny_export), "--protocol", "llama-bnch"]) == 2
    assert "error: unknown --protocol 'llama-bnch'" in capsys.readouterr().err


def test_bench_quick_real_run(tiny_export, tmp_path):
    out = tmp_path / "b.json"
    r = _run(["bench", str(tiny_export), "--prefill-lengths", "9", "--decode-batches", "1,2", "--new-tokens", "3",
              "--decode-prompt-len", "4", "--repeats", "1", "--warmup", "0", "--threads", "1", "--json-out", str(out)])  # fmt: skip
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    rows = {(e["system"], e["phase"], e["batch"]): e for e in doc["results"]}
    assert {s for s, _, _ in rows} == {"hf", "dense", "reference", "cpu"}
    assert len(rows) == 4 * 3
    for e in doc["results"]:
        for key in ("system", "threads", "shape", "tokens_per_s", "skips_work", "executed_mac_fraction"):
            assert key in e
    cpu = rows[("cpu", "decode", 1)]
    for key in ("tokens_per_s", "decode_speedup_vs_hf", "ideal_speedup", "measured_sparsity"):
        assert cpu[key] is not None
    assert rows[("hf", "prefill", 1)]["prefill_speedup_vs_hf"] == 1.0
    assert 0 < cpu["measured_sparsity"]["total"] < 1 and cpu["ideal_speedup"] > 1.0
    assert cpu["skips_work"] and cpu["executed_mac_fraction"] < 1.0
    assert rows[("dense", "decode", 1)]["measured_sparsity"] is None
    # masking-only rows: the reference backend computes dense, then masks: no ideal bound
    ref = rows[("reference", "decode", 1)]
    assert not ref["skips_work"] and ref["ideal_speedup"] is None and ref["executed_mac_fraction"] >= 1.0
    dense = rows[("dense", "prefill", 1)]
    assert not dense["skips_work"] and dense["executed_mac_fraction"] == pytest.approx(1.0, abs=1e-9)
    assert rows[("hf", "decode", 1)]["executed_mac_fraction"] is None  # dense code, not instrumented
    assert "wide bench" in r.stderr


def test_bench_batch_rows_skip_work_even_when_the_union_is_everything(tiny_export):
    """A decode batch whose rows together execute every group: each row still runs only its own
    groups (the native step), so the row skips work; every weight is read once per step, so its
    byte bound is 1 (the dense system's counted bytes over its own)."""
    from wide_cli.bench.config import BenchConfig
    from wide_cli.bench.run import run_bench

    cfg = BenchConfig(prefill_lengths=(), decode_batches=(16,), new_tokens=2, decode_prompt_len=4, repeats=1,
                      warmup=0, systems=("dense", "cpu"), forced_sparsity=0.3)  # fmt: skip
    rows = {e.system: e for e in run_bench(tiny_export, cfg).entries}
    cpu, dense = rows["cpu"], rows["dense"]
    assert cpu.path == dense.path == "native"
    assert cpu.measured_sparsity["total"] > 0.2
    assert cpu.skips_work and cpu.executed_mac_fraction < 0.9
    assert cpu.weight_bytes_per_step == dense.weight_bytes_per_step and cpu.ideal_speedup == 1.0


def test_bench_weight_bytes_come_from_the_cost_model():
    """The bench's per-token weight bytes and bound are the cost model's (wide_cli.cost)."""
    from wide_cli.bench.dense_work import decode_cost, weight_bytes
    from wide_cli.cost import cost_model
    from wide_cli.models.arch import model_shape
    from wide_cli.models.tiny import tiny_model
    from wide_cli.routing import RoutingConfig, attach_routers
    from wide_cli.runtime.checkpoint import weights_from_model

    model = tiny_model("llama")
    attach_routers(model, RoutingConfig(attn_group_size=2, ffn_group_size=32))
    weights, _ = weights_from_model(model)
    wb = weight_bytes(weights, 2)
    direct = sum(p.numel() for n, p in model.named_parameters() if "router" not in n and "embed" not in n)
    assert sum(wb.values()) == 2 * (direct + model.config.hidden_size)  # + one embedding row
    shape = model_shape(model.config)
    cm = cost_model(shape, metric="decode_bytes", attn_group_size=2, ffn_group_size=32)
    assert decode_cost(weights) == cm
    half = {"attention": 0.5, "ffn": 0.5}
    # without low-rank stand-ins the per-group model is the per-module one
    assert decode_cost(weights).speedup_bound(half) == pytest.approx(
        cost_model(shape, metric="decode_bytes").speedup_bound(half))
    low = tiny_model("llama")
    attach_routers(low, RoutingConfig(attn_group_size=2, ffn_group_size=32, standin="lowrank:4"))
    lw, _ = weights_from_model(low)
    assert decode_cost(lw) == cost_model(shape, metric="decode_bytes", attn_group_size=2, ffn_group_size=32,
                                         standin_rank=4)
    assert 1.0 < decode_cost(lw).speedup_bound(half) < decode_cost(weights).speedup_bound(half)


def test_generate_runs_a_dense_model_spec_and_side_by_side(tiny_export):
    import torch

    from wide_cli.models.loader import load_model

    doc = _run(["generate", "tiny-llama", "-p", "hello", "--max-new-tokens", "5", "--ignore-eos", "--threads", "1",
                "--json"])
    assert doc.exit_code == 0, doc.output
    dense = json.loads(doc.stdout)
    assert dense["routing"] is False and len(dense["tokens"][0]) == 5
    lm = load_model("tiny-llama")  # the runtime's greedy tokens are HF greedy on the dense model
    ids = lm.tokenizer("hello", return_tensors="pt").input_ids
    with torch.no_grad():
        ref = lm.model.generate(ids, max_new_tokens=5, do_sample=False, min_new_tokens=5)
    assert dense["tokens"][0] == ref[0, ids.shape[1]:].tolist()
    r = _run(["generate", "tiny-llama", str(tiny_export), "-p", "ab", "-p", "cde", "--max-new-tokens", "3",
              "--ignore-eos", "--threads", "1", "--json"])
    assert r.exit_code == 0, r.output
    both = json.loads(r.stdout)
    assert [m["model"] for m in both["models"]] == ["tiny-llama", str(tiny_export)]
    assert both["models"][0]["tokens"][0][:3] == _gen_tokens("tiny-llama", "ab")
    assert all(len(m["texts"]) == 2 for m in both["models"]) and both["models"][1]["routing"] is True
    table = _run(["generate", "tiny-llama", str(tiny_export), "-p", "ab", "--max-new-tokens", "3", "--threads", "1"])
    assert table.exit_code == 0 and "tiny-llama" in table.stdout and "ab" in table.stdout


def _gen_tokens(model, prompt):
    r = _run(["generate", model, "-p", prompt, "--max-new-tokens", "3", "--ignore-eos", "--threads", "1", "--json"])
    return json.loads(r.stdout)["tokens"][0]


def test_compare_times_routed_exports_routed_and_dense_models_dense(tiny_export):
    from wide_cli.eval.compare import SpeedConfig, _has_routers, measure_speed
    from wide_cli.runtime.engine import Runtime

    assert _has_routers(Runtime.from_target(tiny_export)) and not _has_routers(Runtime.from_target("tiny-llama"))
    sp = measure_speed(["tiny-llama", str(tiny_export)],
                       SpeedConfig(new_tokens=2, decode_prompt_len=4, prefill_len=8, repeats=1, warmup=0))
    assert sp["tiny-llama"]["sparsity"] is None and sp[str(tiny_export)]["sparsity"]["total"] > 0
    assert len(sp[str(tiny_export)]["decode_seconds"]) == 1 and sp["tiny-llama"]["prefill_tokens_per_s"] > 0


def test_speed_runs_one_target_in_several_weight_formats(tiny_export):
    from wide_cli.errors import ConfigError
    from wide_cli.eval.compare import SpeedConfig, measure_speed, speed_key

    cfg = SpeedConfig(new_tokens=2, decode_prompt_len=4, prefill_len=8, repeats=1, warmup=0)
    sp = measure_speed(["tiny-llama", "tiny-llama", str(tiny_export)], cfg, weight_formats=[None, "int8", "int4"])
    assert list(sp) == ["tiny-llama", "tiny-llama (int8)", f"{tiny_export} (int4)"]
    assert [v["weight_format"] for v in sp.values()] == ["fp32", "int8", "int4"]
    assert sp[speed_key(str(tiny_export), "int4")]["sparsity"]["total"] > 0
    with pytest.raises(ConfigError, match="listed twice"):
        measure_speed(["tiny-llama", "tiny-llama"], cfg)
    with pytest.raises(ConfigError, match="2 weight formats for 1 targets"):
        measure_speed(["tiny-llama"], cfg, weight_formats=["int8", "int4"])
