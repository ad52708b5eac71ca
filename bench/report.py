"""The markdown table and the PNG plots of a `flashbatch bench run` result."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.paired import aims_table

# How long each request runs: by default every engine ignores EOS (`--stop-at-eos`: not).
REQUEST_LENGTH = {
    False: "every request `max_tokens` long (EOS ignored)",
    True: "every request up to `max_tokens` long: every engine ends it at EOS (`--stop-at-eos`)",
}
DEFINITIONS = (
    "Each cell serves its requests closed-loop at the concurrency, {request_length}. tok/s: "
    "output tokens / the run's wall time, median of the interleaved rounds. vs best mlx-lm: "
    "against the fastest mlx-lm engine of the cell "
    "(single-stream engines, measured at concurrency 1, serve concurrent clients one after "
    "another at the same rate, so they count at every concurrency). req tok/s: a request's "
    "tokens / its latency (median). TTFT and ITL percentiles pool all rounds' requests; ITL "
    "is per token (a chunk's gap split over its tokens). tau: tokens committed per verify "
    "step. depth: chosen draft depth per request-step (flashbatch: the "
    "`flashbatch_spec_decode_draft_depth` histogram; mlx-lm spec: its fixed k). peak: "
    "mx.get_peak_memory() during the run, process-wide (includes every loaded engine's "
    "weights); +: above the memory active when the run began."
)


def _fmt(value: Any, spec: str = ".1f", none: str = "-") -> str:
    return none if value is None else format(value, spec)


def _triple(row: dict, prefix: str) -> str:
    values = [row.get(f"{prefix}_p{q}") for q in (50, 90, 99)]
    return " / ".join(_fmt(v) for v in values)


def _depths(row: dict) -> str:
    counts = row.get("depth_counts")
    if not counts:
        return "-"
    total = sum(counts.values())
    parts = [
        f"{d}:{100 * c / total:.0f}%" for d, c in sorted(counts.items(), key=lambda x: int(x[0]))
    ]
    mean = row.get("mean_depth")
    head = f"{mean:.1f}" if mean is not None else "?"
    return f"{head} ({' '.join(parts[:8])}{' ...' if len(parts) > 8 else ''})"


def _memory(row: dict) -> str:
    peak, above = row.get("peak_memory_bytes"), row.get("peak_above_start_bytes")
    if peak is None:
        return "-"
    text = f"{peak / 2**20:.0f}"
    return text + (f" (+{above / 2**20:.0f})" if above is not None else "")


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _status(row: dict) -> str:
    if row["status"] == "ok":
        return "ok"
    return "**FAILED**: " + _cell(row.get("error") or "unknown error")


def _cells(results: dict) -> list[tuple[str, float]]:
    seen: list[tuple[str, float]] = []
    for row in results["rows"]:
        key = (row["workload"], row["temperature"])
        if key not in seen:
            seen.append(key)
    return seen


def markdown_report(results: dict) -> str:
    meta = results.get("meta", {})
    cfg = meta.get("config", {})
    env = meta.get("environment", {})
    lines = [
        "# flashbatch bench run",
        "",
        f"{meta.get('started', '?')} to {meta.get('finished', '?')}. Target `{cfg.get('target')}`, "
        f"DFlash drafter `{cfg.get('drafter')}`, AR draft `{cfg.get('ar_draft')}`. "
        f"dtype {env.get('dtype', '?')}, BLAS {env.get('blas', '?')}, device "
        f"{env.get('device', '?')}, mlx {env.get('mlx', '?')}, mlx-lm {env.get('mlx_lm', '?')}. "
        f"{cfg.get('max_tokens')} tokens per request, {cfg.get('rounds')} round(s)"
        f"{', quick mode' if cfg.get('quick') else ''}.",
        "",
        DEFINITIONS.format(request_length=REQUEST_LENGTH[bool(cfg.get("stop_at_eos"))]),
        "",
        "## Engines",
        "",
        "| engine | what | status |",
        "|---|---|---|",
    ]
    for eng in results.get("engines", []):
        status = "ok" if eng["status"] == "ok" else "**FAILED**: " + _cell(eng.get("error"))
        lines.append(f"| {eng['name']} | {_cell(eng.get('description', ''))} | {status} |")
    lines += ["", *summary_table(results)]
    aims = aims_table(results)
    if aims:
        lines += ["", *aims]
    for workload, temperature in _cells(results):
        lines += [
            "",
            f"## {workload}, temperature {temperature:g}",
            "",
            "| c | engine | tok/s | vs best mlx-lm | req tok/s | TTFT p50/p90/p99 ms "
            "| ITL p50/p90/p99 ms | tau | depth: mean (distribution) | peak MiB | status |",
            "|---:|---|---:|---|---:|---|---|---:|---|---|---|",
        ]
        for row in results["rows"]:
            if (row["workload"], row["temperature"]) != (workload, temperature):
                continue
            ratio = row.get("ratio")
            vs = "-" if ratio is None else f"{ratio:.2f}x ({row.get('baseline')})"
            lines.append(
                f"| {row['concurrency']} | {row['engine']} | {_fmt(row.get('tok_s'))} | {vs} "
                f"| {_fmt(row.get('req_tok_s_p50'))} | {_triple(row, 'ttft_ms')} "
                f"| {_triple(row, 'itl_ms')} | {_fmt(row.get('tau'), '.2f')} | {_depths(row)} "
                f"| {_memory(row)} | {_status(row)} |"
            )
    plots = meta.get("plots") or []
    if plots:
        lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in plots]
    elif meta.get("plots_note"):
        lines += ["", f"Plots: {meta['plots_note']}"]
    return "\n".join(lines)


def summary_table(results: dict) -> list[str]:
    """One line per workload, temperature and concurrency: the best mlx-lm baseline and every
    flashbatch engine's ratio to it (the table the README quotes)."""
    rows = results["rows"]
    ours = list(dict.fromkeys(r["engine"] for r in rows if r["family"] == "flashbatch"))
    if not ours:
        return []
    lines = [
        "## Summary: flashbatch / best mlx-lm baseline",
        "",
        "| workload | T | c | best mlx-lm | tok/s | " + " | ".join(ours) + " | tau (adaptive) |",
        "|---|---:|---:|---|---:|" + "---:|" * len(ours) + "---:|",
    ]
    keys = list(dict.fromkeys((r["workload"], r["temperature"], r["concurrency"]) for r in rows))
    for workload, temperature, concurrency in keys:
        cell = {r["engine"]: r for r in rows
                if (r["workload"], r["temperature"], r["concurrency"])
                == (workload, temperature, concurrency)}  # fmt: skip
        mine = [cell.get(name) for name in ours]
        first = next((r for r in mine if r and r.get("baseline")), None)
        if first is None:
            continue
        ratios = [
            "-" if r is None or r.get("ratio") is None else f"{r['ratio']:.2f}x" for r in mine
        ]
        adaptive = cell.get("flashbatch adaptive") or {}
        lines.append(
            f"| {workload} | {temperature:g} | {concurrency} | {first['baseline']} | "
            f"{_fmt(first.get('baseline_tok_s'))} | "
            + " | ".join(ratios)
            + f" | {_fmt(adaptive.get('tau'), '.2f')} |"
        )
    return lines


def _slug(workload: str, temperature: float) -> str:
    return f"{workload}_t{temperature:g}"


def write_plots(results: dict, out_dir: Path) -> tuple[list[Path], str | None]:
    """Throughput vs concurrency and latency percentiles vs concurrency, one pair of PNGs per
    workload and temperature. Returns the files and, when plotting is impossible, why."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "not drawn: matplotlib is not installed (pip install 'flashbatch[bench]')"
    plot_dir = out_dir / "plots"
    plot_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for workload, temperature in _cells(results):
        rows = [r for r in results["rows"]
                if (r["workload"], r["temperature"]) == (workload, temperature)]  # fmt: skip
        engines = list(dict.fromkeys(r["engine"] for r in rows))
        concurrencies = sorted({r["concurrency"] for r in rows})
        colors = {name: plt.cm.tab10(i % 10) for i, name in enumerate(engines)}
        title = f"{workload}, temperature {temperature:g}"

        fig, ax = plt.subplots(figsize=(8, 5))
        for name in engines:
            mine = sorted((r for r in rows if r["engine"] == name), key=lambda r: r["concurrency"])
            ok = [r for r in mine if r["status"] == "ok" and r.get("tok_s") is not None]
            if not ok:
                ax.plot([], [], color=colors[name], label=f"{name} (failed)")
                continue
            if mine[0]["single_stream"]:
                ax.plot(concurrencies, [ok[0]["tok_s"]] * len(concurrencies), "--",
                        color=colors[name], label=f"{name} (serial)")  # fmt: skip
            else:
                ax.plot([r["concurrency"] for r in ok], [r["tok_s"] for r in ok], "o-",
                        color=colors[name], label=name)  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel("aggregate output tokens/s")
        ax.set_title(f"Throughput: {title}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        path = plot_dir / f"throughput_{_slug(workload, temperature)}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

        fig, axes = plt.subplots(1, 2, figsize=(12, 5))
        for ax, prefix, label in ((axes[0], "ttft_ms", "TTFT (ms)"),
                                  (axes[1], "itl_ms", "inter-token latency (ms)")):  # fmt: skip
            for name in engines:
                ok = sorted((r for r in rows if r["engine"] == name and r["status"] == "ok"),
                            key=lambda r: r["concurrency"])  # fmt: skip
                for q, style in ((50, "o-"), (90, "s--"), (99, "^:")):
                    points = [(r["concurrency"], r.get(f"{prefix}_p{q}")) for r in ok]
                    points = [(c, v) for c, v in points if v is not None]
                    if points:
                        ax.plot(*zip(*points), style, color=colors[name])
            ax.set_xscale("log", base=2)
            ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
            ax.set_xlabel("concurrency")
            ax.set_ylabel(label)
            ax.grid(True, alpha=0.3)
        axes[0].set_title(f"TTFT: {title}")
        axes[1].set_title(f"ITL (per token): {title}")
        from matplotlib.lines import Line2D

        handles = [Line2D([], [], color=colors[name], label=name) for name in engines]
        handles += [Line2D([], [], color="black", linestyle=ls, marker=m, label=f"p{q}")
                    for q, ls, m in ((50, "-", "o"), (90, "--", "s"), (99, ":", "^"))]  # fmt: skip
        fig.legend(handles=handles, fontsize=8, loc="center right")
        fig.tight_layout(rect=(0, 0, 0.82, 1))
        path = plot_dir / f"latency_{_slug(workload, temperature)}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written, None


def main(args: Any) -> int:
    """`flashbatch bench report DIR`: rewrite DIR/results.md from DIR/results.json."""
    import json
    import sys

    folder = Path(args.results_dir)
    source = folder / "results.json"
    if not source.is_file():
        print(f"no results.json in {folder}", file=sys.stderr)
        return 2
    report = markdown_report(json.loads(source.read_text()))
    (folder / "results.md").write_text(report + "\n")
    print(report)
    return 0
