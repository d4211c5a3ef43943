"""`wide prune MODEL`: calibrate -> train -> export -> eval, one summary table."""

from __future__ import annotations

from wide_cli.cli import options


def prune_cmd(
    model: options.ModelArg,
    recipe: options.RecipeOpt = None,
    data: options.Data = None,
    eval_data: options.EvalData = None,
    heldout_fraction: options.HeldoutFraction = None,
    max_train_tokens: options.MaxTrainTokens = None,
    self_generated: options.SelfGenerated = None,
    self_generated_text: options.SelfGeneratedText = None,
    shuffle_documents: options.ShuffleDocs = None,
    method: options.Method = None,
    cost_target: options.CostTarget = None,
    cost_metric: options.CostMetric = None,
    drop_layers: options.DropLayers = None,
    sparsity: options.Sparsity = None,
    sparsity_attention: options.SparsityAttn = None,
    sparsity_ffn: options.SparsityFfn = None,
    sparsity_weight: options.SparsityWeight = None,
    attn_group_size: options.AttnGroup = None,
    ffn_group_size: options.FfnGroup = None,
    router_rank: options.RouterRank = None,
    router_input: options.RouterInput = None,
    tau_start: options.TauStart = None,
    tau_end: options.TauEnd = None,
    sparsity_warmup: options.SparsityWarmup = None,
    standin: options.Standin = None,
    distill: options.Distill = None,
    distill_temperature: options.DistillTemperature = None,
    lora_joint: options.LoraJoint = None,
    steps: options.Steps = None,
    seq_len: options.SeqLen = None,
    batch_size: options.BatchSize = None,
    grad_accum: options.GradAccum = None,
    lr: options.Lr = None,
    seed: options.Seed = None,
    checkpoint_every: options.CheckpointEvery = None,
    grad_checkpointing: options.GradCheckpointing = None,
    max_memory: options.MaxMemory = None,
    dtype: options.Dtype = None,
    train_dtype: options.TrainDtype = None,
    device: options.Device = None,
    router_init: options.RouterInit = None,
    eval_seq_len: options.EvalSeqLen = None,
    eval_max_tokens: options.EvalMaxTokens = None,
    eval_batch_size: options.EvalBatchSize = None,
    lora: options.Lora = None,
    lora_steps: options.LoraSteps = None,
    lora_lr: options.LoraLr = None,
    lora_rank: options.LoraRank = None,
    lora_alpha: options.LoraAlpha = None,
    freeze_routers: options.FreezeRouters = None,
    run_dir: options.RunDirOpt = None,
    out: options.OutOpt = None,
    resume: options.ResumeOpt = False,
    nproc: options.NprocOpt = 1,
    threads: options.ThreadsOpt = None,
    json_out: options.JsonOpt = False,
):
    """Prune MODEL end to end: calibrate, train routers, export, evaluate dense vs pruned."""
    from wide_cli.cli.threads import apply_threads

    flags = {k: v for k, v in locals().items() if k in options.FLAG_FIELDS}
    settings = options.resolve_settings(model, recipe, flags)
    n_threads = apply_threads(threads)
    if nproc > 1:
        import os
        import sys

        import typer

        from wide_cli.train import distributed

        if "WORLD_SIZE" not in os.environ:
            argv = distributed.without_option(distributed.without_option(sys.argv[1:], "--nproc"), "--threads")
            raise typer.Exit(distributed.relaunch_with_torchrun(nproc, argv, threads=max(1, n_threads // nproc)))

    from wide_cli.cli import render
    from wide_cli.cli.logging_setup import quiet_libraries
    from wide_cli.pipeline.prune import prune

    quiet_libraries()
    rd = run_dir or options.default_run_dir(settings)
    result = prune(settings, rd, out, resume=resume, progress=True, log=render.log)
    if result is None:  # a non-zero rank under torchrun: rank 0 reports
        return
    res = result.to_dict()
    render.err.print(render.prune_summary(res))
    if json_out:
        render.emit_json(res)
