"""``Wide<Base>ForCausalLM``: vLLM's own Llama / Mistral / Qwen2 / Qwen3 with per-token routing.

Imported by vLLM (through ``vllm_plugin.register``) only; needs the serving environment
(``make serve-setup``). Each class is vLLM's model class for the base architecture -- its
attention backend, paged KV cache, sampler, scheduler and weight loader -- whose decoder layers get
the two WIDE routers of DESIGN.md §1 and route through two fixed-shape custom ops:

- ``WideRoutedOut`` (attention): the attention output ``[M, H_local * d]`` of vLLM's attention
  kernel, with the skipped query-head groups contributing zero, through ``o_proj``. The kernel
  itself computes every head (vLLM's paged attention has no per-token head mask), so attention
  scores are *masked*, never skipped; Q/K/V projections stay dense (K/V must: later tokens read
  every token's K/V).
- ``WideRoutedFFN``: ``down(silu(gate(x)) * up(x))`` with skipped channel groups zero.

Each op has the three paths of a vLLM ``CustomOp``:

- ``forward_native``: dense compute, then mask (the oracle; what torch.compile would fuse).
- ``forward_cpu``: work-skipping behind an opaque ``torch.ops.vllm.wide_*`` op (``vllm_cpu_ops.py``),
  so vLLM's compiled graph stays fixed-shape (its only dynamic dimension is the token count M) and
  the data-dependent work happens inside the op: decode steps of a few tokens run each token over
  its own groups on the runtime's native kernels, larger decode steps run vLLM's own prepacked
  dense kernels of the layer and mask (``vllm_cpu_ops._native_step``), prefill gathers each
  group's tokens on the ``cpu`` backend's GEMMs (``runtime/cpu_proj.py``) or, when its tokens
  together execute every group, runs vLLM's dense kernels and masks.
- ``forward_cuda``: the project's CuPy kernels (``runtime/cupy_ops.py``) when CuPy and a CUDA
  device are present, else ``forward_native``. Not run by us: this project has no GPU machine,
  and vllm-cpu has no CUDA build; on a GPU install of vLLM the same op dispatches there.

Routing decisions: the router ``Linear(D, r) -> Linear(r, 2G)`` (fp32) is folded at load into
``x @ w.T + b = logit0 - logit1`` exactly as ``wide generate`` does (``runtime.layer_meta.fold_router``);
a group executes iff that is ``>= 0``. Static-width exports use their ``keep`` masks. With
stand-ins (``routing.standin``) each skipped group adds its stand-in vector to the module output.
Hybrid exports (layers removed, then width routed) and static-depth exports are smaller models
whose ``config.json`` says so; nothing else is needed for them. The export features this plugin
runs are its row of ``wide_cli.features.SUPPORT``; a model that uses another one is refused when
it is built (``check_served_features``), and before that by ``wide serve``.

Tensor parallel: vLLM gives each rank ``H / tp`` query heads and ``F / tp`` FFN channels; a rank
routes the groups it holds (the router computes all groups, each rank takes its slice) and the
partial ``o_proj`` / ``down_proj`` sums are all-reduced as in vLLM's ``RowParallelLinear``. A group
that would straddle two ranks is refused at construction (``config.check_tensor_parallel``).

``vllm_cpu_ops.stats()`` counts multiply-adds of the routed projections (O, gate/up, down): what the
active path executed vs what the dense model would have, per process (read it with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, where the engine runs in the caller's process).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from vllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from vllm.model_executor.custom_op import CustomOp
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.mistral import MistralForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

from wide_cli.artifacts import ROUTERS_FILE, is_router_tensor
from wide_cli.runtime import cpu_proj, ops
from wide_cli.serve.config import SERVE_MODES, check_tensor_parallel
from wide_cli.serve.vllm_cpu_ops import OP_MODULES, register_ops


def _cupy_ready() -> bool:
    try:
        from wide_cli.runtime.cupy_ops import cuda_status
    except ImportError:
        return False
    return cuda_status() is None


# ---------------------------------------------------------------------------------------------
# the custom ops


@CustomOp.register("wide_routed_ffn")
class WideRoutedFFN(CustomOp):
    """Routed SwiGLU FFN of one decoder layer (this rank's shard), with its router and stand-ins.

    ``forward(x [M, D], r [M, D]) -> [M, D]``: the router (``router``, a ``WideRouter``) decides
    each token's groups from ``r``, the residual stream after the attention add; the skipped
    groups' stand-ins are added (the partial sum under tensor parallel; the caller all-reduces). ``prepare`` takes the layer's loaded weights before vLLM's
    CPU linear layers repack them (and drop ``weight``): ``gate_up_proj`` ``[2 F_local, D]``
    (gate rows then up rows) and ``down_proj`` ``[D, F_local]``, and for ``forward_cpu`` the
    group-major ``runtime/cpu_proj.py`` projections instead (``gu``: per group its gate rows then
    its up rows; ``down``: reduction groups of ``g`` channels).
    """

    def __init__(self, mlp: nn.Module, group_size: int, router: WideRouter):
        super().__init__(enforce_enable=True)
        self._mlp = (mlp,)  # a tuple: not a submodule (its weights are loaded under `mlp.`)
        self._router = (router,)  # loaded under the layer's `router_ffn.`
        self.group_size = group_size
        self.group_macs = 0  # multiply-adds of one token's group (3 g D), set by prepare
        self.op_id = len(OP_MODULES)
        OP_MODULES.append(self)
        self.gu = self.down = None  # runtime/cpu_proj.py projections (forward_cpu)
        for name in ("w_gate_up", "w_down"):
            self.register_buffer(name, torch.empty(0), persistent=False)

    def prepare(self) -> None:
        """Capture the loaded weights in the layout this process's path uses."""
        mlp = self._mlp[0]
        w, wd = mlp.gate_up_proj.weight.detach(), mlp.down_proj.weight.detach()
        self.group_macs = 3 * self.group_size * wd.shape[0]
        if self._forward_method == self.forward_cpu:
            Fl, g = w.shape[0] // 2, self.group_size
            self.gu = cpu_proj.float_proj(cpu_proj.grouped_gate_up(w[:Fl], w[Fl:], g), "n")
            self.down = cpu_proj.float_proj(wd, "k", g)
        else:
            self.w_gate_up, self.w_down = w, wd

    @property
    def router(self) -> WideRouter:
        return self._router[0]

    def forward_native(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        ex = self.router(r)
        Fl = self.w_gate_up.shape[0] // 2
        gu = F.linear(x, self.w_gate_up)
        h = F.silu(gu[:, :Fl]) * gu[:, Fl:]
        h = h * ops.expand_mask(ex, self.group_size).to(h.dtype)
        return self.router.add_standin(F.linear(h, self.w_down), ex)

    def forward_cpu(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return torch.ops.vllm.wide_ffn_cpu(x, r, self.op_id)

    def forward_cuda(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        if not _cupy_ready():
            return self.forward_native(x, r)
        from wide_cli.runtime import cupy_ops

        ex = self.router(r)
        Fl = self.w_gate_up.shape[0] // 2
        y = cupy_ops.mlp(x, self.w_gate_up[:Fl], self.w_gate_up[Fl:], self.w_down, ex, self.group_size)
        return self.router.add_standin(y, ex)


@CustomOp.register("wide_routed_out")
class WideRoutedOut(CustomOp):
    """Routed O projection with its router and stand-ins: ``forward(o [M, H_local d], r [M, D]) ->
    [M, D]`` where the router decides each token's head groups from ``r`` (the residual stream
    entering the layer), the skipped groups' channels contribute nothing (``ops.gemm_k``) and their
    stand-ins are added; the partial sum under tensor parallel (the caller all-reduces and adds the
    bias once). ``prepare`` takes
    ``o_proj``'s loaded weight ``[D, H_local d]`` (vLLM's CPU linear drops it after loading)."""

    def __init__(self, o_proj: nn.Module, group_cols: int, router: WideRouter):
        super().__init__(enforce_enable=True)
        self._o = (o_proj,)
        self._router = (router,)
        self.group_cols = group_cols
        self.op_id = len(OP_MODULES)
        OP_MODULES.append(self)
        self.register_buffer("w_o", torch.empty(0), persistent=False)
        self.o = None  # runtime/cpu_proj.py projection (forward_cpu)

    def prepare(self) -> None:
        self.w_o = self._o[0].weight.detach()
        if self._forward_method == self.forward_cpu:
            self.o = cpu_proj.float_proj(self.w_o, "k", self.group_cols)

    @property
    def router(self) -> WideRouter:
        return self._router[0]

    def forward_native(self, o: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        ex = self.router(r)
        y = F.linear(o * ops.expand_mask(ex, self.group_cols).to(o.dtype), self.w_o)
        return self.router.add_standin(y, ex)

    def forward_cpu(self, o: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return torch.ops.vllm.wide_out_cpu(o, r, self.w_o.shape[0], self.op_id)

    def forward_cuda(self, o: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        if not _cupy_ready():
            return self.forward_native(o, r)
        from wide_cli.runtime import cupy_ops

        ex = self.router(r)
        return self.router.add_standin(cupy_ops.gemm_k(o, self.w_o, ex, self.group_cols), ex)


# ---------------------------------------------------------------------------------------------
# routers


class WideRouter(nn.Module):
    """One layer's router for one module, named like the export
    (``router_{attention,ffn}.{compressor,router}.{weight,bias}`` and ``standin``, or ``keep`` for
    static width).

    ``forward(x [M, D]) -> [M, G_local]`` bool (True = execute) for this rank's groups
    ``[lo, hi)``. The buffer ``force_on`` (a bool scalar, set from ``mode == "all-on"`` and by
    ``set_all_on``) makes every group execute; it is a tensor so that flipping it also changes
    an already compiled graph. The routers are evaluated either way.

    With ``standin`` (``routing.standin`` ``mean`` / ``trained``) the parameter ``standin``
    ``[G, D]`` fp32 holds what each skipped group adds to the module output (``add_standin``).
    """

    def __init__(self, hidden_size: int, rank: int, groups: int, lo: int, hi: int, *, static: bool, mode: str,
                 standin: bool = False):
        super().__init__()
        self.groups, self.lo, self.hi, self.static, self.mode = groups, lo, hi, static, mode
        if static:
            self.register_buffer("keep", torch.ones(groups, dtype=torch.bool))
        else:
            self.compressor = nn.Linear(hidden_size, rank, dtype=torch.float32)
            self.router = nn.Linear(rank, 2 * groups, dtype=torch.float32)
            if standin:
                self.standin = nn.Parameter(torch.zeros(groups, hidden_size, dtype=torch.float32), requires_grad=False)
        self.register_buffer("fold_w", torch.zeros(hi - lo, hidden_size, dtype=torch.float32), persistent=False)
        self.register_buffer("fold_b", torch.zeros(hi - lo, dtype=torch.float32), persistent=False)
        self.register_buffer("force_on", torch.tensor(mode == "all-on"), persistent=False)

    def fold(self) -> None:
        """Fold the two linears into ``logit0 - logit1`` (float64, stored fp32), as the runtime."""
        if self.static:
            return
        wc, bc = self.compressor.weight.double(), self.compressor.bias.double()
        wr, br = self.router.weight.double(), self.router.bias.double()
        wd, bd = wr[0::2] - wr[1::2], br[0::2] - br[1::2]
        self._standin_local = None  # re-read from the loaded stand-ins on next use
        self.fold_w = (wd @ wc).float()[self.lo : self.hi].contiguous()
        self.fold_b = (wd @ bc + bd).float()[self.lo : self.hi].contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        M = x.shape[0]
        if self.static:
            ex = self.keep[self.lo : self.hi].expand(M, self.hi - self.lo)
        else:
            ex = F.linear(x.float(), self.fold_w, self.fold_b) >= 0
        return ex | self.force_on

    def module_router(self):
        """This rank's folded router, forced flag and stand-ins for the native kernels to decide and
        add themselves (``cpu_rows.ModuleRouter``), or None for a static mask."""
        if self.static:
            return None
        from wide_cli.runtime.cpu_rows import ModuleRouter

        if getattr(self, "_standin_local", None) is None and getattr(self, "standin", None) is not None:
            self._standin_local = self.standin.detach()[self.lo : self.hi].float().contiguous()
        return ModuleRouter(self.fold_w, self.fold_b, bool(self.force_on), getattr(self, "_standin_local", None))

    def add_standin(self, out: torch.Tensor, ex: torch.Tensor) -> torch.Tensor:
        """``out [M, D] + (~ex) @ standin[lo:hi]`` (fp32 product, as ``routing.router.apply_standin``),
        or ``out`` without stand-ins. Under tensor parallel each rank adds its own groups' share
        to its partial sum, before the all-reduce."""
        standin = getattr(self, "standin", None)
        if standin is None:
            return out
        return out + ((~ex).to(torch.float32) @ standin[self.lo : self.hi]).to(out.dtype)


# ---------------------------------------------------------------------------------------------
# the routed decoder layer


def _routed_attention(layer, positions: torch.Tensor, h: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """vLLM's attention forward (Llama/Mistral/Qwen2/Qwen3) with the O projection routed by the
    attention router on ``r``, the residual stream entering the layer."""
    attn = layer.self_attn
    qkv, _ = attn.qkv_proj(h)
    q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    if getattr(attn, "q_norm", None) is not None and getattr(attn, "qk_norm", True):  # Qwen3
        T = q.shape[0]
        q = attn.q_norm(q.view(T, -1, attn.head_dim)).view(q.shape)
        k = attn.k_norm(k.view(T, -1, attn.head_dim)).view(k.shape)
    q, k = attn.rotary_emb(positions, q, k)
    o = attn.attn(q, k, v)
    out = layer.wide_out(o, r)
    if layer.wide_tp > 1:
        out = tensor_model_parallel_all_reduce(out)
    if attn.o_proj.bias is not None:
        out = out + attn.o_proj.bias
    return out


def _routed_layer_forward(self, positions, hidden_states, residual, *args, **kwargs):
    """A vLLM decoder layer's forward with routing (same signature and outputs).

    The attention router reads the residual stream entering the layer, the FFN router the
    stream after the attention add (``residual`` after each fused add-RMSNorm).
    """
    if residual is None:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
    else:
        hidden_states, residual = self.input_layernorm(hidden_states, residual)
    if self.router_attention is not None:
        hidden_states = _routed_attention(self, positions, hidden_states, residual)
    else:
        hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
    hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
    if self.router_ffn is not None:
        hidden_states = self.wide_ffn(hidden_states, residual)
        if self.wide_tp > 1:
            hidden_states = tensor_model_parallel_all_reduce(hidden_states)
    else:
        hidden_states = self.mlp(hidden_states)
    return hidden_states, residual


_ROUTED_LAYER_CLASSES: dict[type, type] = {}


def _routed_layer_class(cls: type) -> type:
    if cls not in _ROUTED_LAYER_CLASSES:
        _ROUTED_LAYER_CLASSES[cls] = type(f"Wide{cls.__name__}", (cls,), {"forward": _routed_layer_forward})
    return _ROUTED_LAYER_CLASSES[cls]


def routing_settings(config) -> tuple[dict, dict, str]:
    """``(routing, layout, serve_mode)`` from ``config.wide_routing``.

    Raises:
        ValueError: the config has no ``wide_routing`` (not a wide export, or served without
            ``wide serve``'s overrides), or an unknown serve mode.
    """
    wr = getattr(config, "wide_routing", None)
    if not isinstance(wr, dict) or "routing" not in wr or "layout" not in wr:
        raise ValueError(
            "this model's config has no `wide_routing`: serve a wide export with `wide serve EXPORT` "
            "(a --format wide export needs its --hf-overrides; a --format hf export carries it)"
        )
    mode = wr.get("serve_mode", "routed")
    if mode not in SERVE_MODES:
        raise ValueError(f"unknown wide_routing.serve_mode {mode!r}; choose one of {SERVE_MODES}")
    return wr["routing"], wr["layout"], mode


def check_served_features(config, model_dir) -> frozenset:
    """Refuse an export that uses a feature this plugin does not run (``wide_cli.features``, row
    ``vllm``; ``wide serve`` checks the same before it starts vLLM). ``config``: the model's
    Hugging Face config as vLLM holds it (overrides applied); ``model_dir``: the export directory
    (its ``wide_config.json`` is read when there is one).

    Raises:
        UnsupportedFeature: naming the feature, the file and the plugin.
    """
    import json

    from wide_cli.artifacts import WIDE_CONFIG
    from wide_cli.features import check_features, export_features

    p = Path(model_dir) / WIDE_CONFIG
    wide_config = json.loads(p.read_text()) if p.is_file() else None
    feats = export_features(config.to_dict(), wide_config)
    check_features(feats, "vllm", model_dir)
    return feats


def _attach_routing(model: nn.Module, vllm_config) -> None:
    """Turn the decoder layers of a constructed vLLM model into routed layers."""
    config = model.config
    routing, layout, mode = routing_settings(config)
    check_served_features(config, vllm_config.model_config.model)
    method = routing.get("method", "wide")
    if getattr(model.model.layers[model.model.start_layer].self_attn, "do_llama_4_scaling", False):
        raise ValueError("Llama-4 attention scaling is not supported by the wide plugin")
    tp = get_tensor_model_parallel_world_size()
    rank = get_tensor_model_parallel_rank() if tp > 1 else 0
    H = int(config.num_attention_heads)
    Hkv = int(getattr(config, "num_key_value_heads", None) or H)
    Fi = int(config.intermediate_size)
    ags, fgs = int(layout["attn_group_size"]), int(layout["ffn_group_size"])
    check_tensor_parallel(
        num_heads=H, num_kv_heads=Hkv, intermediate_size=Fi, attn_group_size=ags, ffn_group_size=fgs, tp=tp
    )
    Ga, Gf = H // ags, Fi // fgs
    D = int(config.hidden_size)
    r = int(routing.get("router_rank", 32))
    static = method == "static-width"
    routed = method != "dense"
    standin = not static and routing.get("standin") not in (None, "none")
    head_dim = None
    for layer in model.model.layers[model.model.start_layer : model.model.end_layer]:
        layer.__class__ = _routed_layer_class(layer.__class__)
        layer.wide_tp = tp
        if head_dim is None:
            head_dim = layer.self_attn.head_dim
        use_a = routed and routing.get("route_attention", True)
        use_f = routed and routing.get("route_ffn", True)
        layer.router_attention = (
            WideRouter(D, r, Ga, rank * Ga // tp, (rank + 1) * Ga // tp, static=static, mode=mode, standin=standin)
            if use_a else None
        )  # fmt: skip
        layer.router_ffn = (
            WideRouter(D, r, Gf, rank * Gf // tp, (rank + 1) * Gf // tp, static=static, mode=mode, standin=standin)
            if use_f else None
        )  # fmt: skip
        layer.wide_out = (
            WideRoutedOut(layer.self_attn.o_proj, ags * layer.self_attn.head_dim, layer.router_attention)
            if use_a else None
        )  # fmt: skip
        layer.wide_ffn = WideRoutedFFN(layer.mlp, fgs, layer.router_ffn) if use_f else None
    register_ops()


def _routers_of(model: nn.Module) -> dict[str, nn.Module]:
    out = {}
    for i in range(model.model.start_layer, model.model.end_layer):
        layer = model.model.layers[i]
        for m in ("attention", "ffn"):
            r = getattr(layer, f"router_{m}", None)
            if r is not None:
                out[f"model.layers.{i}.router_{m}"] = r
    return out


def _load_routers(model: nn.Module, tensors: dict[str, torch.Tensor]) -> set[str]:
    """Copy router tensors (export names) into the routers and fold them; returns the loaded
    parameter names.

    Raises:
        ValueError: a missing or unexpected router tensor (naming it), or a shape mismatch.
    """
    routers = _routers_of(model)
    expected = {}
    for prefix, r in routers.items():
        for name, t in list(r.named_parameters()) + [(n, b) for n, b in r.named_buffers() if n == "keep"]:
            expected[f"{prefix}.{name}"] = t
    layer_range = range(model.model.start_layer, model.model.end_layer)
    own = {k: v for k, v in tensors.items() if int(k.split(".")[2]) in layer_range}
    missing = sorted(set(expected) - set(own))
    extra = sorted(set(own) - set(expected))
    if missing or extra:
        raise ValueError(f"router tensors do not match the routing settings: missing {missing[:4]}, unexpected {extra[:4]}")
    loaded = set()
    with torch.no_grad():
        for name, dst in expected.items():
            src = own[name]
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(f"router tensor {name} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(src.to(dst.dtype))
            if isinstance(dst, nn.Parameter):
                loaded.add(name)
    for r in routers.values():
        r.fold()
    return loaded


class _WideMixin:
    """Adds routing to a vLLM ``*ForCausalLM`` (listed first in the bases)."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._wide_model_dir = vllm_config.model_config.model
        _attach_routing(self, vllm_config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        routers: dict[str, torch.Tensor] = {}

        def backbone():
            for name, t in weights:
                if is_router_tensor(name):
                    routers[name] = t
                else:
                    yield name, t

        loaded = set(super().load_weights(backbone()))
        if not routers and _routers_of(self):
            # A --format wide export keeps its routers beside the backbone; vLLM's loader reads
            # only the backbone files when the backbone is sharded with an index.
            path = Path(self._wide_model_dir) / ROUTERS_FILE
            if path.is_file():
                from safetensors.torch import load_file

                routers = load_file(str(path))
        loaded |= _load_routers(self, routers)
        for i in range(self.model.start_layer, self.model.end_layer):
            for op in (self.model.layers[i].wide_out, self.model.layers[i].wide_ffn):
                if op is not None:
                    op.prepare()
        return loaded


class WideLlamaForCausalLM(_WideMixin, LlamaForCausalLM):
    """vLLM's ``LlamaForCausalLM`` with WIDE routing."""


class WideMistralForCausalLM(_WideMixin, MistralForCausalLM):
    """vLLM's ``MistralForCausalLM`` with WIDE routing."""


class WideQwen2ForCausalLM(_WideMixin, Qwen2ForCausalLM):
    """vLLM's ``Qwen2ForCausalLM`` with WIDE routing (q/k/v bias)."""


class WideQwen3ForCausalLM(_WideMixin, Qwen3ForCausalLM):
    """vLLM's ``Qwen3ForCausalLM`` with WIDE routing (q_norm / k_norm)."""


MODEL_CLASSES = {
    "WideLlamaForCausalLM": WideLlamaForCausalLM,
    "WideMistralForCausalLM": WideMistralForCausalLM,
    "WideQwen2ForCausalLM": WideQwen2ForCausalLM,
    "WideQwen3ForCausalLM": WideQwen3ForCausalLM,
}

def set_all_on(model: nn.Module, on: bool) -> None:
    """Force every group of every router of ``model`` on (``True``) or back to routing."""
    for r in _routers_of(model).values():
        r.force_on.fill_(bool(on))


def active_path() -> str:
    """Which path the routed ops take in this process: ``forward_cpu`` skips work; on CUDA,
    ``forward_cuda`` (CuPy kernels) when CuPy is present; ``forward_native`` only masks."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "forward_cpu"
    if current_platform.is_cuda():
        return "forward_cuda" if _cupy_ready() else "forward_native"
    return "forward_native"

