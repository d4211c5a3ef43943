"""Per-layer measured sparsity plots (matplotlib, Agg backend, written atomically)."""

from __future__ import annotations

import io
from pathlib import Path


def plot_layer_sparsity(sparsity: dict, path: Path, *, title: str = "") -> Path:
    """Bar chart of the measured skip fraction per layer, attention and FFN side by side.

    Args:
        sparsity: a summary with ``per_layer: {attention: [...], ffn: [...]}`` (None entries = module
            not routed in that layer, drawn as 0) and module means ``attention``/``ffn``/``total``.
        path: the PNG to write (atomically).
        title: figure title.
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    per = sparsity.get("per_layer") or {}
    att = [0.0 if v is None else v for v in per.get("attention", [])]
    ffn = [0.0 if v is None else v for v in per.get("ffn", [])]
    n = max(len(att), len(ffn), 1)
    xs = list(range(n))
    w = 0.4
    fig, ax = plt.subplots(figsize=(max(6.0, 0.3 * n + 2), 3.5), dpi=110)
    try:
        if att:
            ax.bar([x - w / 2 for x in xs[:len(att)]], att, width=w, label="attention")
        if ffn:
            ax.bar([x + w / 2 for x in xs[:len(ffn)]], ffn, width=w, label="FFN")
        for key, color, label in (("attention", "C0", "attention mean"), ("ffn", "C1", "FFN mean")):
            if sparsity.get(key) is not None:
                ax.axhline(sparsity[key], linestyle="--", linewidth=1, color=color, label=label)
        ax.set_xlabel("layer")
        ax.set_ylabel("measured skip fraction")
        ax.set_ylim(0.0, 1.0)
        ax.set_xticks(xs)
        total = sparsity.get("total")
        sub = "" if total is None else f" (total {total:.3f})"
        ax.set_title(f"{title}{sub}", fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
    except BaseException:
        plt.close(fig)
        raise
    return save_figure(fig, path)


def save_figure(fig, path: Path) -> Path:
    """Write a matplotlib figure as PNG (atomically) and close it. Returns ``path``."""
    import matplotlib.pyplot as plt

    from wide_cli.atomic import atomic_write_bytes

    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png")
    finally:
        plt.close(fig)
    atomic_write_bytes(Path(path), buf.getvalue())
    return Path(path)
