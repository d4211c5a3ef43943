"""Markdown tables of a `wide bench --json-out` report (docs/results/bench-cpu*.md): per shape, one
row per system with tokens/s and the speedup over the runtime's dense mode in the same format, for
each thread count side by side. Usage: python benchmarks/bench_cpu_md.py REPORT.json"""

import json
import sys


def tables(doc: dict) -> str:
    rows = doc["results"]
    threads = sorted({r["threads"] for r in rows})
    out = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        out.append(f"### {shape}\n")
        head = ["system", "path", "skips work", "executed MACs"]
        for t in threads:
            head += [f"{t} thread{'s' if t > 1 else ''} tok/s", "x dense"]
        head.append("ideal")
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "---|" * len(head))
        for system in dict.fromkeys(r["system"] for r in rows if r["shape"] == shape):
            by_t = {r["threads"]: r for r in rows if r["shape"] == shape and r["system"] == system}
            first = next(iter(by_t.values()))
            frac = first.get("executed_mac_fraction")
            cells = [system, first.get("path") or "-", "yes" if first.get("skips_work") else "no",
                     "-" if frac is None else f"{frac:.2f}"]
            for t in threads:
                r = by_t.get(t)
                sp = None if r is None else r.get("speedup_vs_dense")
                cells += ["-" if r is None else f"{r['tokens_per_s']:.1f}", "-" if sp is None else f"{sp:.2f}"]
            ideal = first.get("ideal_speedup")
            cells.append("-" if ideal is None else f"{ideal:.2f}")
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    q = doc.get("quality") or {}
    if q:
        out.append("### WikiText-2 perplexity (routed)\n")
        out.append("| format | path | ppl | vs fp32 (same path) | tokens | sparsity |")
        out.append("|---|---|---|---|---|---|")
        for name, v in q.items():
            d = v.get("vs_routed_fp32")
            sp = (v.get("sparsity") or {}).get("total")
            out.append(f"| {name} | {v.get('path', '-')} | {v['perplexity']:.2f} | "
                       f"{'-' if d is None else f'{100 * d:+.2f} %'} | {v['tokens_scored']} | "
                       f"{'-' if sp is None else f'{sp:.3f}'} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(tables(json.load(open(sys.argv[1]))))
