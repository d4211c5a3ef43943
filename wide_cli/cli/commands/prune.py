"""`wide prune MODEL`: calibrate -> train -> export -> eval, one summary table."""

from __future__ import annotations

from wide_cli.cli import options as o


def prune_cmd(
    model: o.ModelArg,
    recipe: o.RecipeOpt = None,
    data: o.Data = None,
    eval_data: o.EvalData = None,
    heldout_fraction: o.HeldoutFraction = None,
    max_train_tokens: o.MaxTrainTokens = None,
    shuffle_documents: o.ShuffleDocs = None,
    method: o.Method = None,
    cost_target: o.CostTarget = None,
    cost_metric: o.CostMetric = None,
    drop_layers: o.DropLayers = None,
    sparsity: o.Sparsity = None,
    sparsity_attention: o.SparsityAttn = None,
    sparsity_ffn: o.SparsityFfn = None,
    sparsity_weight: o.SparsityWeight = None,
    attn_group_size: o.AttnGroup = None,
    ffn_group_size: o.FfnGroup = None,
    router_rank: o.RouterRank = None,
    tau_start: o.TauStart = None,
    tau_end: o.TauEnd = None,
    sparsity_warmup: o.SparsityWarmup = None,
    standin: o.Standin = None,
    distill: o.Distill = None,
    distill_temperature: o.DistillTemperature = None,
    lora_joint: o.LoraJoint = None,
    steps: o.Steps = None,
    seq_len: o.SeqLen = None,
    batch_size: o.BatchSize = None,
    grad_accum: o.GradAccum = None,
    lr: o.Lr = None,
    seed: o.Seed = None,
    checkpoint_every: o.CheckpointEvery = None,
    grad_checkpointing: o.GradCheckpointing = None,
    max_memory: o.MaxMemory = None,
    dtype: o.Dtype = None,
    train_dtype: o.TrainDtype = None,
    device: o.Device = None,
    router_init: o.RouterInit = None,
    eval_seq_len: o.EvalSeqLen = None,
    eval_max_tokens: o.EvalMaxTokens = None,
    eval_batch_size: o.EvalBatchSize = None,
    lora: o.Lora = None,
    lora_steps: o.LoraSteps = None,
    lora_lr: o.LoraLr = None,
    lora_rank: o.LoraRank = None,
    lora_alpha: o.LoraAlpha = None,
    freeze_routers: o.FreezeRouters = None,
    run_dir: o.RunDirOpt = None,
    out: o.OutOpt = None,
    resume: o.ResumeOpt = False,
    nproc: o.NprocOpt = 1,
    threads: o.ThreadsOpt = None,
    json_out: o.JsonOpt = False,
):
    """Prune MODEL end to end: calibrate, train routers, export, evaluate dense vs pruned."""
    from wide_cli.cli.threads import apply_threads

    flags = {k: v for k, v in locals().items() if k in o.FLAG_FIELDS}
    settings = o.resolve_settings(model, recipe, flags)
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
    rd = run_dir or o.default_run_dir(settings)
    result = prune(settings, rd, out, resume=resume, progress=True, log=render.log)
    if result is None:  # a non-zero rank under torchrun: rank 0 reports
        return
    res = result.to_dict()
    render.err.print(render.prune_summary(res))
    if json_out:
        render.emit_json(res)
