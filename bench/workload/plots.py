"""The workload report's plots (matplotlib, Agg): TTFT CDF, throughput against load, work,
fidelity."""

from __future__ import annotations

from pathlib import Path

from bench.extras import require
from bench.workload.summary import CellSummary


def draw_all(summaries: list[CellSummary], directory: Path) -> list[str]:
    """Draw every plot into `directory`; returns the file names of those drawn. Raises
    `MissingBenchExtra` without matplotlib (the `bench` extra)."""
    require("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    drawn = [
        _ttft_cdf(summaries, directory / "ttft_cdf.png"),
        _throughput(summaries, directory / "throughput.png"),
        _work(summaries, directory / "work.png"),
        _fidelity(summaries, directory / "fidelity_vs_speedup.png"),
    ]
    return [p.name for p in drawn if p is not None]


def _figure():
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=90)
    return plt, fig, ax


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _ttft_cdf(summaries: list[CellSummary], path: Path) -> Path | None:
    if not any(s.ttfts for s in summaries):
        return None
    plt, fig, ax = _figure()
    for s in summaries:
        ordered = sorted(s.ttfts)
        ax.step(
            [v * 1000 for v in ordered],
            [(i + 1) / len(ordered) for i in range(len(ordered))],
            where="post",
            label=f"{s.mode} {s.load}",
        )
    ax.set_xlabel("TTFT (ms, client: queue wait included)")
    ax.set_ylabel("share of requests")
    ax.set_title("TTFT CDF per mode and load")
    ax.legend(fontsize=6)
    return _save(plt, fig, path)


def _throughput(summaries: list[CellSummary], path: Path) -> Path | None:
    closed = [s for s in summaries if s.clients is not None]
    if not closed:
        return None
    plt, fig, ax = _figure()
    for mode in dict.fromkeys(s.mode for s in closed):
        points = sorted((s.clients, s.throughput) for s in closed if s.mode == mode)
        ax.plot(*zip(*points), marker="o", label=mode)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("answered requests / s")
    ax.set_title("Throughput against concurrency")
    ax.legend(fontsize=6)
    return _save(plt, fig, path)


def _work(summaries: list[CellSummary], path: Path) -> Path:
    plt, fig, ax = _figure()
    labels = [f"{s.mode}\n{s.load}" for s in summaries]
    ax.bar(range(len(summaries)), [s.gflops_per_request for s in summaries])
    ax.set_xticks(range(len(summaries)), labels, fontsize=5, rotation=60, ha="right")
    ax.set_ylabel("prefill GFLOPs per request (background included)")
    ax.set_title("Model work per request")
    return _save(plt, fig, path)


def _fidelity(summaries: list[CellSummary], path: Path) -> Path | None:
    full = {s.load: s for s in summaries if s.mode == "full"}
    points = [
        (full[s.load].ttft_p50 / s.ttft_p50, s.fidelity.rouge_l, f"{s.mode} {s.load}")
        for s in summaries
        if s.fidelity and s.load in full and s.ttft_p50 > 0
    ]
    if not points:
        return None
    plt, fig, ax = _figure()
    for x, y, label in points:
        ax.scatter([x], [y])
        ax.annotate(label, (x, y), fontsize=5)
    ax.set_xlabel("TTFT p50 speed-up over full at the same load")
    ax.set_ylabel("ROUGE-L of the answer against full's")
    ax.set_title("Fidelity against speed-up")
    return _save(plt, fig, path)
