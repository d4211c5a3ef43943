"""Shared option types and the flag -> settings table (flags override the recipe; an option
left at ``None`` means "use the recipe's value")."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

ModelArg = Annotated[str, typer.Argument(help="Model: alias (smollm2-135m, tiny-llama), HF id, local dir or .gguf.")]
RecipeOpt = Annotated[str | None, typer.Option("--recipe", help="Recipe TOML (path or shipped name, see `wide recipes`).")]
RunDirOpt = Annotated[Path | None, typer.Option("--run-dir", help="Run directory (default runs/<model>).")]
OutOpt = Annotated[Path | None, typer.Option("--out", help="Export directory (default <run-dir>/export). An existing wide export there is "
                                              "replaced once the new one is complete; anything else there is refused.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print exactly one JSON object on stdout (logs go to stderr).")]
NprocOpt = Annotated[int, typer.Option("--nproc", help="Data-parallel processes (re-runs itself under torchrun).")]
TrustRemoteCodeOpt = Annotated[bool, typer.Option(
    "--trust-remote-code", help="Run the Python files an --format hf export ships (by default wide loads it into "
    "its own classes and refuses an export whose code differs from what this wide generates).")]
ThreadsOpt = Annotated[int | None, typer.Option(
    "--threads", help="CPU threads per process (default: OMP_NUM_THREADS if set, else the cores not busy "
    "with other processes per the load average, split among torchrun's local processes).")]
ResumeOpt = Annotated[bool, typer.Option("--resume", help="Continue an interrupted run from its last checkpoint.")]

# CLI option name (the Python parameter) -> (settings section, field).
FLAG_FIELDS: dict[str, tuple[str, str]] = {
    "data": ("data", "train"),
    "eval_data": ("data", "eval"),
    "heldout_fraction": ("data", "heldout_fraction"),
    "max_train_tokens": ("data", "max_train_tokens"),
    "self_generated": ("data", "self_generated"),
    "self_generated_text": ("data", "self_generated_text"),
    "shuffle_documents": ("data", "shuffle_documents"),
    "method": ("routing", "method"),
    "sparsity": ("routing", "sparsity"),
    "sparsity_attention": ("routing", "sparsity_attention"),
    "sparsity_ffn": ("routing", "sparsity_ffn"),
    "sparsity_weight": ("routing", "sparsity_weight"),
    "attn_group_size": ("routing", "attn_group_size"),
    "ffn_group_size": ("routing", "ffn_group_size"),
    "router_rank": ("routing", "router_rank"),
    "router_input": ("routing", "router_input"),
    "tau_start": ("routing", "tau_start"),
    "tau_end": ("routing", "tau_end"),
    "cost_target": ("routing", "cost_target"),
    "cost_metric": ("routing", "cost_metric"),
    "sparsity_warmup": ("routing", "sparsity_warmup"),
    "standin": ("routing", "standin"),
    "drop_layers": ("routing", "drop_layers"),
    "distill": ("train", "distill"),
    "distill_temperature": ("train", "distill_temperature"),
    "lora_joint": ("stage2", "joint"),
    "steps": ("train", "steps"),
    "seq_len": ("train", "seq_len"),
    "batch_size": ("train", "batch_size"),
    "grad_accum": ("train", "grad_accum"),
    "lr": ("train", "lr"),
    "seed": ("train", "seed"),
    "checkpoint_every": ("train", "checkpoint_every"),
    "grad_checkpointing": ("train", "grad_checkpointing"),
    "max_memory": ("train", "max_memory"),
    "dtype": ("model", "dtype"),
    "train_dtype": ("train", "dtype"),
    "device": ("model", "device"),
    "router_init": ("run", "router_init"),
    "eval_seq_len": ("eval", "seq_len"),
    "eval_max_tokens": ("eval", "max_tokens"),
    "eval_batch_size": ("eval", "batch_size"),
    "lora": ("stage2", "enabled"),
    "lora_steps": ("stage2", "steps"),
    "lora_lr": ("stage2", "lr"),
    "lora_rank": ("stage2", "lora_rank"),
    "lora_alpha": ("stage2", "lora_alpha"),
    "freeze_routers": ("stage2", "freeze_routers"),
}

# Flags that state the paper's unweighted sparsity target (they replace a recipe's cost target).
SPARSITY_FLAGS = ("sparsity", "sparsity_attention", "sparsity_ffn")

# Option declarations shared by `prune` and the stage commands.
Data = Annotated[str | None, typer.Option("--data", help="Training data: file, directory, HF dataset id or builtin:pydoc.")]
EvalData = Annotated[str | None, typer.Option("--eval-data", help="Text for perplexity (default: held-out split of --data).")]
HeldoutFraction = Annotated[float | None, typer.Option("--heldout-fraction", help=(
    "Share of packed sequences held out of training, for the evaluation (default 0.1); 0 needs --eval-data FILE."))]
MaxTrainTokens = Annotated[int | None, typer.Option("--max-train-tokens", help="Cap on tokenised training data.")]
SelfGenerated = Annotated[int | None, typer.Option("--self-generated", help="Add N chat transcripts written by the dense model itself to the training data (chat models; 0 = none).")]
SelfGeneratedText = Annotated[int | None, typer.Option("--self-generated-text", help="Add N plain-text documents the dense model writes from its start-of-text token to the training data (any model; 0 = none).")]
ShuffleDocs = Annotated[bool | None, typer.Option("--shuffle-documents/--no-shuffle-documents", help="Shuffle documents before packing (default on).")]
Method = Annotated[str | None, typer.Option("--method", help="wide | dynamic-depth | static-width | static-depth | dense.")]
CostTarget = Annotated[float | None, typer.Option("--cost-target", help="Per-token cost to reach, a fraction of dense in (0, 1), e.g. 0.5 = half the FLOPs (wide: instead of --sparsity; static-depth default 0.75).")]
CostMetric = Annotated[str | None, typer.Option("--cost-metric", help="What --cost-target is a fraction of: flops | decode_bytes (default flops).")]
Sparsity = Annotated[float | None, typer.Option("--sparsity", help="Target fraction of skipped (token, group) decisions, unweighted (the paper's), in [0, 1); replaces a recipe's cost target.")]
SparsityWarmup = Annotated[float | None, typer.Option("--sparsity-warmup", help="Fraction of steps over which the sparsity/cost target ramps up from 0 (default 0).")]
Standin = Annotated[str | None, typer.Option("--standin", help="What a skipped group adds: none | mean (calibration-mean output) | trained | lowrank:R (trained mean plus a rank-R map of the module's input, fitted on calibration tokens; R below the group's width; charged in the cost model).")]
DropLayers = Annotated[int | None, typer.Option("--drop-layers", help="Hybrid depth + width (wide, dynamic-depth): first remove this many least influential decoder layers (Block Influence), then route width in the rest; --cost-target still counts the whole model (default 0).")]
Distill = Annotated[float | None, typer.Option("--distill", help="Weight of KL distillation to the dense model in [0, 1] (0 = LM loss only).")]
DistillTemperature = Annotated[float | None, typer.Option("--distill-temperature", help="Softmax temperature of the distillation (default 1).")]
LoraJoint = Annotated[bool | None, typer.Option("--lora-joint/--no-lora-joint", help="Train LoRA with the routers from the first step (no separate stage 2).")]
SparsityAttn = Annotated[float | None, typer.Option("--sparsity-attention", help="Per-module target for attention (with --sparsity-ffn).")]
SparsityFfn = Annotated[float | None, typer.Option("--sparsity-ffn", help="Per-module target for the FFN (with --sparsity-attention).")]
SparsityWeight = Annotated[float | None, typer.Option("--sparsity-weight", help="lambda of the sparsity loss (default 20).")]
AttnGroup = Annotated[int | None, typer.Option("--attn-group-size", help="Query heads per attention group (divides H; default: heads per KV head, one group per KV head).")]
FfnGroup = Annotated[int | None, typer.Option("--ffn-group-size", help="FFN channels per group (divides the intermediate size).")]
RouterInput = Annotated[str | None, typer.Option("--router-input", help="What each router reads: residual (the residual stream, default) | standardized (the residual standardised per channel by its calibration mean and std; for residual streams of Gemma 3's scale; folded into the export's routers).")]
RouterRank = Annotated[int | None, typer.Option("--router-rank", help="Router bottleneck rank r (default 32).")]
TauStart = Annotated[float | None, typer.Option("--tau-start", help="Gumbel temperature at the first step (default 5.0).")]
TauEnd = Annotated[float | None, typer.Option("--tau-end", help="Gumbel temperature at the last step (default 0.5).")]
Steps = Annotated[int | None, typer.Option("--steps", help="Optimizer steps of stage 1.")]
SeqLen = Annotated[int | None, typer.Option("--seq-len", help="Tokens per training sequence.")]
BatchSize = Annotated[int | None, typer.Option("--batch-size", help="Sequences per micro-batch.")]
GradAccum = Annotated[int | None, typer.Option("--grad-accum", help="Micro-batches per optimizer step.")]
Lr = Annotated[float | None, typer.Option("--lr", help="Router learning rate (default 2e-3).")]
Seed = Annotated[int | None, typer.Option("--seed", help="Seed for data order, Gumbel noise and init.")]
CheckpointEvery = Annotated[int | None, typer.Option("--checkpoint-every", help="Steps between checkpoints.")]
GradCheckpointing = Annotated[bool | None, typer.Option("--grad-checkpointing/--no-grad-checkpointing", help="Recompute each decoder layer in backward: less activation memory, ~1/3 more compute.")]
MaxMemory = Annotated[str | None, typer.Option("--max-memory", help="Memory one training process may use, e.g. 24GiB (default: what the device has free).")]
Dtype = Annotated[str | None, typer.Option("--dtype", help="fp32 | bf16 | fp16 (fp16 on CPU is upcast to fp32).")]
TrainDtype = Annotated[str | None, typer.Option("--train-dtype", help="Training autocast: fp32 | bf16 | fp16 (CUDA) | auto (bf16 where the hardware multiplies it).")]
Device = Annotated[str | None, typer.Option("--device", help="cpu | cuda | cuda:N.")]
RouterInit = Annotated[str | None, typer.Option("--router-init", help="default | calibration.")]
EvalSeqLen = Annotated[int | None, typer.Option("--eval-seq-len", help="Perplexity window length (default: --seq-len).")]
EvalMaxTokens = Annotated[int | None, typer.Option("--eval-max-tokens", help="Cap on perplexity tokens.")]
EvalBatchSize = Annotated[int | None, typer.Option("--eval-batch-size", help="Windows per perplexity forward.")]
Lora = Annotated[bool | None, typer.Option("--lora/--no-lora", help="Run stage 2 (LoRA recovery) after stage 1.")]
LoraSteps = Annotated[int | None, typer.Option("--lora-steps", help="Optimizer steps of stage 2.")]
LoraLr = Annotated[float | None, typer.Option("--lora-lr", help="Stage-2 learning rate (default 2e-4).")]
LoraRank = Annotated[int | None, typer.Option("--lora-rank", help="LoRA rank (default 16).")]
LoraAlpha = Annotated[float | None, typer.Option("--lora-alpha", help="LoRA alpha (default 32).")]
FreezeRouters = Annotated[bool | None, typer.Option("--freeze-routers/--train-routers", help="Keep routers fixed in stage 2.")]


def resolve_settings(model: str | None, recipe: str | None, flags: dict):
    """Defaults <- recipe <- flags. ``flags`` maps parameter names of FLAG_FIELDS to values
    (None = not given). A sparsity flag clears the recipe's cost target; ``--method static-depth``
    or ``static-width`` clears its ``drop_layers``. Returns Settings.

    Raises:
        ConfigError: bad values, or a sparsity flag and ``--cost-target`` given together.
    """
    from wide_cli.errors import ConfigError
    from wide_cli.pipeline.settings import Settings, apply_overrides, load_recipe

    settings = load_recipe(recipe) if recipe else Settings()
    over = {FLAG_FIELDS[k]: v for k, v in flags.items() if k in FLAG_FIELDS}
    # A sparsity flag states the paper's unweighted group fraction; a cost target in the recipe
    # would replace it without a word, so the flag clears it. Both on one command line conflict.
    given = {k: v for k, v in flags.items() if k in SPARSITY_FLAGS and v is not None}
    if given and flags.get("cost_target") is not None:
        name, value = next(iter(given.items()))
        raise ConfigError(f"--{name.replace('_', '-')} {value} and --cost-target {flags['cost_target']} both given",
                          "give one: --cost-target weighs each group by its cost, --sparsity is the paper's "
                          "unweighted fraction of skipped groups")
    if given:
        settings = settings.replace("routing", cost_target=None)
    # A recipe can describe a hybrid (layers dropped, width routed in the rest); a command-line
    # method without layer dropping asks for something else, so the recipe's layer count is
    # cleared rather than refused. `--drop-layers` on the same command line is still checked.
    if flags.get("method") in ("static-depth", "static-width") and flags.get("drop_layers") is None:
        settings = settings.replace("routing", drop_layers=0)
    if model is not None:
        over[("model", "name")] = model
    return apply_overrides(settings, over)


def default_run_dir(settings) -> Path:
    name = Path(settings.model.name).name.removesuffix(".gguf").replace("/", "--")
    return Path("runs") / f"{name}-{settings.routing.method}"
