"""The memory plan: estimated peak memory of a training stage, checked before the first step.

Training memory has four parts (the usual accounting, e.g. Rajbhandari et al. 2020, "ZeRO",
§3, and Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", §4): the weights, the gradients and AdamW state of the *trainable* tensors (routers,
LoRA: small here, since the backbone is frozen), and the activations autograd saves for the
backward pass. Gradients still flow through every frozen layer to the routers below it, so the
activations are those of full fine-tuning; ``--grad-checkpointing`` keeps only each decoder
layer's input and recomputes one layer at a time during backward.

The per-token activation count below follows the routed Llama layer of
``wide_cli.routing.layer`` tensor by tensor (see ``activation_bytes_per_token``); the test suite
checks it against the bytes autograd really saves (``torch.autograd.graph.saved_tensors_hooks``).
All sizes are bytes; the plan is an estimate (allocator fragmentation, kernels' workspaces and
Python objects are not modelled), so the check leaves ``HEADROOM`` of the device free.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass

import torch

from wide_cli.errors import ConfigError

HEADROOM = 0.10  # share of the device's memory the plan keeps free for what it does not model
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class MemoryPlanError(ConfigError):
    """The estimated peak memory of a training stage exceeds what the device has."""


def parse_bytes(text: str | int) -> int:
    """``"24GiB"``, ``"512MB"``, ``"1.5 GB"`` or a plain integer -> bytes.

    Raises:
        ConfigError: an unparsable value or a non-positive size (names the value and the form).
    """
    if isinstance(text, int):
        n = text
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ConfigError(f"max-memory {text!r} is not a size", "write it like 24GiB, 512MiB or 8GB")
        n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise ConfigError(f"max-memory {text!r} must be > 0", "write it like 24GiB, 512MiB or 8GB")
    return n


def gib(n: float) -> str:
    """Bytes as a human string in GiB (or MiB below 1 GiB)."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def activation_bytes_per_token(config, compute_bytes: int, *, router_rank: int = 32,
                               attn_groups: int = 0, ffn_groups: int = 0) -> dict[str, int]:
    """Bytes autograd saves per token, counted tensor by tensor from the routed forward
    (``wide_cli.routing.layer``) with the backbone frozen.

    ``e = compute_bytes`` (4 fp32, 2 bf16/fp16); D hidden, Q = H*d query width, K = H_kv*d,
    F intermediate, V vocabulary, r router rank. A frozen ``Linear`` saves nothing for its input
    gradient (it needs only its weight), so the projections' inputs are not counted:

    * each of the two residual-stream tensors of a layer feeds a router and an RMSNorm, which
      both compute in fp32: ``4 D`` when the stream is fp32 (one shared tensor), ``8 D`` when
      it is bf16/fp16 (two fp32 copies); plus the norm's ``rsqrt`` (4);
    * each router: its rank-r hidden and the softmax over ``G x 2`` logits, ``4 r + 8 G``;
    * attention: SDPA's q, k, v, output and log-sum-exp ``e (2Q + 2K) + 4 H``; the head mask
      and the output it multiplies, ``e (Q + H)`` (eager attention adds ``2 e H T`` per token
      for scores and probabilities); Qwen3's per-head q/k RMSNorms, ``4 (Q + K) + 4 (H + H_kv)``;
    * SwiGLU: ``gate``, ``act(gate)``, ``up``, the channel mask and the masked product, ``5 e F``;
    * once per token, the final norm (as above) and the loss: the fp32 log-softmax over the
      vocabulary and the int64 target, ``4 V + 8``.

    Returns:
        ``{"layer": per token per layer, "attention": its attention part, "layer_input": e D (what checkpointing keeps per layer),
        "head": per token of the final norm and loss, "logits": e V (the logits the model output
        holds until the step ends), "eager_scores_per_context_token": 2 e H}``.
    """
    e = compute_bytes
    D = config.hidden_size
    H = config.num_attention_heads
    d = getattr(config, "head_dim", None) or D // H
    Q, K = H * d, getattr(config, "num_key_value_heads", H) * d
    F, V = config.intermediate_size, config.vocab_size
    stream = (4 * D if e == 4 else 8 * D) + 4
    routers = 2 * 4 * router_rank + 8 * (attn_groups + ffn_groups)
    attention = e * (2 * Q + 2 * K) + 4 * H + e * (Q + H)
    if getattr(config, "model_type", "") == "qwen3":  # per-head q_norm / k_norm in fp32
        attention += 4 * (Q + K) + 4 * (H + K // d)
    layer = 2 * stream + routers + attention + 5 * e * F
    return {"layer": layer, "attention": attention, "layer_input": e * D, "head": stream + 4 * V + 8, "logits": e * V,
            "eager_scores_per_context_token": 2 * e * H}


def lora_bytes_per_token(model) -> int:
    """Bytes per token that PEFT LoRA layers save (stage 2): per adapted ``Linear`` with
    ``in_features`` n and rank r, the dropout mask (1 byte each) and the dropped fp32 input for
    ``lora_A``'s gradient (``5 n``), and ``lora_A``'s output for ``lora_B``'s (``4 r``)."""
    total = 0
    for mod in model.modules():
        a = getattr(mod, "lora_A", None)
        if isinstance(a, torch.nn.ModuleDict) and len(a):
            lin = next(iter(a.values()))
            total += 5 * lin.in_features + 4 * lin.out_features
    return total


@dataclass(frozen=True)
class MemoryPlan:
    """Estimated peak memory of one training process, in bytes.

    Attributes:
        weights: every parameter at the dtype it trains in (frozen backbone included; divided
            by the number of shards under FSDP).
        gradients: fp32 gradients of the trainable tensors.
        optimizer: AdamW's two fp32 moments per trainable element.
        activations: tensors saved for backward for one micro-batch (``batch_size x seq_len``
            tokens), loss included.
        workspace: transient peaks on top: the logits the output holds and their gradient
            (``2 e V`` per token), and under gradient checkpointing one decoder layer's
            activations rebuilt during backward.
        capacity: bytes this process may use (``--max-memory``, or what the device has free plus
            what the model already holds), or None when unknown.
        device: ``cpu`` or ``cuda:N``.
        tokens: tokens per micro-batch.
        grad_checkpointing: whether the plan assumes ``--grad-checkpointing``.
    """

    weights: int
    gradients: int
    optimizer: int
    activations: int
    workspace: int
    capacity: int | None
    device: str
    tokens: int
    grad_checkpointing: bool

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.workspace

    @property
    def usable(self) -> int | None:
        """Capacity minus the headroom the plan does not model."""
        return None if self.capacity is None else int(self.capacity * (1 - HEADROOM))

    @property
    def fits(self) -> bool:
        return self.usable is None or self.total <= self.usable

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total, "fits": self.fits}

    def render(self) -> str:
        """One line for the log, e.g. ``memory plan (estimate): weights 0.25 GiB + ... = 1.9 GiB
        of 20.1 GiB on cpu``."""
        ckpt = ", grad checkpointing" if self.grad_checkpointing else ""
        parts = [f"weights {gib(self.weights)}",
                 f"activations {gib(self.activations + self.workspace)} ({self.tokens} tokens/micro-batch{ckpt})",
                 f"grads+AdamW {gib(self.gradients + self.optimizer)}"]
        cap = f" of {gib(self.capacity)} available on {self.device}" if self.capacity is not None else f" on {self.device}"
        return f"memory plan (estimate): {' + '.join(parts)} = {gib(self.total)}{cap}"


def device_capacity(device: torch.device, held: int) -> int | None:
    """Bytes this process may use on ``device``: free memory plus ``held`` (what the model already
    occupies there, which the plan counts again). CPU: ``MemAvailable`` shared by the processes
    of this node (``LOCAL_WORLD_SIZE``). None when it cannot be read."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free) + int(torch.cuda.memory_allocated(device))
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        avail = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return avail // local + held


def plan_training(model, *, batch_size: int, seq_len: int, compute_dtype: torch.dtype,
                  grad_checkpointing: bool, shards: int = 1, max_memory: int | None = None,
                  cast_frozen: bool = False) -> MemoryPlan:
    """Estimate the peak memory of training ``model`` (its trainable parameters: those with
    ``requires_grad``) on micro-batches of ``batch_size x seq_len`` tokens.

    Args:
        model: a routed Hugging Face causal LM (possibly PEFT-wrapped).
        compute_dtype: the dtype activations train in (the autocast dtype on CUDA;
            ``torch.bfloat16`` for ``--train-dtype bf16`` on CPU).
        cast_frozen: the frozen weights are converted to ``compute_dtype`` before training (CPU
            bf16); otherwise they count at their stored size (autocast does not convert them).
        shards: FSDP shards the weights, gradients and optimizer state are split over (1 = DDP
            or one process).
        max_memory: bytes this process may use; None reads the device.
    """
    config = model.config
    device = next(model.parameters()).device
    e = torch.empty((), dtype=compute_dtype).element_size()
    weights = held = trainable = 0
    for p in model.parameters():
        held += p.numel() * p.element_size()
        if p.requires_grad:
            trainable += p.numel()
            weights += p.numel() * p.element_size()
        else:
            weights += p.numel() * (e if cast_frozen and p.is_floating_point() else p.element_size())
    state = getattr(model, "wide_routing", None)  # PEFT wrappers forward the attribute
    groups = {"attn_groups": 0, "ffn_groups": 0, "router_rank": 0}
    if state is not None and state.cfg.method != "dense":
        mods = state.active_modules
        groups = {"attn_groups": state.layout.attn_groups if "attention" in mods else 0,
                  "ffn_groups": state.layout.ffn_groups if "ffn" in mods else 0,
                  "router_rank": state.cfg.router_rank}
    per = activation_bytes_per_token(config, e, **groups)
    tokens = batch_size * seq_len
    layers = config.num_hidden_layers
    per_layer = per["layer"]
    if getattr(config, "_attn_implementation", "sdpa") == "eager":
        per_layer += per["eager_scores_per_context_token"] * seq_len
    lora = lora_bytes_per_token(model)
    head = per["head"] * tokens
    workspace = 2 * per["logits"] * tokens
    if grad_checkpointing:
        activations = layers * per["layer_input"] * tokens + head
        workspace += (per_layer + lora // max(layers, 1)) * tokens
    else:
        activations = (layers * per_layer + lora) * tokens + head
        if not lora:  # stage 1: nothing before the first router needs a gradient
            activations -= per["attention"] * tokens
    capacity = max_memory if max_memory is not None else device_capacity(device, held)
    return MemoryPlan(
        weights=weights // shards,
        gradients=4 * trainable // shards,
        optimizer=8 * trainable // shards,
        activations=activations,
        workspace=workspace,
        capacity=capacity,
        device=str(device),
        tokens=tokens,
        grad_checkpointing=grad_checkpointing,
    )


def check_plan(plan: MemoryPlan, *, batch_size: int, grad_accum: int) -> None:
    """Refuse a plan that does not fit.

    Raises:
        MemoryPlanError: names the estimate, the capacity and what to change (a divisor of
            ``--batch-size`` with a larger ``--grad-accum``, keeping the step's sequences, when one
            fits; ``--grad-checkpointing``; ``--max-memory`` when the estimate is wrong), or says
            that the weights alone do not fit.
    """
    if plan.fits:
        return
    hints = []
    fixed = plan.weights + plan.gradients + plan.optimizer
    if fixed > plan.usable:
        raise MemoryPlanError(
            f"the weights and optimizer state alone ({gib(fixed)}) exceed the {gib(plan.usable)} usable on "
            f"{plan.device}, before any activation",
            "use a device with more memory, more processes (FSDP shards weights on CUDA), a bf16 --dtype, "
            "or --max-memory SIZE if the device really has more",
        )
    if batch_size > 1:
        # The largest divisor of the micro-batch whose activations fit: same sequences per step.
        per_sequence = (plan.activations + plan.workspace) / batch_size
        fits = [b for b in range(batch_size - 1, 0, -1) if batch_size % b == 0 and per_sequence * b <= plan.usable - fixed]
        if fits:
            hints.append(f"--batch-size {fits[0]} --grad-accum {grad_accum * batch_size // fits[0]} "
                         "(same sequences per step)")
    if not plan.grad_checkpointing:
        hints.append("--grad-checkpointing")
    hints.append("--max-memory SIZE if the device really has more")
    raise MemoryPlanError(
        f"estimated peak memory {gib(plan.total)} exceeds the {gib(plan.usable)} usable on {plan.device} "
        f"({gib(plan.capacity)} less {int(HEADROOM * 100)} % headroom)",
        "try " + ", or ".join(hints),
    )
