"""The training loop shared by stage 1 (routers) and stage 2 (LoRA + routers).

Loss (DESIGN.md §1): ``LM cross-entropy + lambda * |s_target - s_hat|`` with hard Gumbel-softmax
decisions (STE) and a temperature annealed linearly over optimizer steps. With a cost target
(``RoutingConfig.cost_target``), ``s_hat`` is the cost-weighted skip fraction (``wide_cli.cost``)
and ``s_target = 1 - cost_target``; with ``TrainConfig.distill`` the LM term mixes in
``T^2 * KL(dense || routed)``; ``RoutingConfig.sparsity_warmup`` ramps the target up from 0. Checkpoints are
atomic directories; ``resume=True`` continues bit-for-bit where the last checkpoint stopped.
"""

from __future__ import annotations

import json
import math
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from wide_cli.atomic import atomic_directory, atomic_write_json
from wide_cli.errors import CheckpointError, TrainingDivergedError
from wide_cli.routing.gumbel import sparsity_loss, temperature_at
from wide_cli.train.config import TrainConfig
from wide_cli.train.data_order import batch_indices
from wide_cli.train.memory import check_plan, parse_bytes, plan_training

CHECKPOINT = "checkpoint"
RESULT = "result.json"


@dataclass
class TrainResult:
    """Outcome of a training stage.

    Attributes:
        steps: optimizer steps completed in total (including before a resume).
        tokens: training tokens processed (all ranks).
        seconds: wall time spent training (all sessions summed), s.
        final: last step's metrics (loss, lm_loss, sparsity per module, tau).
        history: per-step metrics (every ``log_every`` steps).
        resumed_from: the step a resume started at, or None.
        memory_plan: the estimate checked before the first step (``MemoryPlan.to_dict()``).
    """

    steps: int
    tokens: int
    seconds: float
    final: dict = field(default_factory=dict)
    history: list = field(default_factory=list)
    resumed_from: int | None = None
    memory_plan: dict | None = None

    def to_dict(self) -> dict:
        return {
            "steps": self.steps,
            "tokens": self.tokens,
            "seconds": round(self.seconds, 3),
            "final": self.final,
            "resumed_from": self.resumed_from,
            "memory_plan": self.memory_plan,
        }


def _named_trainable(model) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def save_checkpoint(stage_dir: Path, model, optimizer, scheduler, meta: dict, rng: dict) -> None:
    """Atomically write ``stage_dir/checkpoint/`` (trainable tensors, optimizer, RNG, meta)."""
    from safetensors.torch import save_file

    tensors = {n: p.detach().cpu().contiguous() for n, p in _named_trainable(model).items()}
    with atomic_directory(stage_dir / CHECKPOINT) as tmp:
        save_file(tensors, str(tmp / "trainable.safetensors"))
        torch.save(
            {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": rng},
            tmp / "optimizer.pt",
        )
        atomic_write_json(tmp / "state.json", meta)


def load_checkpoint(stage_dir: Path, model, optimizer, scheduler, identity: dict, *,
                    world: int = 1) -> tuple[dict, dict]:
    """Restore a checkpoint written by ``save_checkpoint``; returns ``(meta, rng)``.

    Raises:
        CheckpointError: unreadable files, a checkpoint made for another model / settings, or by
            another number of processes ``world`` (the global batch, and so the data and the
            Gumbel noise of every later step, would differ from the interrupted run's).
    """
    from safetensors.torch import load_file

    ck = stage_dir / CHECKPOINT
    try:
        meta = json.loads((ck / "state.json").read_text())
        tensors = load_file(str(ck / "trainable.safetensors"))
        blob = torch.load(ck / "optimizer.pt", weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unreadable piece means the same to the user
        raise CheckpointError(f"cannot read checkpoint {ck}: {e}", "delete it to start over") from None
    def procs(n):
        return f"{n} process{'es' if n != 1 else ''}"

    if int(meta.get("world", 1)) != world:
        raise CheckpointError(
            f"--resume: checkpoint in {stage_dir} was written by {procs(int(meta.get('world', 1)))}, "
            f"this run has {procs(world)}",
            f"resume with {procs(int(meta.get('world', 1)))} (--nproc / torchrun --nproc-per-node), "
            "or drop --resume to start over",
        )
    if meta.get("identity") != identity:
        diff = sorted(
            k for k in set(identity) | set(meta.get("identity", {}))
            if identity.get(k) != meta.get("identity", {}).get(k)
        )
        raise CheckpointError(
            f"--resume: checkpoint in {stage_dir} was made with different {', '.join(diff)} "
            f"({meta.get('identity', {}).get(diff[0]) if diff else ''!r} vs {identity.get(diff[0]) if diff else ''!r})",
            "use another --run-dir, or drop --resume to start over",
        )
    params = _named_trainable(model)
    if set(tensors) != set(params):
        raise CheckpointError(f"checkpoint {ck} holds other trainable tensors than this model", "delete it")
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(tensors[n].to(p.device, p.dtype))
    optimizer.load_state_dict(blob["optimizer"])
    scheduler.load_state_dict(blob["scheduler"])
    return meta, blob["rng"]


def _memory_plan(model, cfg: TrainConfig, device: torch.device, world: int, ddp_model):
    """The plan for this stage: compute dtype as the loop will train (CPU bf16 casts the frozen
    backbone; CUDA autocast), weights sharded when FSDP wraps the model (``ddp_model is model``)."""
    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.dtype, None)
    if compute is None or (device.type == "cpu" and cfg.dtype != "bf16"):
        compute = next(p for p in model.parameters() if p.is_floating_point()).dtype
    shards = world if (ddp_model is not None and ddp_model is model and world > 1) else 1
    return plan_training(
        model, batch_size=cfg.batch_size, seq_len=cfg.seq_len, compute_dtype=compute,
        grad_checkpointing=cfg.grad_checkpointing, shards=shards,
        cast_frozen=device.type == "cpu" and cfg.dtype == "bf16",
        max_memory=parse_bytes(cfg.max_memory) if cfg.max_memory else None,
    )


def _log(msg: str) -> None:
    from rich.console import Console

    Console(stderr=True).print(msg, highlight=False, soft_wrap=True)  # one greppable line in logs


def _lr_scheduler(optimizer, cfg: TrainConfig):
    from transformers import get_cosine_schedule_with_warmup

    warmup = round(cfg.warmup_frac * cfg.steps)
    return get_cosine_schedule_with_warmup(optimizer, warmup, cfg.steps)


def train_stage(
    model,
    data: torch.Tensor,
    cfg: TrainConfig,
    *,
    stage_dir: Path,
    identity: dict,
    resume: bool = False,
    progress: bool = True,
    log_every: int = 1,
    rank: int = 0,
    world: int = 1,
    ddp_model=None,
    on_step=None,
    tau: tuple[float, float] | None = None,
    param_groups: list[dict] | None = None,
) -> TrainResult:
    """Train the parameters of ``model`` that require grad (routers; plus LoRA in stage 2).

    Args:
        model: a routed model (``model.wide_routing``); frozen parameters have
            ``requires_grad=False``.
        data: ``[N, seq_len]`` int64 packed training sequences (no padding).
        cfg: optimisation settings.
        stage_dir: ``<run>/stage1`` or ``<run>/stage2``; holds ``checkpoint/`` and ``result.json``.
        identity: what must match for ``resume`` (model, routing and training settings).
        resume: continue from ``stage_dir/checkpoint`` when present.
        progress: show a Rich progress bar on stderr (rank 0 only).
        rank, world, ddp_model: data-parallel position and the wrapped model to call forward on.
        on_step: optional callback ``(step, metrics)`` after each optimizer step (tests, signals).
        tau: ``(start, end)`` Gumbel temperatures, annealed linearly over this stage's steps;
            None = the routing config's ``tau_start``/``tau_end`` (stage 1).
        param_groups: AdamW parameter groups (``[{"params": [...], "lr": x}, ...]``) when the
            trainable parameters need different learning rates (routers and LoRA trained jointly);
            None = every trainable parameter at ``cfg.lr``.

    Returns:
        TrainResult.

    Raises:
        TrainingDivergedError: non-finite loss (names the step; the last good checkpoint stays).
        CheckpointError: resume from a checkpoint of another model or settings.
    """
    state = model.wide_routing
    rcfg = state.cfg
    modules = state.active_modules
    targets = {m: rcfg.target_for(m) for m in modules}
    taus = tau if tau is not None else (rcfg.tau_start, rcfg.tau_end)
    stage_dir = Path(stage_dir)
    stage_dir.mkdir(parents=True, exist_ok=True)
    device = next(model.parameters()).device
    fwd = ddp_model if ddp_model is not None else model

    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise RuntimeError("no trainable parameters")
    plan = _memory_plan(model, cfg, device, world, ddp_model)
    if rank == 0 and progress:
        _log(plan.render())
    check_plan(plan, batch_size=cfg.batch_size, grad_accum=cfg.grad_accum)
    optimizer = torch.optim.AdamW(param_groups or params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    cost = rcfg.cost_model(state.shape, cfg.seq_len) if rcfg.cost_target is not None and modules else None
    # the target as a fraction of this (possibly layer-pruned, RoutingConfig.drop_layers) model's cost
    routed_target = rcfg.routed_cost_target(state.shape, cfg.seq_len) if cost is not None else None
    warm_steps = round(rcfg.sparsity_warmup * cfg.steps)
    scheduler = _lr_scheduler(optimizer, cfg)
    gen = torch.Generator(device=device).manual_seed(cfg.seed + 17)  # same on every rank
    torch.manual_seed(cfg.seed + rank)
    start, elapsed, history, resumed_from = 0, 0.0, [], None
    if resume and (stage_dir / CHECKPOINT / "state.json").is_file():
        meta, rng = load_checkpoint(stage_dir, model, optimizer, scheduler, identity, world=world)
        start, elapsed, history = meta["step"], meta["seconds"], meta.get("history", [])
        resumed_from = start
        gen.set_state(rng["gumbel"][rank] if isinstance(rng["gumbel"], list) else rng["gumbel"])
        torch.set_rng_state(rng["torch"])
    state.generator = gen
    state.world, state.rank = world, rank
    state.grad_checkpointing = cfg.grad_checkpointing
    model.train()
    state.set_mode("gumbel")
    # Mixed precision: bf16/fp16 autocast on CUDA; bf16 autocast on CPU (fast where the CPU has
    # bf16 matrix units, e.g. AMX). Trainable parameters and optimizer state stay fp32 (low-precision optimizer state loses small updates).
    if device.type == "cuda" and cfg.dtype in ("bf16", "fp16"):
        autocast = torch.autocast("cuda", dtype=torch.bfloat16 if cfg.dtype == "bf16" else torch.float16)
    else:
        autocast = None
        if device.type == "cpu" and cfg.dtype == "bf16":
            # CPU autocast would re-cast every frozen weight on every forward (a quarter of the step
            # time); the frozen backbone is cast to bf16 once instead. Trainable tensors stay fp32.
            for p in model.parameters():
                if not p.requires_grad and p.is_floating_point() and p.dtype != torch.bfloat16:
                    p.data = p.data.to(torch.bfloat16)
    scaler = torch.amp.GradScaler("cuda") if device.type == "cuda" and cfg.dtype == "fp16" else None

    def rng_snapshot():
        return {"gumbel": gen.get_state(), "torch": torch.get_rng_state()}

    def meta_for(step):
        return {
            "step": step,
            "tokens": step * cfg.tokens_per_step * world,
            "world": world,
            "seconds": elapsed,
            "history": history,
            "identity": identity,
        }

    bar = _Bar(cfg.steps, start, enabled=progress and rank == 0)
    completed, snapshot = start, rng_snapshot()  # RNG as of the end of the last completed step
    last_saved = start
    try:
        for step in range(start, cfg.steps):
            t0 = time.perf_counter()
            state.tau = temperature_at(step, cfg.steps, *taus)
            ramp = min(1.0, (step + 1) / warm_steps) if warm_steps > 0 else 1.0
            sums = {"loss": 0.0, "lm_loss": 0.0, **{f"s_{m}": 0.0 for m in modules}}
            if cost is not None:
                sums["cost"] = 0.0
            if cfg.distill > 0:
                sums["kl"] = 0.0
            for micro in range(cfg.grad_accum):
                idx = batch_indices(len(data), cfg.batch_size, step * cfg.grad_accum + micro, cfg.seed,
                                    rank=rank, world=world)
                ids = data[idx].to(device)
                ctx = autocast if autocast is not None else _nullctx()
                state.records.clear()  # wrappers (PEFT, DDP) may bypass the model's pre-hook
                state.valid = None  # packed sequences: every token is valid
                with ctx:
                    teacher = _teacher_logits(model, fwd, ids) if cfg.distill > 0 else None
                    state.records.clear()
                    out = fwd(input_ids=ids, labels=ids, use_cache=False)  # no KV cache in training
                    s_hat = state.measured_s_hat()
                    if cost is not None and state.records:
                        s_w = cost.weighted_skip({(i, m): f for i, m, f in state.records})
                        sp = (ramp * (1.0 - routed_target) - s_w).abs()
                        sums["cost"] += (1.0 - s_w.item()) / cfg.grad_accum
                    elif s_hat:
                        sp = sparsity_loss(s_hat, {m: t * ramp for m, t in targets.items()}, rcfg.per_module_targets)
                    else:
                        sp = out.loss * 0
                    lm = out.loss.float()
                    if teacher is not None:
                        kl = distillation_loss(out.logits, teacher, cfg.distill_temperature)
                        sums["kl"] += kl.item() / cfg.grad_accum
                        lm = (1.0 - cfg.distill) * lm + cfg.distill * kl
                    loss = lm + rcfg.sparsity_weight * sp
                if not torch.isfinite(loss):
                    raise TrainingDivergedError(
                        f"non-finite loss ({loss.item()}) at step {step + 1}; "
                        f"last good checkpoint is step {last_saved} in {stage_dir / CHECKPOINT}",
                        "lower --lr or use --dtype fp32, then --resume",
                    )
                scaled = loss / cfg.grad_accum
                (scaler.scale(scaled) if scaler else scaled).backward()
                sums["loss"] += loss.item() / cfg.grad_accum
                sums["lm_loss"] += out.loss.item() / cfg.grad_accum
                for m in modules:
                    sums[f"s_{m}"] += s_hat[m].item() / cfg.grad_accum
            # An interrupt must not land between the parameter update and the step's bookkeeping:
            # the checkpoint would hold updated weights under the previous step number.
            with _defer_sigint():
                if scaler:
                    scaler.unscale_(optimizer)
                if cfg.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                if scaler:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                dt = time.perf_counter() - t0
                elapsed += dt
                completed, snapshot = step + 1, rng_snapshot()
                active = [sums[f"s_{m}"] for m in modules]
                if warm_steps > 0:
                    sums["target_ramp"] = ramp
                metrics = {
                    "step": step + 1,
                    **{k: round(v, 5) for k, v in sums.items()},
                    "sparsity": round(sum(active) / len(active), 5) if active else 0.0,
                    "tau": round(state.tau, 4),
                    "lr": optimizer.param_groups[0]["lr"],
                    "tokens_per_s": round(cfg.tokens_per_step * world / dt, 1),
                }
                if (step + 1) % log_every == 0 or step + 1 == cfg.steps:
                    history.append(metrics)
            bar.update(metrics)
            if on_step is not None:
                on_step(step + 1, metrics)
            if rank == 0 and cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0 and step + 1 < cfg.steps:
                save_checkpoint(stage_dir, model, optimizer, scheduler, meta_for(step + 1), snapshot)
                last_saved = step + 1
    except KeyboardInterrupt:
        # Stop after a clean checkpoint of the last completed step, then let the CLI exit 130.
        optimizer.zero_grad(set_to_none=True)
        if rank == 0 and completed > last_saved:
            save_checkpoint(stage_dir, model, optimizer, scheduler, meta_for(completed), snapshot)
        bar.close()
        raise
    finally:
        state.set_mode("argmax")
        state.world, state.rank = 1, 0
        state.grad_checkpointing = False
        model.eval()
    bar.close()
    result = TrainResult(cfg.steps, cfg.steps * cfg.tokens_per_step * world, elapsed, history[-1] if history else {},
                         history, resumed_from, plan.to_dict())
    if rank == 0:
        save_checkpoint(stage_dir, model, optimizer, scheduler, meta_for(cfg.steps), rng_snapshot())
        atomic_write_json(stage_dir / RESULT, {**result.to_dict(), "history": history, "identity": identity})
    return result


def distillation_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``T^2 * KL(softmax(teacher / T) || softmax(student / T))``, summed over the vocabulary and
    averaged over positions (Hinton et al. 2015, "Distilling the Knowledge in a Neural Network").

    Args:
        student: ``[B, T, V]`` logits (gradients flow); teacher: ``[B, T, V]`` logits (no grad).
        temperature: T > 0.
    Returns:
        0-dim float32; exactly 0 when the logits are equal.
    """
    t = float(temperature)
    log_p = torch.log_softmax(teacher.float() / t, dim=-1)
    log_q = torch.log_softmax(student.float() / t, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return kl.mean() * (t * t)


@torch.no_grad()
def _teacher_logits(model, fwd, ids: torch.Tensor) -> torch.Tensor:
    """Logits of the dense teacher: the same frozen backbone with routing off and LoRA adapters
    disabled (no second copy of the weights); a hybrid model (``RoutingConfig.drop_layers``) runs
    with its removed layers back, i.e. the source model. Leaves the routing mode as it found it."""
    import contextlib

    from wide_cli.models.depth import source_depth

    state = model.wide_routing
    mode = state.mode
    ctx = model.disable_adapter() if hasattr(model, "disable_adapter") else contextlib.nullcontext()
    state.set_mode("dense")
    try:
        with ctx, source_depth(model):
            return fwd(input_ids=ids, use_cache=False).logits.detach()
    finally:
        state.set_mode(mode)
        state.records.clear()


class _defer_sigint:
    """Hold SIGINT for the duration of the block, then deliver it (main thread only).

    The original handler runs at block exit (``signal.raise_signal``), so Ctrl-C still raises
    KeyboardInterrupt, just at a point where the model, optimizer and step counter agree.
    """

    def __enter__(self):
        self.pending, self.old = False, None
        if threading.current_thread() is threading.main_thread():
            old = signal.getsignal(signal.SIGINT)
            if old is not None:  # None: a handler not set from Python, which we could not restore
                self.old = old
                signal.signal(signal.SIGINT, self._hold)
        return self

    def _hold(self, signum, frame):
        self.pending = True

    def __exit__(self, *exc):
        if self.old is not None:
            signal.signal(signal.SIGINT, self.old)
            if self.pending:
                signal.raise_signal(signal.SIGINT)
        return False


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


class _Bar:
    """A Rich progress bar on stderr: step, LM loss, measured sparsity, temperature, tokens/s."""

    def __init__(self, total: int, start: int, enabled: bool):
        self.p = None
        self.lines = None
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        console = Console(stderr=True)
        if not console.is_terminal:  # logs / CI: one plain line per ~10 % of the run
            self.lines, self.total, self.every = console, total, max(1, total // 10)
            return
        self.p = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        )
        self.p.start()
        self.task = self.p.add_task("train", total=total, completed=start, info="")

    def update(self, m: dict):
        info = (
            f"lm {m['lm_loss']:.3f}  s {m['sparsity']:.3f}  tau {m['tau']:.2f}  "
            f"{m['tokens_per_s']:.0f} tok/s"
        )
        if self.lines is not None and (m["step"] % self.every == 0 or m["step"] == self.total):
            self.lines.print(f"train step {m['step']}/{self.total}  {info}", highlight=False)
        if self.p is not None:
            self.p.update(self.task, completed=m["step"], info=info)

    def close(self):
        if self.p is not None:
            self.p.stop()
            self.p = None


def is_complete(stage_dir: Path, steps: int) -> bool:
    """True when ``stage_dir/result.json`` records a finished run of ``steps`` steps."""
    p = Path(stage_dir) / RESULT
    if not p.is_file():
        return False
    try:
        return json.loads(p.read_text()).get("steps") == steps
    except ValueError:
        return False


def finite_or_raise(x: float, what: str) -> float:
    if not math.isfinite(x):
        raise TrainingDivergedError(f"{what} is not finite ({x})")
    return x
