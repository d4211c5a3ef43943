"""`wide recipes [NAME]`: list the shipped recipes, or show one resolved."""

from __future__ import annotations

from typing import Annotated

import typer


def recipes_cmd(
    name: Annotated[str | None, typer.Argument(help="Recipe to show (name or path).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON on stdout.")] = False,
):
    """List the shipped recipes, or show one with every resolved value."""
    from rich.table import Table

    from wide_cli.cli import render
    from wide_cli.pipeline.recipes import list_recipes
    from wide_cli.pipeline.settings import load_recipe

    if name is None:
        rows = []
        for p in list_recipes():
            s = load_recipe(p)
            rows.append({"name": p.stem, "path": str(p), "model": s.model.name, "method": s.routing.method,
                         "sparsity": s.routing.sparsity, "cost_target": s.routing.cost_target,
                         "target": (f"cost {s.routing.cost_target:g} {s.routing.cost_metric}"
                                    if s.routing.cost_target is not None else f"sparsity {s.routing.sparsity:g}"),
                         "steps": s.train.steps,
                         "tokens_per_step": s.train.tokens_per_step})
        if json_out:
            render.emit_json({"recipes": rows})
            return
        t = Table(title="shipped recipes")
        cols = ("name", "model", "method", "target", "steps", "tokens_per_step")
        for c in cols:
            t.add_column(c)
        for r in rows:
            t.add_row(*(str(r[c]) for c in cols))
        render.err.print(t)
        return
    s = load_recipe(name).to_dict()
    if json_out:
        render.emit_json(s)
        return
    for section, values in s.items():
        render.err.print(f"[bold][{section}][/bold]")
        for k, v in values.items():
            render.err.print(f"  {k} = {v!r}", highlight=False)
