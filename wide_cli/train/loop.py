"""The training loop shared by stage 1 (routers) and stage 2 (LoRA + routers).

Loss (DESIGN.md §1): ``LM cross-entropy + lambda * |s_target - s_hat|`` with hard Gumbel-softmax
decisions (STE) and a temperature annealed linearly over optimizer steps. With a cost target
(``RoutingConfig.cost_target``), ``s_hat`` is the cost-weighted skip fraction (``wide_cli.cost``)
and ``s_target`` the one ``RoutingConfig.skip_target`` converts the cost target to at the training
sequence length (``routing.gumbel.cost_loss``); with ``TrainConfig.distill`` the LM term mixes in
``T^2 * KL(dense || routed)``; ``RoutingConfig.sparsity_warmup`` ramps the target up from 0. Checkpoints are
atomic directories; ``resume=True`` continues bit-for-bit where the last checkpoint stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from wide_cli.atomic import atomic_directory, atomic_write_json
from wide_cli.errors import CheckpointError, TrainingDivergedError
from wide_cli.filenames import RESULT_JSON
from wide_cli.routing.gumbel import cost_loss, sparsity_loss, temperature_at
from wide_cli.train.config import TrainConfig, resolve_dtype
from wide_cli.train.data_order import batch_indices
from wide_cli.train.memory import check_plan, parse_bytes, plan_training

CHECKPOINT = "checkpoint"
RESULT = RESULT_JSON


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
        log_every: keep every ``log_every``-th step's metrics in the history (and the last).
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
        MemoryPlanError: the memory plan does not fit (``train.memory.check_plan``).
    """
    if cfg.dtype == "auto":  # callers outside the pipeline (which resolves it up front)
        dev = next(p for p in model.parameters()).device
        cfg = dataclasses.replace(cfg, dtype=resolve_dtype(cfg.dtype, dev.type))
    run = _StageRun(model, data, cfg, stage_dir=Path(stage_dir), identity=identity, rank=rank, world=world,
                    ddp_model=ddp_model, tau=tau, param_groups=param_groups, progress=progress)
    if resume:
        run.resume()
    run.enter_training()
    bar = _Bar(cfg.steps, run.start, enabled=progress and rank == 0)
    try:
        for step in range(run.start, cfg.steps):
            metrics = run.step(step, log_every)
            bar.update(metrics)
            if on_step is not None:
                on_step(step + 1, metrics)
            run.checkpoint_every(step + 1)
    except KeyboardInterrupt:
        # Stop after a clean checkpoint of the last completed step, then let the CLI exit 130.
        run.save_interrupted()
        bar.close()
        raise
    finally:
        run.leave_training()
    bar.close()
    return run.finish()


class _StageRun:
    """The state of one ``train_stage`` call (model, optimizer, RNG, bookkeeping) and its steps:
    build (memory plan, optimizer, seeds), ``resume``, ``enter_training``, ``step`` (micro-batches
    then one optimizer update), ``checkpoint_every``, ``save_interrupted``, ``leave_training``,
    ``finish``. The order of the RNG draws is part of the contract: ``--resume`` continues
    bit-for-bit."""

    def __init__(self, model, data: torch.Tensor, cfg: TrainConfig, *, stage_dir: Path, identity: dict,
                 rank: int, world: int, ddp_model, tau: tuple[float, float] | None,
                 param_groups: list[dict] | None, progress: bool):
        self.model, self.data, self.cfg = model, data, cfg
        self.stage_dir, self.identity, self.rank, self.world = stage_dir, identity, rank, world
        self.state = state = model.wide_routing
        self.rcfg = rcfg = state.cfg
        self.modules = state.active_modules
        self.targets = {m: rcfg.target_for(m) for m in self.modules}
        self.taus = tau if tau is not None else (rcfg.tau_start, rcfg.tau_end)
        stage_dir.mkdir(parents=True, exist_ok=True)
        self.device = next(model.parameters()).device
        self.fwd = ddp_model if ddp_model is not None else model
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise RuntimeError("no trainable parameters")
        self.plan = _memory_plan(model, cfg, self.device, world, ddp_model)
        if rank == 0 and progress:
            _log(self.plan.render())
        check_plan(self.plan, batch_size=cfg.batch_size, grad_accum=cfg.grad_accum)
        self.optimizer = torch.optim.AdamW(param_groups or self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        # a cost target as the weighted skip fraction of this (possibly layer-pruned) model
        self.skip_target = rcfg.skip_target(state.shape, cfg.seq_len) if self.modules else None
        self.warm_steps = round(rcfg.sparsity_warmup * cfg.steps)
        self.scheduler = _lr_scheduler(self.optimizer, cfg)
        self.gen = torch.Generator(device=self.device).manual_seed(cfg.seed + 17)  # same on every rank
        torch.manual_seed(cfg.seed + rank)
        self.start, self.elapsed, self.history, self.resumed_from = 0, 0.0, [], None
        self.autocast = self.scaler = None

    # ----------------------------------------------------------------------------- before
    def resume(self) -> None:
        """Continue from ``stage_dir/checkpoint`` when one exists (weights, optimizer, RNG)."""
        if not (self.stage_dir / CHECKPOINT / "state.json").is_file():
            return
        meta, rng = load_checkpoint(self.stage_dir, self.model, self.optimizer, self.scheduler, self.identity,
                                    world=self.world)
        self.start, self.elapsed, self.history = meta["step"], meta["seconds"], meta.get("history", [])
        self.resumed_from = self.start
        self.gen.set_state(rng["gumbel"][self.rank] if isinstance(rng["gumbel"], list) else rng["gumbel"])
        torch.set_rng_state(rng["torch"])

    def enter_training(self) -> None:
        """Routing in Gumbel mode with this run's noise, the model in train mode, mixed precision."""
        state, cfg, device = self.state, self.cfg, self.device
        state.generator = self.gen
        state.world, state.rank = self.world, self.rank
        state.grad_checkpointing = cfg.grad_checkpointing
        self.model.train()
        state.set_mode("gumbel")
        # Mixed precision: bf16/fp16 autocast on CUDA; bf16 autocast on CPU (fast where the CPU has
        # bf16 matrix units, e.g. AMX). Trainable parameters and optimizer state stay fp32
        # (low-precision optimizer state loses small updates).
        if device.type == "cuda" and cfg.dtype in ("bf16", "fp16"):
            self.autocast = torch.autocast("cuda", dtype=torch.bfloat16 if cfg.dtype == "bf16" else torch.float16)
        elif device.type == "cpu" and cfg.dtype == "bf16":
            # CPU autocast would re-cast every frozen weight on every forward (a quarter of the step
            # time); the frozen backbone is cast to bf16 once instead. Trainable tensors stay fp32.
            for p in self.model.parameters():
                if not p.requires_grad and p.is_floating_point() and p.dtype != torch.bfloat16:
                    p.data = p.data.to(torch.bfloat16)
        self.scaler = torch.amp.GradScaler("cuda") if device.type == "cuda" and cfg.dtype == "fp16" else None
        self.completed, self.snapshot = self.start, self.rng_snapshot()  # RNG as of the last completed step
        self.last_saved = self.start

    # ----------------------------------------------------------------------------- one step
    def step(self, step: int, log_every: int) -> dict:
        """One optimizer step (``cfg.grad_accum`` micro-batches, then the update); returns its
        metrics and keeps them in the history every ``log_every`` steps."""
        t0 = time.perf_counter()
        self.state.tau = temperature_at(step, self.cfg.steps, *self.taus)
        ramp = min(1.0, (step + 1) / self.warm_steps) if self.warm_steps > 0 else 1.0
        sums = {"loss": 0.0, "lm_loss": 0.0, **{f"s_{m}": 0.0 for m in self.modules}}
        if self.skip_target is not None:
            sums["cost"] = 0.0
        if self.cfg.distill > 0:
            sums["kl"] = 0.0
        for micro in range(self.cfg.grad_accum):
            self._micro_step(step, micro, ramp, sums)
        return self._update(step, t0, ramp, sums, log_every)

    def _micro_step(self, step: int, micro: int, ramp: float, sums: dict) -> None:
        """Forward and backward of one micro-batch; adds its share of the metrics to ``sums``."""
        cfg, state = self.cfg, self.state
        idx = batch_indices(len(self.data), cfg.batch_size, step * cfg.grad_accum + micro, cfg.seed,
                            rank=self.rank, world=self.world)
        ids = self.data[idx].to(self.device)
        state.records.clear()  # wrappers (PEFT, DDP) may bypass the model's pre-hook
        state.valid = None  # packed sequences: every token is valid
        with self.autocast if self.autocast is not None else contextlib.nullcontext():
            teacher = _teacher_logits(self.model, self.fwd, ids) if cfg.distill > 0 else None
            state.records.clear()
            out = self.fwd(input_ids=ids, labels=ids, use_cache=False)  # no KV cache in training
            s_hat = state.measured_s_hat()
            sp = self._sparsity_term(out, s_hat, ramp, sums)
            lm = out.loss.float()
            if teacher is not None:
                kl = distillation_loss(out.logits, teacher, cfg.distill_temperature)
                sums["kl"] += kl.item() / cfg.grad_accum
                lm = (1.0 - cfg.distill) * lm + cfg.distill * kl
            loss = lm + self.rcfg.sparsity_weight * sp
        if not torch.isfinite(loss):
            raise TrainingDivergedError(
                f"non-finite loss ({loss.item()}) at step {step + 1}; "
                f"last good checkpoint is step {self.last_saved} in {self.stage_dir / CHECKPOINT}",
                "lower --lr or use --dtype fp32, then --resume",
            )
        scaled = loss / cfg.grad_accum
        (self.scaler.scale(scaled) if self.scaler else scaled).backward()
        sums["loss"] += loss.item() / cfg.grad_accum
        sums["lm_loss"] += out.loss.item() / cfg.grad_accum
        for m in self.modules:
            sums[f"s_{m}"] += s_hat[m].item() / cfg.grad_accum

    def _sparsity_term(self, out, s_hat: dict, ramp: float, sums: dict) -> torch.Tensor:
        """``|s_target - s_hat|`` of one micro-batch (multiplied by lambda by the caller): the
        cost-weighted skip fraction against the cost target, else the group fractions against the
        sparsity targets; the target ramps with ``sparsity_warmup``."""
        state, target = self.state, self.skip_target
        if target is not None and state.records:
            s_w = target.cost.weighted_skip({(i, m): f for i, m, f in state.records})
            sums["cost"] += (1.0 - s_w.item()) / self.cfg.grad_accum
            return cost_loss(s_w, ramp * target.skip)
        if s_hat:
            return sparsity_loss(s_hat, {m: t * ramp for m, t in self.targets.items()}, self.rcfg.per_module_targets)
        return out.loss * 0

    def _update(self, step: int, t0: float, ramp: float, sums: dict, log_every: int) -> dict:
        """The parameter update and the step's bookkeeping, with SIGINT held in between: an
        interrupt landing there would checkpoint updated weights under the previous step number."""
        cfg, optimizer = self.cfg, self.optimizer
        with _defer_sigint():
            if self.scaler:
                self.scaler.unscale_(optimizer)
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)
            if self.scaler:
                self.scaler.step(optimizer)
                self.scaler.update()
            else:
                optimizer.step()
            self.scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            self.elapsed += dt
            self.completed, self.snapshot = step + 1, self.rng_snapshot()
            active = [sums[f"s_{m}"] for m in self.modules]
            if self.warm_steps > 0:
                sums["target_ramp"] = ramp
            metrics = {
                "step": step + 1,
                **{k: round(v, 5) for k, v in sums.items()},
                "sparsity": round(sum(active) / len(active), 5) if active else 0.0,
                "tau": round(self.state.tau, 4),
                "lr": optimizer.param_groups[0]["lr"],
                "tokens_per_s": round(cfg.tokens_per_step * self.world / dt, 1),
            }
            if (step + 1) % log_every == 0 or step + 1 == cfg.steps:
                self.history.append(metrics)
        return metrics

    # ----------------------------------------------------------------------------- checkpoints
    def rng_snapshot(self) -> dict:
        return {"gumbel": self.gen.get_state(), "torch": torch.get_rng_state()}

    def meta_for(self, step: int) -> dict:
        return {
            "step": step,
            "tokens": step * self.cfg.tokens_per_step * self.world,
            "world": self.world,
            "seconds": self.elapsed,
            "history": self.history,
            "identity": self.identity,
        }

    def _save(self, step: int, rng: dict) -> None:
        save_checkpoint(self.stage_dir, self.model, self.optimizer, self.scheduler, self.meta_for(step), rng)

    def checkpoint_every(self, done: int) -> None:
        """The periodic checkpoint after ``done`` steps (rank 0; not after the last step)."""
        every = self.cfg.checkpoint_every
        if self.rank == 0 and every and done % every == 0 and done < self.cfg.steps:
            self._save(done, self.snapshot)
            self.last_saved = done

    def save_interrupted(self) -> None:
        """On Ctrl-C: a checkpoint of the last completed step, unless one exists already."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.rank == 0 and self.completed > self.last_saved:
            self._save(self.completed, self.snapshot)

    # ----------------------------------------------------------------------------- after
    def leave_training(self) -> None:
        """Deterministic routing, one process, eval mode: what every caller expects afterwards."""
        self.state.set_mode("argmax")
        self.state.world, self.state.rank = 1, 0
        self.state.grad_checkpointing = False
        self.model.eval()

    def finish(self) -> TrainResult:
        """The result; rank 0 writes the final checkpoint and ``result.json``."""
        cfg, history = self.cfg, self.history
        result = TrainResult(cfg.steps, cfg.steps * cfg.tokens_per_step * self.world, self.elapsed,
                             history[-1] if history else {}, history, self.resumed_from, self.plan.to_dict())
        if self.rank == 0:
            self._save(cfg.steps, self.rng_snapshot())
            atomic_write_json(self.stage_dir / RESULT, {**result.to_dict(), "history": history, "identity": self.identity})
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
