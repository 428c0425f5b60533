"""Output of `hicache-hitrate`: the rich table, the JSON document and the plot.

The JSON document (`--json`) is the single source: the table and the plot are drawn from it.
Its keys are documented in docs/hitrate.md and are stable within `schema` version 1.
"""

from __future__ import annotations

import json
from typing import IO, Any

SCHEMA = "hicache-hitrate/1"


def _fmt_tokens(n: float | None) -> str:
    if n is None:
        return "unbounded"
    return f"{int(n):,}"


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, k in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= k:
            return f"{n / k:.2f} {unit}"
    return f"{int(n)} B"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def write_json(doc: dict[str, Any], out: IO[str]) -> None:
    json.dump(doc, out, indent=2, sort_keys=False)
    out.write("\n")


def print_table(doc: dict[str, Any], console: Any | None = None) -> None:
    """Readable summary of the document with rich."""
    from rich.console import Console
    from rich.table import Table

    con = console or Console()
    if doc["result"] is None:  # --sample: the sampled curve alone
        _print_sampled(doc, con)
        return
    tr, cfg, res = doc["trace"], doc["config"], doc["result"]
    title = (
        f"{tr['path']}  ({tr['format']}, {tr['requests']:,} requests, "
        f"page {cfg['page_size']} tokens)"
    )
    t = Table(title=title, show_header=True, header_style="bold")
    t.add_column("")
    t.add_column("tokens", justify="right")
    t.add_column("of input", justify="right")
    t.add_column("requests", justify="right")
    n_in = res["input_tokens"] or 1
    t.add_row("input", _fmt_tokens(res["input_tokens"]), "", f"{res['requests']:,}")
    for tier in ("device", "host", "storage"):
        t.add_row(
            f"  hit on {tier}",
            _fmt_tokens(res[f"{tier}_hit_tokens"]),
            _pct(res[f"{tier}_hit_tokens"] / n_in),
            "",
        )
    t.add_row(
        "[bold]hit (all tiers)",
        f"[bold]{_fmt_tokens(res['hit_tokens'])}",
        f"[bold]{_pct(res['hit_rate'])}",
        f"{res['hit_requests']:,} ({_pct(res['request_hit_rate'])})",
    )
    ub = doc["unbounded"]
    t.add_row(
        "unbounded capacity",
        _fmt_tokens(ub["hit_tokens"]),
        _pct(ub["hit_rate"]),
        f"{ub['hit_requests']:,} ({_pct(ub['request_hit_rate'])})",
    )
    opt = doc.get("opt")
    if opt:
        t.add_row(
            "Belady OPT (unbounded)"
            if opt["capacity_pages"] is None
            else f"Belady OPT ({opt['capacity_pages']:,} pages)",
            _fmt_tokens(opt["hit_tokens"]),
            _pct(opt["hit_rate"]),
            f"{opt['hit_requests']:,} ({_pct(opt['request_hit_rate'])})",
        )
    con.print(t)

    c = Table(title="configuration", show_header=True, header_style="bold")
    c.add_column("tier")
    c.add_column("pages", justify="right")
    c.add_column("tokens", justify="right")
    c.add_column("bytes", justify="right")
    for tier in ("device", "host", "storage"):
        pages = cfg[f"{tier}_pages"]
        c.add_row(
            tier,
            _fmt_tokens(pages),
            _fmt_tokens(None if pages is None else pages * cfg["page_size"]),
            _fmt_bytes(cfg.get(f"{tier}_bytes")),
        )
    con.print(c)
    con.print(
        f"eviction [bold]{cfg['eviction_policy']}[/] {cfg['eviction_config'] or ''}  "
        f"write [bold]{cfg['write_policy']}[/]  prefetch [bold]{cfg['prefetch_policy']}[/]  "
        f"kv bytes/token {cfg['kv_bytes_per_token'] or '-'}"
    )

    sv = doc["savings"]
    line = f"prefill tokens saved: [bold]{sv['prefill_tokens_saved']:,}[/]"
    if sv["ttft_saved_seconds"] is not None:
        line += (
            f"   est. prefill time saved {sv['prefill_seconds_saved']:.1f} s, transfers "
            f"{sv['transfer_seconds']:.1f} s, TTFT saved {sv['ttft_saved_seconds']:.1f} s in all "
            f"({1000 * sv['ttft_saved_per_request_seconds']:.1f} ms a request)"
        )
    con.print(line)

    sh = doc["sharing"]
    con.print(
        f"prefix sharing: {_pct(sh['shared_prefix_ratio'])} of input tokens are a prefix shared "
        f"with another request; {sh['requests_with_shared_prefix']:,} requests share one; "
        f"{sh['unique_pages']:,} distinct pages in {sh['lookup_page_refs']:,} looked up; "
        f"per-request shared fraction p50 {_pct(sh['shared_fraction_p50'])}, "
        f"p90 {_pct(sh['shared_fraction_p90'])}"
    )

    rd = doc["reuse_distance"]
    h = Table(title="reuse distance (LRU stack distance of re-used pages)", header_style="bold")
    h.add_column("pages", justify="right")
    h.add_column("tokens", justify="right")
    h.add_column("hits", justify="right")
    ps = cfg["page_size"]
    for b in rd["buckets"]:
        h.add_row(
            f"{b['min_pages']:,}-{b['max_pages']:,}",
            f"{b['min_pages'] * ps:,}-{b['max_pages'] * ps:,}",
            f"{b['pages']:,}",
        )
    h.add_row("never seen before", "", f"{rd['cold_pages']:,}")
    con.print(h)

    mrc = doc.get("mrc")
    if mrc:
        m = Table(title=f"miss-ratio curve ({mrc['model']}, one pass)", header_style="bold")
        m.add_column("capacity (pages)", justify="right")
        m.add_column("tokens", justify="right")
        m.add_column("bytes", justify="right")
        m.add_column("hit rate", justify="right")
        m.add_column("miss ratio", justify="right")
        sample = mrc.get("sample")
        if sample:
            m.add_column(f"sampled ({sample['rate']:g})", justify="right")
        for p in mrc["points"]:
            cells = [
                f"{p['capacity_pages']:,}",
                f"{p['capacity_tokens']:,}",
                _fmt_bytes(p["capacity_bytes"]),
                _pct(p["hit_rate"]),
                _pct(p["miss_ratio"]),
            ]
            if sample:
                cells.append(_pct(p["sampled_hit_rate"]))
            m.add_row(*cells)
        con.print(m)
        if sample:
            con.print(
                f"sampled curve: {sample['sampled_page_refs']:,} of {sample['page_refs']:,} page "
                f"references, {sample['seconds']:.2f} s; error against the exact curve at these "
                f"points: max {sample['max_abs_error']:.4f}, mean {sample['mean_abs_error']:.4f} "
                "(absolute hit rate)"
            )
        tg = mrc.get("target")
        if tg:
            if tg["capacity_pages"] is None:
                con.print(
                    f"target hit rate {_pct(tg['hit_rate'])}: [red]unreachable[/] "
                    f"(the unbounded bound is {_pct(doc['unbounded']['hit_rate'])})"
                )
            else:
                con.print(
                    f"target hit rate {_pct(tg['hit_rate'])} needs "
                    f"[bold]{tg['capacity_pages']:,} pages[/] = {tg['capacity_tokens']:,} tokens"
                    f" = {_fmt_bytes(tg['capacity_bytes'])} of LRU cache"
                )
            rel = tg.get("relative")
            if rel and rel["capacity_pages"] is not None:
                con.print(
                    f"{_pct(tg['hit_rate'])} of the unbounded bound "
                    f"({_pct(rel['hit_rate'])}) needs {rel['capacity_pages']:,} pages = "
                    f"{_fmt_bytes(rel['capacity_bytes'])}"
                )
    if doc.get("sweep"):
        print_sweep(doc["sweep"], con)
    eng = doc.get("engine")
    if eng:
        con.print(
            f"engine log: the engine reported {eng['cached_tokens']:,} cached tokens, the replay "
            f"{eng['simulated_hit_tokens']:,}; {eng['mismatched_requests']:,} requests differ"
        )
        measured, predicted = eng.get("outcomes"), eng.get("predicted_outcomes")
        if measured or predicted:
            t = Table(title="prompt tokens by outcome (engine log vs replay)")
            for col in ("outcome", "engine", "replay"):
                t.add_column(col, justify="left" if col == "outcome" else "right")
            for k in sorted(set(measured or {}) | set(predicted or {})):
                t.add_row(k, *(f"{d.get(k, 0):,}" if d is not None else "-"
                               for d in (measured, predicted)))
            con.print(t)
    if tr["bad_lines"]:
        con.print(
            f"[yellow]skipped {tr['bad_lines']:,} bad lines[/] (first: "
            f"{', '.join(str(n) for n in tr['bad_line_numbers'][:10])})"
        )
    for note in doc.get("notes", []):
        con.print(f"[dim]note: {note}[/]")
    tm = doc["timing"]
    con.print(
        f"[dim]read {tm['read_s']:.2f} s, replay {tm['simulate_s']:.2f} s "
        f"({tm['requests_per_s']:,.0f} requests/s), analyses {tm['analysis_s']:.2f} s[/]"
    )


def _print_sampled(doc: dict[str, Any], con: Any) -> None:
    from rich.table import Table

    tr, cfg, mrc = doc["trace"], doc["config"], doc["mrc"]
    smp = mrc["sample"]
    chk = smp["check"]
    m = Table(title=f"{tr['path']}  ({tr['format']}, {tr['requests']:,} requests, page "
              f"{cfg['page_size']} tokens): LRU miss-ratio curve sampled at {smp['rate']:g}",
              header_style="bold")
    for col in ("capacity (pages)", "tokens", "bytes", "hit rate (sampled)", "miss ratio"):
        m.add_column(col, justify="right")
    if chk:
        m.add_column("slice: exact", justify="right")
        m.add_column("slice: sampled", justify="right")
    for p in mrc["points"]:
        cells = [f"{p['capacity_pages']:,}", f"{p['capacity_tokens']:,}",
                 _fmt_bytes(p["capacity_bytes"]), _pct(p["hit_rate"]), _pct(p["miss_ratio"])]
        if chk:
            cells += [_pct(p["check_exact_hit_rate"]), _pct(p["check_sampled_hit_rate"])]
        m.add_row(*cells)
    con.print(m)
    hot = "" if smp["hot_blocks"] is None else f", {smp['hot_blocks']:,} hot blocks kept whole"
    con.print(f"sampled {smp['sampled_page_refs']:,} of {smp['page_refs']:,} page references"
              f"{hot}")
    if chk:
        where = ("the whole trace" if chk["whole_trace"] else
                 f"the first {chk['requests']:,} of {chk['of_requests']:,} requests")
        con.print(
            f"error measured on {where} (exact curve against the sampled one, same capacities): "
            f"max [bold]{chk['max_abs_error']:.4f}[/], mean {chk['mean_abs_error']:.4f} "
            "(absolute hit rate)"
        )
    else:
        con.print("[yellow]no validation slice (--sample-check 0): the error is not measured[/]")
    tg = mrc.get("target")
    if tg:
        if tg["capacity_pages"] is None:
            con.print(f"target hit rate {_pct(tg['hit_rate'])}: [red]unreachable[/]")
        else:
            con.print(f"target hit rate {_pct(tg['hit_rate'])} needs about "
                      f"[bold]{tg['capacity_pages']:,} pages[/] = "
                      f"{_fmt_bytes(tg['capacity_bytes'])} of LRU cache (sampled)")
    con.print("[dim]not computed with --sample: the replay of a configuration, request hit "
              "rates, the unbounded bound, Belady's optimum, reuse distances and sharing[/]")
    if tr["bad_lines"]:
        con.print(f"[yellow]skipped {tr['bad_lines']:,} bad lines[/]")
    for note in doc.get("notes", []):
        con.print(f"[dim]note: {note}[/]")
    tm = doc["timing"]
    con.print(f"[dim]read and sample {tm['read_s']:.2f} s, curves {tm['analysis_s']:.2f} s[/]")


def plot(doc: dict[str, Any], path: str) -> None:
    """MRC, tier breakdown and reuse distances in one PNG (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg, res, ub = doc["config"], doc["result"], doc["unbounded"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2), gridspec_kw={"width_ratios": [2.2, 1.3, 1.6]})
    fig.suptitle(
        f"{doc['trace']['path'].rsplit('/', 1)[-1]}: {doc['trace']['requests']:,} requests, "
        f"page {cfg['page_size']} tokens, {cfg['eviction_policy']} / {cfg['write_policy']}",
        fontsize=12,
    )

    ax = axes[0]
    mrc = doc.get("mrc")
    use_bytes = bool(cfg.get("kv_bytes_per_token"))
    unit = "GiB" if use_bytes else "tokens"

    def cap_x(pages: float) -> float:
        tokens = pages * cfg["page_size"]
        return tokens * cfg["kv_bytes_per_token"] / 2**30 if use_bytes else tokens

    if mrc:
        xs = [cap_x(p["capacity_pages"]) for p in mrc["points"]]
        ax.plot(xs, [100 * p["hit_rate"] for p in mrc["points"]], "o-", ms=3, label="LRU hit rate")
        ax.plot(
            xs,
            [100 * p["miss_ratio"] for p in mrc["points"]],
            "-",
            color="tab:red",
            alpha=0.5,
            label="LRU miss ratio",
        )
        tg = mrc.get("target")
        if tg and tg["capacity_pages"]:
            ax.axvline(
                cap_x(tg["capacity_pages"]),
                color="tab:green",
                ls=":",
                label=f"target {100 * tg['hit_rate']:.0f}%",
            )
        ax.set_xscale("log")
    ax.axhline(
        100 * ub["hit_rate"], color="gray", ls="--", label=f"unbounded {100 * ub['hit_rate']:.1f}%"
    )

    def mark(pages: float, pct: float, style: str, color: str, ms: int, label: str) -> None:
        """One point: a hit rate of `pct` % at a capacity of `pages` pages."""
        ax.plot([cap_x(pages)], [pct], style, color=color, ms=ms, label=label)

    if cfg["device_pages"] is not None:
        mark(cfg["device_pages"], 100 * res["device_hit_tokens"] / max(1, res["input_tokens"]),
             "s", "tab:orange", 8, "simulated (device hits)")
    opt = doc.get("opt")
    if opt and opt["capacity_pages"]:
        mark(opt["capacity_pages"], 100 * opt["hit_rate"], "*", "tab:purple", 12,
             "Belady OPT (all tiers)")
    ax.set_xlabel(f"cache capacity ({unit}, log)")
    ax.set_ylabel("% of input tokens")
    ax.set_ylim(0, 100)
    ax.set_title("miss-ratio curve (LRU, one pass)" if mrc else "hit rate")
    ax.grid(True, which="both", ls=":", alpha=0.5)
    ax.legend(fontsize=8, loc="center left")

    ax = axes[1]
    n_in = max(1, res["input_tokens"])
    bars = [("simulated", res), ("unbounded", None), ("OPT", opt)]
    labels = []
    bottoms_dev, bottoms_host, bottoms_sto, misses = [], [], [], []
    for name, r in bars:
        if name == "OPT" and not r:
            continue
        labels.append(name)
        if name == "simulated":
            d, h, s = (r["device_hit_tokens"], r["host_hit_tokens"], r["storage_hit_tokens"])
        else:
            d, h, s = ((r or ub)["hit_tokens"], 0, 0)
        bottoms_dev.append(100 * d / n_in)
        bottoms_host.append(100 * h / n_in)
        bottoms_sto.append(100 * s / n_in)
        misses.append(100 - 100 * (d + h + s) / n_in)
    x = range(len(labels))
    ax.bar(x, bottoms_dev, color="tab:blue", label="device / any tier")
    ax.bar(x, bottoms_host, bottom=bottoms_dev, color="tab:orange", label="host")
    b2 = [a + b for a, b in zip(bottoms_dev, bottoms_host)]
    ax.bar(x, bottoms_sto, bottom=b2, color="tab:green", label="storage")
    b3 = [a + b for a, b in zip(b2, bottoms_sto)]
    ax.bar(x, misses, bottom=b3, color="lightgray", label="miss")
    for i, top in enumerate(b3):
        ax.text(i, top + 1, f"{top:.1f}%", ha="center", fontsize=9)
    ax.set_xticks(list(x), labels)
    ax.set_ylim(0, 128)
    ax.set_yticks(range(0, 101, 20))
    ax.set_ylabel("% of input tokens")
    ax.set_title("hits by tier")
    ax.legend(fontsize=8, loc="upper center", ncol=2)

    ax = axes[2]
    rd = doc["reuse_distance"]["buckets"]
    if rd:
        ax.bar(range(len(rd)), [b["pages"] for b in rd], color="tab:blue")
        ax.set_xticks(range(len(rd)), [f"{b['min_pages']:,}" for b in rd], rotation=60, fontsize=7)
    ax.set_xlabel("LRU stack distance (pages, lower bound of bucket)")
    ax.set_ylabel("re-used pages")
    ax.set_title(f"reuse distances ({doc['reuse_distance']['cold_pages']:,} cold pages)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _size(pages: int | None, nbytes: float | None) -> str:
    if pages is None:
        return "unbounded"
    return _fmt_bytes(nbytes) if nbytes is not None else f"{pages:,}p"


def print_sweep(rows: list[dict[str, Any]], con: Any) -> None:
    """The sweep as one table: a row per budget, hit rate (and TTFT saved a request when a
    prefill rate was given) per eviction policy side by side."""
    from rich.table import Table

    policies = list(dict.fromkeys(r["eviction_policy"] for r in rows))
    with_ttft = rows[0]["ttft_saved_seconds"] is not None
    t = Table(title="sweep (exact replays through HiRadixCache)", header_style="bold")
    for col in ("device", "host", "storage"):
        t.add_column(col, justify="right")
    for p in policies:
        t.add_column(f"{p} hit rate", justify="right")
        if with_ttft:
            t.add_column(f"{p} TTFT saved/req", justify="right")
    by_budget: dict[tuple[Any, ...], dict[str, dict[str, Any]]] = {}
    for r in rows:
        key = (r["device_pages"], r["host_pages"], r["storage_pages"])
        by_budget.setdefault(key, {})[r["eviction_policy"]] = r
    for per in by_budget.values():
        first = next(iter(per.values()))
        cells = [_size(first[f"{tier}_pages"], first[f"{tier}_bytes"])
                 for tier in ("device", "host", "storage")]
        for p in policies:
            r = per[p]
            cells.append(f"{100 * r['hit_rate']:.2f}%")
            if with_ttft:
                cells.append(f"{1000 * r['ttft_saved_per_request_seconds']:.1f} ms")
        t.add_row(*cells)
    con.print(t)
