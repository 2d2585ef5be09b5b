"""A bar chart of output tokens/s, one panel per workload (matplotlib, imported only when --plot asks for it)."""

from __future__ import annotations

from pathlib import Path

from .workloads import SMALL_REQUESTS


def write_plot(results: dict, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:  # a bare GPU machine may lack it: the JSON is what counts
        print(f"note: matplotlib is not installed, so {path} was not drawn", flush=True)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results["results"] if r["status"] == "ok"]
    workloads = list(dict.fromkeys(r["workload"] for r in ok))  # in the order they ran: batch-B is one per size
    if not workloads:
        return
    config, machine = results["config"], results["machine"]
    titles = {
        "decode": f"decode: batch 1, {config['decode_tokens']} tokens",
        "mixed": f"mixed: {config['num_requests']} requests",
        "shared": f"shared prefix: {config['num_requests']} requests, "
                  f"{config['shared_prefix_len']}-token system prompt",
        "small": f"small: {SMALL_REQUESTS} requests of 4-16 tokens in and out",
        "grounded": f"grounded: {config.get('chat_requests')} chat requests that copy or edit a passage",
        "open": f"open: {config.get('chat_requests')} chat requests with nothing to copy",
    }
    most_bars = max(sum(r["workload"] == w for r in ok) for w in workloads)
    width = max(5.5, 0.85 * most_bars)  # room for every bar's label
    fig, axes = plt.subplots(1, len(workloads), figsize=(width * len(workloads), 4.6), squeeze=False)
    for ax, workload in zip(axes[0], workloads, strict=True):
        rows = [r for r in ok if r["workload"] == workload]
        names = [bar_label(r) for r in rows]
        values = [r["output_tokens_per_s"] for r in rows]
        colors = ["tab:blue" if r["kind"] == "milestone" else "tab:gray" for r in rows]
        bars = ax.bar(names, values, color=colors)
        ax.bar_label(bars, labels=[f"{v:.1f}" for v in values], padding=2, fontsize=9)
        ax.set_title(titles.get(workload) or f"decode: batch {rows[0]['batch_size']}, {config['decode_tokens']} "
                     "tokens each")
        ax.set_ylabel("output tokens/s (higher is better)")
        ax.set_ylim(0, max(values) * 1.18)
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", rotation_mode="anchor")  # long names
    threads = machine["torch_threads"]
    fig.suptitle(f"{config['model']}, {config['dtype']} on {machine['device']} ({machine['cpu_count']} CPUs, "
                 f"{threads} torch thread{'s' * (threads != 1)}, torch {machine['torch']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def bar_label(row: dict) -> str:
    """The row's name; m1's partial mixed row says how many requests it served."""
    partial = row.get("note", "") and row["engine"] == "m1" and row["workload"] == "mixed"
    return row["engine"] + (f"\n(first {row['num_requests']})" if partial else "")
