"""PNG of per-layer sparsity (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path


def plot_sparsity(per_layer: dict, out: Path, *, title: str = "") -> Path:
    """Grouped bars: per layer, the measured skip fraction of attention and of the FFN.

    Args:
        per_layer: ``{"attention": [float | None per layer], "ffn": [...]}`` (None = not routed,
            drawn as no bar).
        out: the PNG path (parent directories are created; written atomically).
    Returns:
        ``out``.
    """
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from wide_cli.atomic import atomic_write_bytes

    att = list(per_layer.get("attention") or [])
    ffn = list(per_layer.get("ffn") or [])
    n = max(len(att), len(ffn))
    xs = list(range(n))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.28 * n + 2), 3.6), dpi=120)
    w = 0.4
    for off, vals, label, color in ((-w / 2, att, "attention", "#d95f02"), (w / 2, ffn, "FFN", "#1b9e77")):
        pts = [(x + off, v) for x, v in zip(xs, vals) if v is not None]
        if pts:
            ax.bar([p[0] for p in pts], [p[1] for p in pts], width=w, label=label, color=color)
    ax.set_xlabel("layer")
    ax.set_ylabel("skipped fraction of groups")
    ax.set_ylim(0, 1)
    ax.set_xticks(xs if n <= 40 else xs[::5])
    ax.set_title(title or "per-layer sparsity")
    ax.legend(loc="upper right", frameon=False)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    out = Path(out)
    atomic_write_bytes(out, buf.getvalue())
    return out
