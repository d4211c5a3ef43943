"""Optimisation settings for router calibration (stage 1) and LoRA recovery (stage 2)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from wide_cli.errors import ConfigError, refuse_non_finite

DTYPES = ("fp32", "bf16", "fp16", "auto")


def resolve_dtype(dtype: str, device_type: str) -> str:
    """``auto`` -> ``bf16`` on CUDA and on CPUs that multiply bf16 in hardware
    (``cpu_native.fast_bf16``), else ``fp32``; any other dtype unchanged."""
    if dtype != "auto":
        return dtype
    from wide_cli.runtime.cpu_native import fast_bf16

    return "bf16" if device_type == "cuda" or fast_bf16() else "fp32"


@dataclass(frozen=True)
class TrainConfig:
    """Stage-1 settings (DESIGN.md §1; paper: AdamW lr 2e-3, wd 0.01, cosine, 10 % warm-up,
    grad-clip 1.0).

    Attributes:
        steps: optimizer steps.
        batch_size: sequences per micro-batch.
        grad_accum: micro-batches per optimizer step (sequences/step = batch_size * grad_accum).
        seq_len: tokens per sequence.
        lr, weight_decay, warmup_frac, grad_clip: AdamW with cosine schedule.
        seed: data order, Gumbel noise and router init.
        checkpoint_every: optimizer steps between resumable checkpoints (0 = only at the end).
        dtype: training compute dtype: ``fp32``, ``bf16`` (CUDA: autocast; CPU: the frozen backbone is
            cast to bf16 for training, fast with bf16 matrix units such as AMX), ``fp16`` (CUDA
            autocast + loss scaling), ``auto`` (bf16 on CUDA and on CPUs that multiply bf16 in
            hardware, AVX512-BF16 or AMX; fp32 on other CPUs, where PyTorch's bf16 path is far slower:
            a SmolLM2-135M step of 4 x 256 tokens took 200-355 s in bf16 against 9 s in fp32 on an
            AVX2 EPYC, 1 thread; resolved before training, ``pipeline.common.effective_settings``).
            Trainable parameters and optimizer state are fp32 in every case.
        grad_checkpointing: keep only each decoder layer's input and recompute the layer during
            backward (less activation memory, about one extra forward of compute).
        distill: weight of distillation to the dense model in the LM term:
            ``(1 - distill) * CE + distill * T^2 * KL(dense || routed)`` on the logits at temperature
            ``distill_temperature`` (Hinton et al. 2015). The teacher is the same frozen backbone
            with routing off (and LoRA disabled): one extra no-grad forward per step, no second copy
            of the model. 0 = the paper's LM loss alone; 1 = distillation alone.
        max_memory: bytes one training process may use, e.g. ``"24GiB"`` (None: what the device
            has free). The memory plan refuses to start above it (``wide_cli.train.memory``).
    """

    steps: int = 120
    batch_size: int = 4
    grad_accum: int = 1
    seq_len: int = 256
    lr: float = 2e-3
    weight_decay: float = 0.01
    warmup_frac: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    checkpoint_every: int = 50
    dtype: str = "fp32"
    grad_checkpointing: bool = False
    max_memory: str | None = None
    distill: float = 0.0
    distill_temperature: float = 1.0

    def __post_init__(self):
        refuse_non_finite(self)
        if not 0.0 <= self.distill <= 1.0:
            raise ConfigError(f"distill {self.distill} must be in [0, 1]", "0 = LM loss only, 1 = distillation only")
        if not self.distill_temperature > 0:
            raise ConfigError(f"distill-temperature {self.distill_temperature} must be > 0")
        for name in ("steps", "batch_size", "grad_accum", "seq_len"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"{name.replace('_', '-')} {getattr(self, name)} must be >= 1")
        if self.seq_len < 2:
            raise ConfigError(f"seq-len {self.seq_len} must be >= 2")
        if not self.lr > 0:
            raise ConfigError(f"lr {self.lr} must be > 0")
        if self.weight_decay < 0:
            raise ConfigError(f"weight-decay {self.weight_decay} must be >= 0")
        if self.grad_clip < 0:
            raise ConfigError(f"grad-clip {self.grad_clip} must be >= 0", "0 turns clipping off")
        if not 0 <= self.warmup_frac < 1:
            raise ConfigError(f"warmup fraction {self.warmup_frac} must be in [0, 1)")
        if self.checkpoint_every < 0:
            raise ConfigError(f"checkpoint-every {self.checkpoint_every} must be >= 0")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} unknown", f"choose one of {', '.join(DTYPES)}")
        if self.max_memory is not None:
            from wide_cli.train.memory import parse_bytes

            parse_bytes(self.max_memory)

    @property
    def sequences_per_step(self) -> int:
        return self.batch_size * self.grad_accum

    @property
    def tokens_per_step(self) -> int:
        return self.sequences_per_step * self.seq_len

    def to_dict(self) -> dict:
        return asdict(self)

    def math_dict(self) -> dict:
        """The settings that change the numbers a run produces (what ``--resume`` must match):
        everything but ``grad_checkpointing`` and ``max_memory``."""
        d = asdict(self)
        d.pop("grad_checkpointing")
        d.pop("max_memory")
        return d
