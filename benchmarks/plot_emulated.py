"""Draw the emulated-cluster figures of docs/benchmarks.md from `flashsgd bench emulate --json` files.

Dense files (rows with ``size_bytes`` / ``time_us``): time and fraction of the physical bound
2(N-1)/N * S / B against message size, one line per algorithm. Sparse files (rows with ``e2e_ms``):
bars of end-to-end time per algorithm and density, with the dense physical bound as a line. Both
read the ``emu_*`` columns that :func:`flashsgd.emulate.report.annotate` added.

    python benchmarks/plot_emulated.py docs/data/emulated_1gbit.json docs/img/emulate_dense_4x2_1gbit.png
    python benchmarks/plot_emulated.py docs/data/emulated_1gbit_sparse.json \\
        docs/img/emulate_sparse_8x1_1gbit.png
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)


def plot_dense(doc: dict, path: str, title: str = "") -> None:
    """Time and fraction of the physical bound against message size, one line per algorithm."""
    rows = [r for r in doc.get("results", []) if "emu_bound_us" in r]
    algos = list(dict.fromkeys(r["algorithm"] for r in rows))
    fig, (ax_t, ax_f) = plt.subplots(1, 2, figsize=(11, 4.2))
    for algo in algos:
        pts = sorted((r["size_bytes"] / 1e6, r["time_us"] / 1e3, r["emu_frac_of_bound"])
                     for r in rows if r["algorithm"] == algo)
        ax_t.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=algo)
        if pts and pts[0][2] is not None:
            ax_f.plot([p[0] for p in pts], [p[2] for p in pts], "o-", label=algo)
    sizes = sorted({r["size_bytes"] for r in rows})
    bound = {r["size_bytes"]: r["emu_bound_us"] for r in rows}
    ax_t.plot([s / 1e6 for s in sizes], [bound[s] / 1e3 for s in sizes], "k--", label="physical bound")
    for ax in (ax_t, ax_f):
        ax.set_xscale("log")
        ax.set_xlabel("message size per rank (MB, 1e6 B)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    ax_t.set_yscale("log")
    ax_t.set_ylabel("time per all-reduce (ms)")
    ax_f.set_ylabel("physical bound / time (1 = link-limited optimum)")
    ax_f.set_ylim(0, 1.1)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _bars(ax, rows: list[dict], algos: list[str], densities: list[float]) -> None:
    """One group of bars per density, one bar per algorithm, the selection part hatched."""
    width = 0.8 / max(1, len(algos))
    for j, algo in enumerate(algos):
        ys = []
        for d in densities:
            match = [r for r in rows if r["algorithm"] == algo and r.get("for_density", r["density"]) == d]
            ys.append(match[0]["e2e_ms"] if match else float("nan"))
        xs = [i + (j - (len(algos) - 1) / 2) * width for i in range(len(densities))]
        bars = ax.bar(xs, ys, width, label=algo)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
        sel = [next((r.get("select_ms") for r in rows if r["algorithm"] == algo and r["density"] == d),
                    None) for d in densities]
        if any(v is not None for v in sel):
            ax.bar(xs, [v or 0 for v in sel], width, fill=False, hatch="//", edgecolor="k", lw=0,
                   label="(top-k selection part)" if j == len(algos) - 1 else None)


def plot_sparse(doc: dict, path: str, title: str = "") -> None:
    """Bars of end-to-end time per algorithm for each density, with the dense physical bound."""
    rows = [r for r in doc.get("results", []) if "emu_bound_us" in r and "e2e_ms" in r]
    densities = sorted({r["density"] for r in rows if r.get("density", 1.0) < 1.0})
    algos = list(dict.fromkeys(r["algorithm"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    _bars(ax, rows, algos, densities)
    bound_ms = rows[0]["emu_bound_us"] / 1e3 if rows else 0
    ax.axhline(bound_ms, color="k", ls="--", label=f"dense physical bound {bound_ms:.0f} ms")
    ax.set_xticks(range(len(densities)), [f"density {d:g}" for d in densities])
    ax.set_ylim(0, max([r["e2e_ms"] for r in rows] + [bound_ms]) * 1.25)
    ax.set_ylabel("time per exchange, end to end (ms)")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=3, loc="upper center")
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", help="a `flashsgd bench emulate --json` file")
    p.add_argument("png", help="where to write the figure")
    p.add_argument("--title", default="")
    a = p.parse_args()
    with open(a.json) as f:
        doc = json.load(f)
    sparse = any("e2e_ms" in r for r in doc.get("results", []))
    (plot_sparse if sparse else plot_dense)(doc, a.png, a.title)
    print(f"wrote {a.png}")


if __name__ == "__main__":
    main()
