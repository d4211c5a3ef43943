"""Recipes: every shipped recipe validates; bad keys and values name themselves; flags win."""

import pytest

from wide_cli.cli.options import resolve_settings
from wide_cli.errors import ConfigError
from wide_cli.pipeline.recipes import list_recipes
from wide_cli.pipeline.settings import load_recipe


@pytest.mark.parametrize("path", list_recipes(), ids=lambda p: p.stem)
def test_shipped_recipes_validate_and_round_trip(path, tmp_path):
    s = load_recipe(path)
    assert s.routing.sparsity == 0.5 and s.routing.router_rank == 32
    # Round-trip: the resolved dict written as TOML loads back to the same settings.
    lines = []
    for section, values in s.to_dict().items():
        lines.append(f"[{section}]")
        for k, v in values.items():
            if v is None:
                continue
            lit = (str(v).lower() if isinstance(v, bool) else repr(v) if not isinstance(v, list)
                   else "[" + ", ".join(repr(x) for x in v) + "]")
            lines.append(f"{k} = {lit}".replace("'", '"'))
    p = tmp_path / "r.toml"
    p.write_text("\n".join(lines))
    assert load_recipe(p) == s


def test_paper_recipe_numbers():
    s = load_recipe("llama-3.1-8b-paper")
    assert (s.routing.attn_group_size, s.routing.ffn_group_size, s.train.steps, s.train.seq_len) == (4, 128, 10000, 4096)
    assert s.train.sequences_per_step == 16 and s.train.lr == 2e-3


def _write(tmp_path, text):
    p = tmp_path / "bad.toml"
    p.write_text(text)
    return p


def test_unknown_key_suggests_nearest(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key routing.attn_group_sise \(did you mean 'attn_group_size'\?\)"):
        load_recipe(_write(tmp_path, "[routing]\nattn_group_sise = 3\n"))


def test_unknown_section(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown section \[trian\] \(did you mean 'train'\?\)"):
        load_recipe(_write(tmp_path, "[trian]\nsteps = 3\n"))


def test_bad_value_names_field(tmp_path):
    with pytest.raises(ConfigError, match="sparsity 1.2 is outside"):
        load_recipe(_write(tmp_path, "[routing]\nsparsity = 1.2\n"))
    with pytest.raises(ConfigError, match="router-init 'magic' unknown"):
        load_recipe(_write(tmp_path, "[run]\nrouter_init = 'magic'\n"))


def test_toml_syntax_error(tmp_path):
    with pytest.raises(ConfigError, match="bad.toml"):
        load_recipe(_write(tmp_path, "[routing\n"))


def test_missing_recipe():
    with pytest.raises(ConfigError, match="recipe 'nope.toml' not found"):
        load_recipe("nope.toml")


def test_flags_override_recipe():
    s = resolve_settings(None, "smollm2-135m-cpu", {"steps": 7, "sparsity": 0.3, "lr": None})
    assert s.train.steps == 7 and s.routing.sparsity == 0.3
    assert s.train.lr == load_recipe("smollm2-135m-cpu").train.lr  # None = keep the recipe's
    s = resolve_settings("tiny-llama", "smollm2-135m-cpu", {})
    assert s.model.name == "tiny-llama"


def test_sparsity_flag_replaces_the_recipe_cost_target():
    # The demo recipe sets a cost target; a user who asks for --sparsity on the command line means
    # the paper's group fraction, which the cost target would otherwise silently override.
    assert load_recipe("smollm2-135m-cpu").routing.cost_target is not None
    s = resolve_settings(None, "smollm2-135m-cpu", {"sparsity": 0.5})
    assert s.routing.sparsity == 0.5 and s.routing.cost_target is None
    s = resolve_settings(None, "smollm2-135m-cpu", {"sparsity_attention": 0.4, "sparsity_ffn": 0.2})
    assert s.routing.cost_target is None
    s = resolve_settings(None, "smollm2-135m-cpu", {"cost_target": 0.6})
    assert s.routing.cost_target == 0.6


def test_sparsity_and_cost_target_flags_together_are_refused():
    with pytest.raises(ConfigError, match=r"--sparsity 0.5 and --cost-target 0.6 both given"):
        resolve_settings(None, None, {"sparsity": 0.5, "cost_target": 0.6})


def test_a_method_flag_without_layer_drop_clears_the_recipe_drop_layers():
    # A recipe may describe a hybrid (layers dropped + routed width); `--method static-depth` or
    # `static-width` on the command line asks for another method, for which the recipe's layer
    # count means nothing: it is cleared instead of refused. `--drop-layers` given with such a
    # method is still an error (the user said both).
    base = resolve_settings(None, "smollm2-135m-cpu", {})
    recipe = base.replace("routing", drop_layers=3)
    from unittest import mock

    with mock.patch("wide_cli.pipeline.settings.load_recipe", return_value=recipe):
        for method in ("static-depth", "static-width"):
            s = resolve_settings(None, "smollm2-135m-cpu", {"method": method})
            assert s.routing.method == method and s.routing.drop_layers == 0
        s = resolve_settings(None, "smollm2-135m-cpu", {"method": "dynamic-depth"})
        assert s.routing.drop_layers == 3
        assert resolve_settings(None, "smollm2-135m-cpu", {}).routing.drop_layers == 3
        with pytest.raises(ConfigError, match="drop-layers 2 applies to --method wide or dynamic-depth"):
            resolve_settings(None, "smollm2-135m-cpu", {"method": "static-depth", "drop_layers": 2})


@pytest.mark.parametrize("text,message", [
    ('[train]\nsteps = "5"\n', '[train] steps must be an integer, got "5" (a string)'),
    ("[train]\nbatch_size = 2.5\n", "[train] batch_size must be an integer, got 2.5 (a number)"),
    ("[train]\nseq_len = 64.0\n", "[train] seq_len must be an integer, got 64.0 (a number)"),
    ("[train]\ngrad_accum = true\n", "[train] grad_accum must be an integer, got true (true or false)"),
    ('[data]\nshuffle_documents = "false"\n', '[data] shuffle_documents must be true or false, got "false" (a string)'),
    ("[data]\nshuffle_documents = 0\n", "[data] shuffle_documents must be true or false, got 0 (an integer)"),
    ('[train]\nlr = "2e-3"\n', '[train] lr must be a number, got "2e-3" (a string)'),
    ("[routing]\nsparsity = true\n", "[routing] sparsity must be a number, got true (true or false)"),
    ("[model]\nname = 7\n", "[model] name must be a string, got 7 (an integer)"),
    ('[stage2]\ntarget_modules = "q_proj"\n', '[stage2] target_modules must be a list of strings, got "q_proj" (a string)'),
    ("[stage2]\ntarget_modules = [1]\n", "[stage2] target_modules must be a list of strings, got [1] (a list)"),
    ("[eval]\nmax_tokens = [1]\n", "[eval] max_tokens must be an integer, got [1] (a list)"),
])
def test_recipe_values_of_the_wrong_type_name_section_key_type_and_value(tmp_path, text, message):
    p = _write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_recipe(p)
    assert str(e.value).startswith(f"{p}: {message}"), str(e.value)


def test_recipe_integers_are_accepted_for_numbers(tmp_path):
    s = load_recipe(_write(tmp_path, "[train]\nlr = 1\ngrad_clip = 2\n[routing]\nsparsity_weight = 10\n"))
    assert (s.train.lr, s.train.grad_clip, s.routing.sparsity_weight) == (1.0, 2.0, 10.0)
    assert all(type(v) is float for v in (s.train.lr, s.train.grad_clip, s.routing.sparsity_weight))


def test_wide_recipes_refuses_a_value_of_the_wrong_type_in_one_line(tmp_path, capsys):
    from wide_cli.cli.app import main

    p = _write(tmp_path, '[train]\nsteps = "5"\n')
    assert main(["recipes", str(p)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f'error: {p}: [train] steps must be an integer, got "5" (a string) (write it without quotes)']


ALPHA_FIX = "(the LoRA update is scaled by alpha / rank: 0 leaves the model unchanged)"


@pytest.mark.parametrize("flags,message", [
    (["--lora-alpha", "0"], f"error: lora-alpha 0.0 must be > 0 {ALPHA_FIX}"),
    (["--lora-alpha", "-2"], f"error: lora-alpha -2.0 must be > 0 {ALPHA_FIX}"),
    (["--lora-alpha", "nan"], "error: lora-alpha nan must be a finite number"),
    (["--lora-alpha", "inf"], "error: lora-alpha inf must be a finite number"),
    (["--sparsity-weight", "nan"], "error: sparsity-weight nan must be a finite number"),
    (["--sparsity-weight", "-inf"], "error: sparsity-weight -inf must be a finite number"),
    (["--sparsity-weight", "-1"], "error: sparsity-weight -1.0 must be >= 0"),
    (["--lr", "inf"], "error: lr inf must be a finite number"),
    (["--lora-lr", "nan"], "error: lora-lr nan must be a finite number"),
    (["--tau-start", "inf"], "error: tau-start inf must be a finite number"),
])
def test_non_finite_and_out_of_range_numbers_are_refused_before_any_work(tmp_path, text_file, capsys, flags, message):
    from wide_cli.cli.app import main

    run = tmp_path / "run"
    code = main(["prune", "tiny-llama", "--data", str(text_file), "--lora", "--run-dir", str(run), "--steps", "1",
                 "--seq-len", "32", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert err == [message]
    assert not run.exists()


@pytest.mark.parametrize("text,message", [
    ("[stage2]\nlora_alpha = nan\n", "lora-alpha nan must be a finite number"),
    ("[train]\nweight_decay = -0.1\n", "weight-decay -0.1 must be >= 0"),
    ("[train]\nweight_decay = inf\n", "weight-decay inf must be a finite number"),
    ("[train]\ngrad_clip = nan\n", "grad-clip nan must be a finite number"),
    ("[train]\ngrad_clip = -1.0\n", "grad-clip -1.0 must be >= 0"),
    ("[routing]\ncost_target = nan\n", "cost-target nan must be a finite number"),
])
def test_recipe_numbers_must_be_finite_and_in_range(tmp_path, text, message):
    with pytest.raises(ConfigError) as e:
        load_recipe(_write(tmp_path, text))
    assert e.value.message == message


@pytest.mark.parametrize(("flags", "device", "want"),
                         [("fpu avx2 fma", "cpu", "fp32"), ("fpu avx2 avx512f avx512_bf16", "cpu", "bf16"),
                          ("fpu amx_bf16 amx_tile", "cpu", "bf16"), ("fpu avx2", "cuda", "bf16")])  # fmt: skip
def test_training_dtype_auto_is_bf16_only_where_the_hardware_multiplies_it(flags, device, want, monkeypatch):
    """The demo recipe's ``auto``: PyTorch's bf16 path is far slower than fp32 on CPUs without
    AVX512-BF16 or AMX, so training runs fp32 there."""
    from wide_cli.pipeline.common import effective_settings
    from wide_cli.runtime import cpu_native

    monkeypatch.setattr(cpu_native, "cpu_flags", lambda: "flags\t\t: " + flags)
    s = resolve_settings(None, "smollm2-135m-cpu", {})
    assert s.train.dtype == "auto"
    s = s.replace("model", device=device)
    assert effective_settings(s).train.dtype == want
