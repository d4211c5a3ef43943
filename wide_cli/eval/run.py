"""``evaluate_targets``: load each model, run the tasks, build (and optionally write) the report.

A target is an export directory (holds ``wide_config.json``; loaded with
``wide_cli.export.load_pruned``) or any model spec ``wide_cli.models.loader.load_model`` accepts
(alias, local directory, hub id, ``.gguf``). The first dense target is the reference for
"% of dense". All settings are checked before the first model is loaded.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from wide_cli.artifacts import ExportInfo
from wide_cli.errors import ConfigError, DataError
from wide_cli.eval.tasks import PERPLEXITY_TASKS, TASKS, check_limit, get_task, task_path

logger = logging.getLogger("wide.eval")

DEFAULT_TASKS = ("wikitext", "arc_easy", "arc_challenge", "piqa", "hellaswag", "boolq", "winogrande", "openbookqa")
#: Perplexity window when --seq-len is not given (capped at the model's context length).
DEFAULT_SEQ_LEN = 2048


@dataclass
class Target:
    """A loaded evaluation target.

    Attributes:
        name: the string the user passed.
        model, tokenizer: eval-mode model (routed for pruned exports) and its tokenizer.
        kind: ``dense`` (no routing, or an export whose method is ``dense``) or ``pruned``.
        source: ``{spec, resolved, revision}``: for a dense target what was loaded; for an export
            the ``source_model`` recorded in its ``wide_config.json``.
        wide_config: the export's ``wide_config.json`` (None for a plain model).
    """

    name: str
    model: object
    tokenizer: object
    kind: str
    source: dict
    wide_config: dict | None = None


def load_target(target: str, *, dtype, device, trust_remote_code: bool = False) -> Target:
    """Load one target (see the module docstring). ``dtype`` is a torch dtype;
    ``trust_remote_code`` lets an hf export's shipped code run (``load_hf_export``)."""
    from wide_cli.export import is_export, load_pruned

    if is_export(target):
        pm = load_pruned(target, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
        wcfg = pm.wide_config or {}
        state = getattr(pm.model, "wide_routing", None)
        # a static-depth export routes nothing but is still a pruned model (fewer layers)
        dense = (state is None or state.cfg.method == "dense") and ExportInfo(wcfg).method != "static-depth"
        return Target(target, pm.model, pm.tokenizer, "dense" if dense else "pruned",
                      dict(wcfg.get("source_model") or {}), wcfg)
    from wide_cli.models.loader import load_model

    lm = load_model(target, dtype=dtype, device=device)
    return Target(target, lm.model, lm.tokenizer, "dense",
                  {"spec": lm.source, "resolved": lm.resolved, "revision": lm.revision})


@dataclass(frozen=True)
class EvalPlan:
    """Checked settings of one ``evaluate_targets`` call (see its docstring for the meaning)."""

    tasks: tuple[str, ...]
    data_dir: Path | None
    limit: int | None
    seq_len: int | None
    stride: int | None
    batch_size: int
    eval_data: Path | None
    wikitext_dataset: str = "wikitext-2-raw-v1"
    split: str = "test"
    #: ``token`` (pruning papers' token-level perplexity) and/or ``harness`` (lm-eval word-level)
    wikitext_protocols: tuple[str, ...] = ("token", "harness")

    @property
    def zero_shot(self) -> tuple[str, ...]:
        return tuple(t for t in self.tasks if t in TASKS)


def make_plan(
    tasks: list[str],
    *,
    data_dir: Path | None,
    limit: int | None,
    seq_len: int | None,
    stride: int | None,
    batch_size: int,
    eval_data: Path | None,
) -> EvalPlan:
    """Validate the settings (before any model is loaded).

    Raises:
        ConfigError: unknown task (known ones listed), limit <= 0, batch size < 1, seq-len < 2,
            stride outside [1, seq-len], nothing to evaluate.
        DataError: a task's data file or the --eval-data file is missing.
    """
    from wide_cli.eval import wikitext

    names: list[str] = []
    dataset = wikitext.CANONICAL
    for t in tasks:
        t = t.strip()
        if not t:
            continue
        if t.lower().startswith("wikitext"):
            # refuses WikiText-103 etc.; logs once how the ambiguous `wikitext` resolves
            dataset = wikitext.resolve_dataset(t)
            t = "wikitext"
        else:
            get_task(t)
        if t not in names:
            names.append(t)
    check_limit(limit)
    if batch_size < 1:
        raise ConfigError(f"batch-size {batch_size} must be >= 1")
    if seq_len is not None and seq_len < 2:
        raise ConfigError(f"seq-len {seq_len} must be >= 2", "use e.g. --seq-len 2048")
    if stride is not None and (stride < 1 or (seq_len is not None and stride > seq_len)):
        raise ConfigError(f"stride {stride} must be in [1, seq-len]", "omit --stride for non-overlapping windows")
    if not names and eval_data is None:
        raise ConfigError("nothing to evaluate", f"pass --tasks (known: {', '.join([*PERPLEXITY_TASKS, *TASKS])}) "
                          "or --eval-data FILE")
    if names and data_dir is None:
        raise DataError("no data directory for the tasks", "pass --data-dir pointing at shared/data")
    for t in names:
        if t == "wikitext":
            wikitext.raw_path(Path(data_dir), "test")
        else:
            task_path(TASKS[t], Path(data_dir))
    if eval_data is not None and not Path(eval_data).is_file():
        raise DataError(f"--eval-data file {eval_data} not found", "pass a UTF-8 text file")
    return EvalPlan(tuple(names), None if data_dir is None else Path(data_dir), limit, seq_len, stride,
                    batch_size, None if eval_data is None else Path(eval_data), dataset)


def resolve_seq_len(plan: EvalPlan, model, tokenizer) -> int:
    """The perplexity window for ``model``: --seq-len, else min(2048, the model's context length).

    Raises:
        ConfigError: --seq-len longer than the model's context length.
    """
    from wide_cli.eval.scoring import resolve_max_length

    max_len = resolve_max_length(model, tokenizer)
    if plan.seq_len is None:
        return min(DEFAULT_SEQ_LEN, max_len)
    from wide_cli.models.arch import check_context

    check_context(plan.seq_len, max_len, f"seq-len {plan.seq_len}", f"pass --seq-len {max_len} or less")
    return plan.seq_len


def eval_text_file(model, tokenizer, path: Path, *, seq_len: int, stride: int | None, batch_size: int,
                   meter=None) -> dict:
    """Token-level perplexity of any UTF-8 text file, tokenized whole with the tokenizer's defaults."""
    import torch

    from wide_cli.eval.perplexity import token_perplexity

    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"--eval-data file {path} is not UTF-8 text ({e.reason} at byte {e.start})",
                        "pass a UTF-8 text file") from None
    if not text.strip():
        raise DataError(f"--eval-data file {path} is empty", "pass a file with text")
    ids = tokenizer(text, return_attention_mask=False, verbose=False)["input_ids"]
    res = token_perplexity(model, torch.tensor(ids, dtype=torch.long), seq_len=seq_len, stride=stride,
                           batch_size=batch_size, meter=meter)
    bos = tokenizer.bos_token_id
    res["dataset"] = {"file": str(path), "n_chars": len(text)}
    res["bos_policy"] = ("tokenizer default special tokens on the whole file: "
                         + ("one BOS at the start" if bos is not None and ids and ids[0] == bos else "no BOS added"))
    res["summary_metric"], res["summary_value"] = "perplexity", res["perplexity"]
    return res


def evaluate_model(target: Target, plan: EvalPlan) -> dict:
    """Run every task of ``plan`` on one loaded target; returns its report row (no reference
    columns yet; ``build_report`` adds them)."""
    from wide_cli.cost import decode_speedup_bound, flops_report, hybrid_export_cost, static_depth_export_cost
    from wide_cli.eval import progress
    from wide_cli.eval.wikitext import evaluate_wikitext
    from wide_cli.eval.zeroshot import evaluate_task
    from wide_cli.models.arch import model_shape
    from wide_cli.routing.measure import SparsityMeter

    model, tok = target.model, target.tokenizer
    seq_len = resolve_seq_len(plan, model, tok)
    total = SparsityMeter()
    results: dict[str, dict] = {}
    for t in plan.tasks:
        sub = SparsityMeter()
        logger.info("%s: %s ...", target.name, t)
        with progress.label(f"{target.name}: {t}"):
            if t == "wikitext":
                results[t] = evaluate_wikitext(model, tok, data_dir=plan.data_dir, dataset=plan.wikitext_dataset,
                                               split=plan.split, limit=plan.limit, seq_len=seq_len,
                                               stride=plan.stride, batch_size=plan.batch_size, meter=sub,
                                               protocols=plan.wikitext_protocols)
            else:
                results[t] = evaluate_task(model, tok, t, data_dir=plan.data_dir, limit=plan.limit,
                                           batch_size=plan.batch_size, meter=sub)
        total.merge(sub)
        logger.info("%s: %s %s = %.4f", target.name, t, results[t]["summary_metric"], results[t]["summary_value"])
    if plan.eval_data is not None:
        sub = SparsityMeter()
        results["eval_data"] = eval_text_file(model, tok, plan.eval_data, seq_len=seq_len, stride=plan.stride,
                                              batch_size=plan.batch_size, meter=sub)
        total.merge(sub)
    sparsity = total.summary()
    wcfg = target.wide_config or {}
    info = ExportInfo(wcfg) if wcfg else None
    if info is not None and info.static_width and info.export_format == "hf":
        # a physically narrowed static-width export makes no routing decisions to count: its
        # sparsity is its kept groups (input independent, exact)
        from wide_cli.routing.measure import static_sparsity

        layout = wcfg.get("layout") or getattr(model.config, "wide_routing", {}).get("layout")
        sparsity = static_sparsity({**wcfg, "layout": layout})
    shape = model_shape(model.config)
    state = getattr(model, "wide_routing", None)
    router = {}
    if state is not None and state.cfg.method in ("wide", "dynamic-depth"):
        router = {"router_rank": state.cfg.router_rank, "attn_groups": state.layout.attn_groups,
                  "ffn_groups": state.layout.ffn_groups, "standin_rank": _standin_rank(state.cfg)}
    flops = flops_report(shape, sparsity, seq_len=seq_len, **router)
    bound = decode_speedup_bound(shape, sparsity, **{k: v for k, v in router.items() if k != "router_rank"})
    if info is not None and info.method == "static-depth":  # relative to the source model, whose layers it removed
        flops, bound = static_depth_export_cost(wcfg, shape, seq_len=seq_len)
    elif info is not None and info.dropped_layers:  # hybrid: routed layers of a layer-pruned source, against the source
        flops, bound = hybrid_export_cost(wcfg, shape, sparsity, seq_len=seq_len, routers=router)
    return {
        "name": target.name,
        "kind": target.kind,
        "method": info.method if info is not None else (state.cfg.method if state is not None else "dense"),
        "source": target.source,
        "routing": wcfg.get("routing") if wcfg else (state.cfg.to_dict() if state is not None else None),
        "export_measured_sparsity": wcfg.get("measured_sparsity"),
        "seq_len": seq_len,
        "results": results,
        "sparsity": sparsity,
        "flops": {k: flops[k] for k in ("relative", "dense_flops_per_token", "routed_flops_per_token",
                                        "router_flops_per_token", "context_len")},
        "decode_speedup_bound": bound,
        "warnings": [],
    }


def _standin_rank(cfg) -> int:
    """R of ``lowrank:R`` stand-ins in a routing config (a ``RoutingConfig``, or the namespace an hf
    export's own code builds), else 0."""
    from wide_cli.routing.config import parse_standin

    return parse_standin(getattr(cfg, "standin", "none") or "none")[1]


def source_mismatch(pruned: Target, dense: Target) -> str | None:
    """A warning when an export was pruned from another model than the dense reference."""
    src, ref = pruned.source or {}, dense.source or {}
    if not src:
        return (f"export {pruned.name} records no source_model; cannot check it against the dense "
                f"reference {dense.name}")
    same = (src.get("spec") and src.get("spec") == ref.get("spec")) or (
        src.get("resolved") and src.get("resolved") == ref.get("resolved"))
    if same:
        if src.get("revision") and ref.get("revision") and src["revision"] != ref["revision"]:
            return (f"export {pruned.name} was pruned from {src.get('spec')} revision {src['revision']}, "
                    f"but the dense reference is revision {ref['revision']}")
        return None
    return (f"export {pruned.name} was pruned from {src.get('spec')!r} ({src.get('resolved')}), but the "
            f"dense reference is {ref.get('spec')!r} ({ref.get('resolved')}): '% of dense' compares "
            "different models")


def evaluate_targets(
    targets: list[str],
    *,
    tasks: list[str],
    data_dir: Path | None,
    limit: int | None = None,
    seq_len: int | None = None,
    batch_size: int = 4,
    dtype="fp32",
    device="cpu",
    eval_data: Path | None = None,
    out_dir: Path | None = None,
    stride: int | None = None,
    cache_dir: Path | None = None,
    wikitext_protocols: tuple[str, ...] = ("token", "harness"),
    trust_remote_code: bool = False,
) -> dict:
    """Evaluate models side by side and build the comparison report.

    Args:
        targets: export directories and/or model specs, evaluated in order; the first dense one
            is the reference for "% of dense".
        tasks: ``wikitext`` and/or zero-shot task names (``wide_cli.eval.tasks.TASKS``).
        data_dir: directory holding ``wikitext-2-raw/`` and ``zeroshot/`` (shared/data).
        limit: first N items per zero-shot task, first N pages of WikiText-2; None = all.
        seq_len: perplexity window; None = min(2048, model context length).
        batch_size: requests/windows per forward.
        dtype: ``fp32`` / ``bf16`` / ``fp16`` (or a torch dtype); device: ``cpu``, ``cuda``, ``auto``.
        eval_data: any UTF-8 text file: token-level perplexity on it.
        out_dir: when set, writes ``report.json``, ``report.md`` and one per-layer sparsity PNG per
            pruned model there (atomically).
        stride: perplexity stride (None = non-overlapping windows).
        cache_dir: when set, a model's row is read from there if its weights, the data, these
            settings and the evaluation code are unchanged, and stored there otherwise
            (``wide_cli.eval.cache``).
        wikitext_protocols: ``token`` and/or ``harness`` (``wide_cli.eval.wikitext.evaluate_wikitext``);
            ``token`` alone halves WikiText's time.
        trust_remote_code: run the Python files of hf-format exports (never by default).

    Returns:
        The report dict (schema in ``wide_cli.eval.report``).

    Raises:
        ConfigError / DataError: bad settings or data, before any model is loaded.
        ModelSourceError / CheckpointError: from the loaders.
    """
    import torch

    from wide_cli.eval import cache
    from wide_cli.eval.report import build_report, write_report
    from wide_cli.models.loader import resolve_dtype

    if not targets:
        raise ConfigError("no target to evaluate", "pass one or more models or export directories")
    import dataclasses

    plan = make_plan(tasks, data_dir=data_dir, limit=limit, seq_len=seq_len, stride=stride,
                     batch_size=batch_size, eval_data=eval_data)
    plan = dataclasses.replace(plan, wikitext_protocols=tuple(wikitext_protocols))
    if device in (None, "auto"):
        device = "cuda" if torch.cuda.is_available() else "cpu"
    tdtype = resolve_dtype(dtype, device)
    rows, dense_ref, warnings_ = [], None, []
    for name in targets:
        tgt = load_target(name, dtype=tdtype, device=device, trust_remote_code=trust_remote_code)
        if tgt.kind == "dense" and dense_ref is None:
            dense_ref = Target(tgt.name, None, None, "dense", tgt.source)
        key = cache.cache_key(tgt, plan, dtype=tdtype, device=device) if cache_dir is not None else None
        row = cache.load_row(cache_dir, key) if key else None
        if row is None:
            row = evaluate_model(tgt, plan)
            if key:
                cache.store_row(cache_dir, key, row)
        else:
            logger.info("%s: results from the cache (%s/%s.json)", tgt.name, cache_dir, key)
            row = {**row, "name": tgt.name}
        rows.append(row)
        del tgt  # free the model before loading the next one
    if dense_ref is not None:  # warn loudly (and keep going) when an export has another source
        for row in rows:
            msg = source_mismatch(Target(row["name"], None, None, "pruned", row["source"]), dense_ref) \
                if row["kind"] == "pruned" else None
            if msg:
                logger.warning("WARNING: %s", msg)
                row["warnings"].append(msg)
                warnings_.append(msg)
    settings = {
        "tasks": list(plan.tasks), "data_dir": None if plan.data_dir is None else str(plan.data_dir),
        "limit": plan.limit, "seq_len": plan.seq_len, "stride": plan.stride, "batch_size": plan.batch_size,
        "dtype": str(dtype), "device": str(device),
        "eval_data": None if plan.eval_data is None else str(plan.eval_data),
    }
    report = build_report(rows, settings=settings, warnings=warnings_)
    if out_dir is not None:
        write_report(report, Path(out_dir))
    return report
