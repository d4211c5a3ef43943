"""Markdown tables of a `wide bench --json-out` report (docs/results/bench-cpu*.md): per shape, one
row per system with tokens/s and the speedup over the runtime's dense mode in the same format, for
each thread count side by side. Usage: python benchmarks/bench_cpu_md.py REPORT.json; or
`--int4ppl NAME=PLAIN.json,IMPORTANCE.json ...` for the perplexity of plain against importance-matrix
int4 per export (`SECTIONS=int4ppl benchmarks/bench_cpu.sh`'s reports)."""

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


def int4_table(pairs: list[tuple[str, dict, dict]]) -> str:
    """One row per (export, int4 scheme, path): WikiText-2 perplexity against the same export's
    fp32 on the same path, from a report with fp32 and plain int4 and one of the int4 export."""
    out = ["| export | weights | path | ppl | vs fp32 (same path) |", "|---|---|---|---|---|"]
    for name, plain, imp in pairs:
        qp, qi = plain["quality"], imp["quality"]
        for mode, suffix in (("prefill", ""), ("decode", " decode")):
            ref = qp[f"routed fp32{suffix}"]["perplexity"]
            rows = [("fp32", qp[f"routed fp32{suffix}"]), ("int4, plain rule (quantized at load)", qp[f"routed int4{suffix}"]),
                    ("int4 export, importance matrix", qi[f"routed int4{suffix}"])]
            for label, v in rows:
                d = v["perplexity"] / ref - 1
                out.append(f"| {name} | {label} | {v.get('path', '-')} {mode} | {v['perplexity']:.2f} | "
                           f"{'-' if label == 'fp32' else f'{100 * d:+.2f} %'} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    if sys.argv[1] == "--int4ppl":
        pairs = []
        for arg in sys.argv[2:]:
            name, files = arg.split("=", 1)
            plain, imp = files.split(",")
            pairs.append((name, json.load(open(plain)), json.load(open(imp))))
        print(int4_table(pairs))
    else:
        print(tables(json.load(open(sys.argv[1]))))
