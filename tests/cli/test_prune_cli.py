"""`wide prune` end to end on a tiny model, its --json contract, bad input (one line, non-zero
exit, nothing half-written), and every flag reaching the settings (a
flag that is parsed but ignored is a silent bug)."""

from __future__ import annotations

import inspect
import json
import math

import pytest
import torch
from typer.testing import CliRunner

from wide_cli.cli.app import app, main
from wide_cli.cli.commands.prune import prune_cmd
from wide_cli.cli.options import FLAG_FIELDS, resolve_settings

TINY = ["--steps", "4", "--seq-len", "32", "--batch-size", "2", "--attn-group-size", "2",
        "--ffn-group-size", "32", "--eval-max-tokens", "2048"]


def _prune(tmp_path, text_file, *extra, name="run"):
    args = ["prune", "tiny-llama", "--data", str(text_file), "--run-dir", str(tmp_path / name), *TINY,
            *extra, "--json"]
    return CliRunner().invoke(app, args, catch_exceptions=False)


def test_prune_json_contract(tmp_path, text_file):
    r = _prune(tmp_path, text_file)
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(res) >= {"export_dir", "sparsity", "eval", "train"}
    for k in ("attention", "ffn", "total"):
        assert 0.0 <= res["sparsity"][k] <= 1.0
    assert res["sparsity"]["total"] == pytest.approx((res["sparsity"]["attention"] + res["sparsity"]["ffn"]) / 2)
    assert math.isfinite(res["eval"]["dense"]["perplexity"]) and math.isfinite(res["eval"]["pruned"]["perplexity"])
    assert res["train"]["steps"] == 4 and res["train"]["tokens"] == 4 * 2 * 32
    exp = tmp_path / "run" / "export"
    assert res["export_dir"] == str(exp)
    wcfg = json.loads((exp / "wide_config.json").read_text())
    assert wcfg["routing"]["ffn_group_size"] == 32 and wcfg["settings"]["train"]["steps"] == 4


def _run_main(argv, capsys):
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.err.strip().splitlines()


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--attn-group-size", "3"], "attn-group-size 3 does not divide 4 query heads (2 KV heads)"),
        (["--ffn-group-size", "48"], "ffn-group-size 48 does not divide intermediate size 128"),
        (["--sparsity", "1.0"], "sparsity 1.0 is outside [0, 1)"),
        (["--sparsity", "-0.2"], "sparsity -0.2 is outside [0, 1)"),
        (["--sparsity-attention", "0.5"], "sparsity-attention and sparsity-ffn must be set together"),
        (["--method", "banana"], "unknown method 'banana'"),
        (["--seq-len", "100000"], "seq-len 100000 exceeds the model's context length 512"),
        (["--seq-len", "500", "--max-train-tokens", "700"], "too few for one training and one held-out sequence of seq-len 500"),
    ],
)
def test_bad_settings_fail_with_one_line_and_nothing_written(tmp_path, text_file, capsys, flags, message):
    argv = ["prune", "tiny-llama", "--data", str(text_file), "--run-dir", str(tmp_path / "r"), *TINY, *flags]
    code, err = _run_main(argv, capsys)
    assert code == 2
    errors = [line for line in err if line.startswith("error: ")]
    assert len(errors) == 1 and err[-1] == errors[0] and message in errors[0], err
    assert not (tmp_path / "r" / "export").exists()


def test_unknown_alias_and_missing_path(tmp_path, capsys):
    code, err = _run_main(["prune", "no-such-model", "--run-dir", str(tmp_path / "r")], capsys)
    assert code == 2 and "no-such-model" in err[-1] and "smollm2-135m" in err[-1]
    code, err = _run_main(["prune", str(tmp_path / "missing-dir/"), "--run-dir", str(tmp_path / "r")], capsys)
    assert code == 2 and "missing-dir" in err[-1]


def test_unsupported_architecture(tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    d = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128)).save_pretrained(d)
    code, err = _run_main(["prune", str(d), "--run-dir", str(tmp_path / "r")], capsys)
    assert code == 2 and "unsupported architecture" in err[-1] and "LlamaForCausalLM" in err[-1]


def test_too_short_data(tmp_path, capsys):
    p = tmp_path / "short.txt"
    p.write_text("only a few words")
    code, err = _run_main(["prune", "tiny-llama", "--data", str(p), "--run-dir", str(tmp_path / "r"), *TINY], capsys)
    assert code == 2 and err[-1].startswith("error: only 17 tokens from 1 documents: too few")
    assert "use a smaller --seq-len or more data" in err[-1]
    assert not (tmp_path / "r" / "export").exists()


def test_resume_in_run_dir_of_another_model(tmp_path, text_file, capsys):
    assert _prune(tmp_path, text_file).exit_code == 0
    code, err = _run_main(["prune", "tiny-qwen3", "--data", str(text_file), "--run-dir", str(tmp_path / "run"),
                           *TINY, "--resume"], capsys)
    assert code == 2 and "belongs to model 'tiny-llama'" in err[-1]


def test_b12_fp16_on_cpu_upcasts_once_and_bf16_runs(tmp_path, text_file):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = _prune(tmp_path, text_file, "--dtype", "fp16", name="fp16")
    assert r.exit_code == 0
    fp16 = [w for w in caught if "fp16 is not supported on CPU" in str(w.message)]
    assert len(fp16) == 1, [str(w.message) for w in caught]
    r32 = _prune(tmp_path, text_file, "--dtype", "fp32", name="fp32")
    rb = _prune(tmp_path, text_file, "--dtype", "bf16", name="bf16")
    assert rb.exit_code == 0
    d32 = json.loads(r32.stdout.strip().splitlines()[-1])["eval"]["dense"]["perplexity"]
    db = json.loads(rb.stdout.strip().splitlines()[-1])["eval"]["dense"]["perplexity"]
    assert abs(db - d32) / d32 < 0.01


# ------------------------------------------------------------------ every flag is used
NOT_SETTINGS = {"model", "recipe", "run_dir", "out", "resume", "json_out", "nproc", "threads"}

SAMPLE = {
    "data": "x.txt", "eval_data": "y.txt", "heldout_fraction": 0.2, "max_train_tokens": 999, "self_generated": 12, "self_generated_text": 7, "shuffle_documents": False,
    "method": "dynamic-depth", "sparsity": 0.3, "sparsity_attention": 0.4, "sparsity_ffn": 0.2,
    "sparsity_weight": 7.0, "attn_group_size": 1, "ffn_group_size": 64, "router_rank": 8, "router_input": "standardized",
    "tau_start": 3.0, "tau_end": 0.7, "steps": 9, "seq_len": 64, "batch_size": 3, "grad_accum": 2,
    "lr": 1e-3, "seed": 5, "checkpoint_every": 3, "grad_checkpointing": True, "max_memory": "12GiB", "dtype": "bf16", "train_dtype": "bf16", "device": "cuda", "router_init": "calibration",
    "eval_seq_len": 48, "eval_max_tokens": 4096, "eval_batch_size": 2, "lora": True, "lora_steps": 11,
    "lora_lr": 1e-4, "lora_rank": 8, "lora_alpha": 16.0, "freeze_routers": True,
    "cost_target": 0.7, "cost_metric": "decode_bytes", "sparsity_warmup": 0.2, "standin": "trained",
    "distill": 0.5, "distill_temperature": 2.0, "lora_joint": True, "drop_layers": 3,
}


def test_b25_every_prune_option_reaches_the_settings():
    params = set(inspect.signature(prune_cmd).parameters)
    assert params - NOT_SETTINGS == set(FLAG_FIELDS), "a prune option is not mapped to a setting"
    assert set(SAMPLE) == set(FLAG_FIELDS)
    base = resolve_settings("tiny-llama", None, {})
    for flag, value in SAMPLE.items():
        extra = {"sparsity_ffn": 0.2} if flag == "sparsity_attention" else {}
        extra = {"sparsity_attention": 0.4} if flag == "sparsity_ffn" else extra
        s = resolve_settings("tiny-llama", None, {flag: value, **extra})
        section, field = FLAG_FIELDS[flag]
        assert getattr(getattr(s, section), field) == value, flag
        assert getattr(getattr(base, section), field) != value, f"{flag}: sample equals the default"


@pytest.mark.parametrize("flag,a,b", [("ffn_group_size", "32", "64"), ("seed", "0", "1"), ("tau_start", "5.0", "1.0")])
def test_b25_options_change_the_trained_routers(tmp_path, text_file, flag, a, b):
    from safetensors.torch import load_file

    outs = []
    for i, v in enumerate((a, b)):
        args = [*TINY]
        if flag == "ffn_group_size":
            args[args.index("--ffn-group-size") + 1] = v
        else:
            args += [f"--{flag.replace('_', '-')}", v]
        r = CliRunner().invoke(app, ["prune", "tiny-llama", "--data", str(text_file), "--run-dir",
                                     str(tmp_path / f"r{i}"), *args], catch_exceptions=False)
        assert r.exit_code == 0, r.output
        outs.append(load_file(str(tmp_path / f"r{i}" / "export" / "routers.safetensors")))
    same = set(outs[0]) == set(outs[1]) and all(
        outs[0][k].shape == outs[1][k].shape and torch.equal(outs[0][k], outs[1][k]) for k in outs[0])
    assert not same, f"--{flag} {a} vs {b} gave identical routers"


def test_help_lists_every_command():
    r = CliRunner().invoke(app, ["--help"])
    for cmd in ("prune", "calibrate", "train", "export", "eval", "recipes"):
        assert cmd in r.output


@pytest.mark.parametrize("form", [["--nproc=2"], ["--nproc", "2"]])
def test_nproc_in_either_form_relaunches_under_torchrun_without_the_flag(form, monkeypatch):
    """``--nproc=2`` (the ``=`` form) re-runs under torchrun like ``--nproc 2``."""
    from wide_cli.train import distributed

    seen = {}

    def fake_relaunch(nproc, argv, threads=None):
        seen.update(nproc=nproc, argv=argv)
        return 0

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(distributed, "relaunch_with_torchrun", fake_relaunch)
    argv = ["prune", "tiny-llama", *form, "--steps", "4", "--attn-group-size", "2"]
    monkeypatch.setattr("sys.argv", ["wide", *argv])
    assert main(argv) == 0
    assert seen == {"nproc": 2, "argv": ["prune", "tiny-llama", "--steps", "4", "--attn-group-size", "2"]}


def test_prune_without_group_flags_uses_one_attention_group_per_kv_head(tmp_path, text_file):
    """tiny-llama has 4 query heads and 2 KV heads: the default attention group is 2 heads."""
    args = ["prune", "tiny-llama", "--data", str(text_file), "--run-dir", str(tmp_path / "r"), "--steps", "2",
            "--seq-len", "32", "--batch-size", "2", "--eval-max-tokens", "512", "--json"]
    r = CliRunner().invoke(app, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    wcfg = json.loads((tmp_path / "r" / "export" / "wide_config.json").read_text())
    assert wcfg["layout"]["attn_group_size"] == 2 and wcfg["layout"]["attn_groups"] == 2


NO_HELDOUT = ("error: --heldout-fraction 0 leaves no held-out data to evaluate on "
              "(pass --eval-data FILE or --heldout-fraction > 0)")


def test_prune_without_held_out_data_is_refused_before_calibrating(tmp_path, text_file, capsys):
    run = tmp_path / "run"
    code = main(["prune", "tiny-llama", "--data", str(text_file), "--run-dir", str(run), *TINY,
                 "--heldout-fraction", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert err == [NO_HELDOUT]
    assert not run.exists()


def test_prune_with_eval_data_needs_no_held_out_split(tmp_path, text_file):
    r = _prune(tmp_path, text_file, "--heldout-fraction", "0", "--eval-data", str(text_file))
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["calibration"]["heldout_sequences"] == 0 and res["eval"]["data"] == str(text_file)


def test_prune_help_states_what_a_zero_held_out_fraction_needs():
    r = CliRunner().invoke(app, ["prune", "--help"], env={"COLUMNS": "200"})
    assert "0 needs --eval-data FILE" in " ".join(r.output.replace("│", " ").split()), r.output
