"""`wide inspect` as a library: sizes and parameters from the files, stored vs measured
sparsity, per-token routing decisions (checked against the routers themselves), static-width hf
exports, the PNG plot, and bad arguments."""

from __future__ import annotations

import json

import pytest
import torch

from tests._exports import routed_tiny_llama
from wide_cli.errors import CheckpointError, ConfigError
from wide_cli.export import export_model
from wide_cli.inspection import inspect_export
from wide_cli.inspection.render import SHADES, _shade, heatmap, render
from wide_cli.inspection.report import PromptTrace
from wide_cli.models.tiny import char_tokenizer, tiny_model
from wide_cli.routing import RoutingConfig, attach_routers, router_state_dict
from wide_cli.routing.gumbel import argmax_execute
from wide_cli.routing.measure import static_sparsity

TEXT = "The quick brown fox jumps over the lazy dog. " * 12
STORED = {"attention": 0.25, "ffn": 0.5, "total": 0.375, "tokens": 99, "data": "stored data",
          "per_layer": {"attention": [0.0, 0.5], "ffn": [0.25, 0.75]}}


def _wide_config(cfg, model):
    st = model.wide_routing.layout
    return {"method": cfg.method, "routing": cfg.to_dict(), "measured_sparsity": STORED,
            "layout": {"attn_group_size": st.attn_group_size, "ffn_group_size": st.ffn_group_size,
                       "attn_groups": st.attn_groups, "ffn_groups": st.ffn_groups, "kv_aligned": st.kv_aligned},
            "source_model": {"spec": "tiny-llama"}}


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("inspect")
    model, cfg = routed_tiny_llama()
    out = {"model": model}
    for fmt in ("wide", "hf"):
        out[fmt] = export_model(model, char_tokenizer(), root / f"i_{fmt}", wide_config=_wide_config(cfg, model),
                                export_format=fmt).path
    static = tiny_model("llama")
    scfg = RoutingConfig(method="static-width", attn_group_size=1, ffn_group_size=32)
    keep = {(0, "attention"): torch.tensor([True, False, True, True]), (1, "attention"): torch.tensor([False, True, False, False]),
            (0, "ffn"): torch.tensor([True, True, False, False]), (1, "ffn"): torch.tensor([False, False, False, True])}
    attach_routers(static, scfg, static_keep=keep)
    out["static"] = export_model(static, char_tokenizer(), root / "i_static", wide_config=_wide_config(scfg, static),
                                 export_format="hf").path
    dense = tiny_model("llama")
    dcfg = RoutingConfig(method="dense", attn_group_size=2, ffn_group_size=32)
    attach_routers(dense, dcfg)
    out["dense"] = export_model(dense, char_tokenizer(), root / "i_dense", wide_config=_wide_config(dcfg, dense)).path
    return out


def test_sizes_parameters_settings_and_stored_sparsity(exports):
    model = exports["model"]
    for fmt in ("wide", "hf"):
        r = inspect_export(exports[fmt])
        assert r.format == fmt and r.method == "wide"
        files = {p.name: p.stat().st_size for p in exports[fmt].iterdir()}
        assert r.files == files and r.bytes == sum(files.values())
        n_routers = sum(t.numel() for t in router_state_dict(model).values())
        n_backbone = sum(p.numel() for n, p in model.named_parameters() if ".router_" not in n)
        assert r.parameters["routers"] == n_routers and r.parameters["backbone"] == n_backbone
        assert r.settings["attn group size"] == 2 and r.settings["groups (attention/ffn)"] == "2/4"
        assert r.sparsity == STORED and "stored" in r.sparsity_source and r.prompt is None
        d = json.loads(json.dumps(r.to_dict()))
        assert d["parameters"]["total"] == n_routers + n_backbone


def test_settings_name_the_standins_and_count_their_maps(exports, tmp_path):
    from tests._exports import feature_model

    model, wc = feature_model(standin="lowrank:4")
    export_model(model, char_tokenizer(), tmp_path / "e", wide_config=wc)
    r = inspect_export(tmp_path / "e")
    assert r.settings["stand-ins"] == "lowrank:4"
    assert r.parameters["routers"] == sum(t.numel() for t in router_state_dict(model).values())
    assert "stand-ins" not in inspect_export(exports["wide"]).settings  # none: no row


def test_measured_on_text_is_the_same_for_both_formats_and_differs_from_stored(exports):
    a = inspect_export(exports["wide"], text=TEXT, text_name="t.txt", seq_len=64)
    b = inspect_export(exports["hf"], text=TEXT, text_name="t.txt", seq_len=64)
    assert a.sparsity == b.sparsity
    assert a.sparsity["tokens"] == len(TEXT) and a.sparsity != STORED
    assert "measured now on t.txt" in a.sparsity_source
    for m in ("attention", "ffn"):
        vals = a.sparsity["per_layer"][m]
        assert len(vals) == 2 and all(0.0 <= v <= 1.0 for v in vals)
        assert a.sparsity[m] == pytest.approx(sum(vals) / 2)


def test_prompt_trace_matches_the_routers(exports):
    model = exports["model"]
    prompt = "Hello, fox!"
    r = inspect_export(exports["hf"], prompt=prompt, layer=0)
    assert r.prompt.tokens == list(prompt)  # character tokenizer
    ids = char_tokenizer()(prompt, return_tensors="pt").input_ids
    with torch.no_grad():  # layer 0's attention router reads the embeddings
        want = argmax_execute(model.model.layers[0].router_attention(model.model.embed_tokens(ids)))[0]
    assert r.prompt.execute["attention"][0] == want.tolist()
    w = inspect_export(exports["wide"], prompt=prompt)
    assert w.prompt.execute == r.prompt.execute  # same decisions through either loader
    summ = r.prompt.summary("ffn")
    ex = r.prompt.execute["ffn"]
    assert summ[3][1] == (ex[0][3][1] + ex[1][3][1]) / 2


def test_static_hf_export_shows_its_kept_groups(exports):
    r = inspect_export(exports["static"], prompt="ab", text=TEXT)
    assert r.prompt.static and r.parameters["routers"] == 0
    assert r.prompt.execute["attention"][0] == [[True, False, True, True]] * 2
    assert r.prompt.execute["ffn"][1] == [[False, False, False, True]] * 2
    assert r.sparsity["per_layer"] == {"attention": [0.25, 0.75], "ffn": [0.5, 0.75]}
    assert "fixed by the kept groups" in r.sparsity_source
    assert r.settings["kept query heads per layer"] == [3, 1]
    wc = json.loads((exports["static"] / "wide_config.json").read_text())
    assert static_sparsity(wc)["total"] == pytest.approx((0.5 + 0.625) / 2)


def test_dense_export_has_no_routing(exports):
    r = inspect_export(exports["dense"], prompt="ab")
    assert r.prompt.execute == {} and r.method == "dense" and r.parameters["routers"] == 0


def test_plot_png(exports, tmp_path):
    out = tmp_path / "plots" / "sparsity.png"
    r = inspect_export(exports["wide"], plot=out)
    assert r.plot == out and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    import shutil

    bare = shutil.copytree(exports["wide"], tmp_path / "bare")
    wc = json.loads((bare / "wide_config.json").read_text())
    del wc["measured_sparsity"]
    (bare / "wide_config.json").write_text(json.dumps(wc))
    with pytest.raises(ConfigError, match="no per-layer sparsity to plot"):
        inspect_export(bare, plot=tmp_path / "x.png", verify=False)
    assert inspect_export(bare, verify=False).sparsity_source == "none stored"


@pytest.mark.parametrize("kwargs,message", [
    ({"layer": 0}, "--layer needs --prompt"),
    ({"layer": 2, "prompt": "x"}, "--layer 2 is out of range: the model has 2 layers"),
    ({"layer": -1, "prompt": "x"}, "--layer -1 is out of range"),
])
def test_bad_arguments(exports, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        inspect_export(exports["wide"], **kwargs)


def test_not_an_export(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        inspect_export(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="manifest.json is missing"):
        inspect_export(tmp_path / "empty")


def test_heatmap_cells_and_shades():
    from rich.console import Console

    trace = PromptTrace(tokens=["a", " "], execute={"attention": [[[True, False], [False, False]],
                                                                  [[True, True], [False, True]]]})
    con = Console(width=80, record=True, color_system=None)
    con.print(heatmap(trace, 1))
    text = con.export_text()
    assert "█·" not in text.splitlines()[0]  # header line
    assert "██" in text and "·█" in text and "␣" in text
    con = Console(width=80, record=True, color_system=None)
    con.print(heatmap(trace, None))
    text = con.export_text()
    assert f"{SHADES[4]}{SHADES[2]}" in text  # token a: group 0 ran in both layers, group 1 in one
    assert [_shade(v) for v in (0.0, 0.01, 0.5, 0.99, 1.0)] == [0, 1, 2, 3, 4]


def test_render_does_not_fail_on_any_export(exports):
    from rich.console import Console

    for k in ("wide", "hf", "static", "dense"):
        con = Console(width=100, record=True, color_system=None)
        con.print(render(inspect_export(exports[k], prompt="ab")))
        assert "parameters" in con.export_text()


def test_measured_text_counts_masks_and_names_static_routers(exports, tmp_path):
    from rich.console import Console

    r = inspect_export(exports["wide"], text=TEXT, seq_len=64)
    dm = r.sparsity["distinct_masks"]
    assert set(dm) == {"attention", "ffn"} and all(len(v) == 2 and all(n >= 1 for n in v) for v in dm.values())
    con = Console(width=120, record=True, color_system=None)
    con.print(render(r))
    assert "ffn masks" in con.export_text()
    static = [f"{m} {i}" for m, v in dm.items() for i, n in enumerate(v)
              if n == 1 and r.sparsity["per_layer"][m][i] not in (0.0, 1.0)]
    named = [w for w in r.warnings if "static masks" in w]
    assert len(named) == (1 if static else 0)
    assert all(x in named[0] for x in static)
    # a router whose logits are its bias alone gives every token the same partial mask
    model, cfg = routed_tiny_llama()
    G = model.wide_routing.layout.ffn_groups
    with torch.no_grad():
        for n, p in model.model.layers[0].router_ffn.named_parameters():
            p.zero_()
            if n.endswith("bias") and p.numel() == 2 * G:
                p.view(G, 2)[:, 1] = torch.tensor([1.0 if g % 2 else -1.0 for g in range(G)])
    path = export_model(model, char_tokenizer(), tmp_path / "static_router", wide_config=_wide_config(cfg, model)).path
    r = inspect_export(path, text=TEXT, seq_len=64)
    assert r.sparsity["distinct_masks"]["ffn"][0] == 1
    warn = [w for w in r.warnings if "static masks" in w]
    assert len(warn) == 1 and f"routers gave all {len(TEXT)} measured tokens the same groups (" in warn[0]
    assert "ffn 0" in warn[0].split("(")[1].split(")")[0]
    assert "--router-input standardized" in warn[0]
