"""A benchmark's report: a terminal table, bench.json, and bench.html with matplotlib plots
embedded as PNG data URIs."""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

import numpy as np

from fish_sm.aws import AWSError
from fish_sm.clients.bench import MIN_SAMPLES


def _fmt(v, spec=".2f") -> str:
    return "-" if v is None else format(v, spec)


TABLE_COLUMNS = ["conc", "ok/n", "p50 s", "p95 s", "p99 s", "req/s", "audio s/s", "RTF p50", "rejected", "errors"]
FIRST_AUDIO_COLUMNS = ["1st p50 ms", "1st p95 ms"]  # streamed runs: after the latency percentiles


COST_COLUMN = "$/audio-h"  # priced runs: before rejected


def _priced(report: dict) -> bool:
    return (report.get("cost") or {}).get("usd_per_hour") is not None


def table_columns(report: dict) -> list[str]:
    columns = TABLE_COLUMNS if not report.get("stream") else TABLE_COLUMNS[:5] + FIRST_AUDIO_COLUMNS + TABLE_COLUMNS[5:]
    if _priced(report):
        columns = columns[:-2] + [COST_COLUMN] + columns[-2:]
    return columns


THIN = "*"  # marks a percentile that rests on too few samples (the level's "warnings" say how few)


def _thin(level: dict) -> set[str]:
    """The figures ("p95", "first audio p95", ...) of a level's too-few-samples warnings."""
    return {w.rsplit(" from ", 1)[0] for w in level.get("warnings", ())}


def table_rows(report: dict) -> list[list[str]]:
    rows = []
    for lv in report["levels"]:
        lat, thin = lv["latency_s"], _thin(lv)
        errors = ", ".join(f"{k}: {n}" for k, n in lv["errors"].items()) or "-"
        first = lv.get("first_audio_ms") or {}

        def cell(value, figure, spec=".2f"):
            text = _fmt(value, spec)
            return text + THIN if figure in thin and value is not None else text

        row = [str(lv["concurrency"]), f"{lv['ok']}/{lv['requests']}", _fmt(lat["p50"]), cell(lat["p95"], "p95"),
               cell(lat["p99"], "p99"), _fmt(lv["rps"]), _fmt(lv["audio_seconds_per_wall_second"]),
               _fmt(lv["rtf"]["p50"], ".3f"), str(lv.get("rejected", 0)), errors]
        if report.get("stream"):
            row[5:5] = [_fmt(first.get("p50"), ".0f"), cell(first.get("p95"), "first audio p95", ".0f")]
        if _priced(report):
            row[-2:-2] = [_fmt(lv.get("usd_per_audio_hour"), ".4f")]
        rows.append(row)
    return rows


def level_verdict(level: dict, max_error_rate: float) -> str:
    failed = level["requests"] - level["ok"]
    return (f"concurrency {level['concurrency']}: {'pass' if level.get('passed', True) else 'FAIL'}: {failed} of "
            f"{level['requests']} request(s) brought no audio ({level.get('error_rate', 0.0):.0%}; "
            f"at most {max_error_rate * 100:g}% may)")


def verdict_lines(report: dict) -> list[str]:
    """A pass/fail line per level (failed requests against --max-error-rate), then what the
    table's marked percentiles rest on."""
    max_rate = report.get("settings", {}).get("max_error_rate", 0.0)
    lines = [level_verdict(lv, max_rate) for lv in report["levels"]]
    lines += cost_lines(report)
    thin = [f"concurrency {lv['concurrency']}: {', '.join(lv['warnings'])}" for lv in report["levels"]
            if lv.get("warnings")]
    if thin:
        needs = ", ".join(f"{q} needs {n}" for q, n in MIN_SAMPLES.items())
        lines.append(f"{THIN} too few samples for the percentile ({needs}): " + "; ".join(thin))
    return lines


def cost_lines(report: dict) -> list[str]:
    """The cost line (and the notes) of a bench run: $ per audio-hour at the cheapest passing level."""
    cost = report.get("cost") or {}
    lines = list(report.get("notes", []))
    if cost.get("usd_per_audio_hour") is not None:
        what = f"{cost['instances']} x {cost['instance_type']}" if cost.get("instance_type") else \
            f"{cost['instances']} instance(s)"
        lines.insert(0, f"cost: ${cost['usd_per_audio_hour']:.4f} per audio-hour at concurrency "
                        f"{cost['at_concurrency']} ({what} at ${cost['usd_per_hour']:.4g}/h each"
                        + (f", {cost['price_source']}" if cost.get("price_source") else "") + "); closed-loop load, "
                        "not under a latency SLO: `fish-sm capacity` gives that")
    return lines


def format_table(report: dict) -> str:
    """The summary as a fixed-width text table for the terminal."""
    columns = table_columns(report)
    rows = [columns] + table_rows(report)
    widths = [max(len(r[i]) for r in rows) for i in range(len(columns))]
    lines = ["  ".join(cell.rjust(w) if i < len(widths) - 1 else cell for i, (cell, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(report: dict, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return path


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _pyplot():
    """matplotlib's pyplot on the file-only backend; a one-line error when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        raise AWSError("the HTML report's plots need matplotlib: pip install 'fish-sm[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plots(report: dict) -> dict[str, str]:
    """title -> PNG data URI: latency per concurrency, throughput vs concurrency, latency vs audio length,
    and for streamed runs the time to first audio vs concurrency. None when no request brought
    audio (there is nothing to draw); a level without audio is labelled failed on each axis."""
    if not any(s["ok"] for s in report["samples"]):
        return {}
    plt = _pyplot()

    levels = report["levels"]
    conc = [lv["concurrency"] for lv in levels]
    by_level = {c: [s for s in report["samples"] if s["concurrency"] == c and s["ok"]] for c in conc}
    out = {}

    fig, ax = plt.subplots(figsize=(7, 4))
    data = [[s["latency_s"] for s in by_level[c]] or [np.nan] for c in conc]
    ax.boxplot(data, showfliers=False)
    rng = np.random.default_rng(0)
    for i, values in enumerate(data, 1):
        ax.scatter(i + rng.uniform(-0.15, 0.15, len(values)), values, s=8, alpha=0.5)
    labels = [str(c) if by_level[c] else f"{c}\n(failed)" for c in conc]
    ax.set_xticks(range(1, len(conc) + 1), labels)
    for i, c in enumerate(conc, 1):
        if not by_level[c]:
            ax.annotate("no audio", xy=(i, 0.5), xycoords=("data", "axes fraction"), ha="center", color="tab:red")
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("latency (s)")
    ax.set_title("Latency distribution per concurrency")
    out["Latency distribution per concurrency"] = _png(fig)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(conc, [lv["rps"] for lv in levels], "o-", label="requests / s")
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("requests per second")
    ax2 = ax.twinx()
    ax2.plot(conc, [lv["audio_seconds_per_wall_second"] for lv in levels], "s--", color="tab:orange",
             label="audio s / wall s")
    ax2.set_ylabel("audio seconds per wall second")
    if len(conc) > 1 and max(conc) / min(conc) >= 8:
        ax.set_xscale("log", base=2)
    ax.set_xticks(conc, labels)
    ax.set_ylim(bottom=0)
    ax2.set_ylim(bottom=0)
    ax.set_title("Throughput against concurrency")
    fig.legend(loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2, frameon=False)
    out["Throughput against concurrency"] = _png(fig)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for c in conc:
        pts = [(s["audio_seconds"], s["latency_s"]) for s in by_level[c] if s["audio_seconds"] is not None]
        if pts:
            ax.scatter(*zip(*pts), s=10, label=f"{c} clients")
    ax.set_xlabel("audio produced (s)")
    ax.set_ylabel("latency (s)")
    ax.set_title("Latency against audio length")
    if any(by_level.values()):
        ax.legend()
    out["Latency against audio length"] = _png(fig)
    plt.close(fig)

    if report.get("stream"):
        fig, ax = plt.subplots(figsize=(7, 4))
        for q, style in (("p95", "o-"), ("p50", "s--")):
            values = [lv["first_audio_ms"][q] for lv in levels]
            ax.plot(conc, [np.nan if v is None else v for v in values], style, label=f"first audio {q}")
        if len(conc) > 1 and max(conc) / min(conc) >= 8:
            ax.set_xscale("log", base=2)
        ax.set_xticks(conc, labels)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("time to first audio (ms)")
        ax.set_title("Time to first audio against concurrency")
        ax.legend()
        out["Time to first audio against concurrency"] = _png(fig)
        plt.close(fig)
    return out


# -- capacity runs (fish_sm.clients.capacity): offered streams or listeners against the SLO ------

CAPACITY_COLUMNS = ["streams", "arrivals/s", "ok/n", "1st p50 ms", "1st p99 ms", "underrun", "stalled", "audio s/s",
                    "rejected", "errors", "result"]
# A closed loop's levels are listeners, and its requests a second are what they asked, not offered.
CLOSED_LOOP_COLUMNS = ["listeners", "requests/s", *CAPACITY_COLUMNS[2:]]


def _closed(report: dict) -> bool:
    return report.get("population") == "closed loop"


def _unit(report: dict) -> str:
    return "listeners" if _closed(report) else "streams"


def _size(level: dict) -> int:
    return level["listeners"] if "listeners" in level else level["streams"]


def capacity_columns(report: dict) -> list[str]:
    return CLOSED_LOOP_COLUMNS if _closed(report) else CAPACITY_COLUMNS


def population_line(report: dict) -> str:
    """What loaded the levels: an open loop of offered streams or a closed loop of listeners."""
    settings = report.get("settings", {})
    if _closed(report):
        return ("closed loop: each listener asks again as soon as its answer has played "
                f"({settings.get('client', 'threads')} client; first requests spread over "
                f"{settings.get('spread_s', 1.0):.1f} s; {settings.get('duration_s', 0):g} s of asking a level)")
    return (f"open loop: {settings.get('arrivals', 'poisson')} arrivals at streams / mean audio seconds a second "
            f"({settings.get('duration_s', 0):g} s of arrivals a level)")


def capacity_rows(report: dict) -> list[list[str]]:
    rows = []
    for lv in report["levels"]:
        first, under, thin = lv["first_audio_ms"], lv["underrun"], _thin(lv)
        p99 = _fmt(first["p99"], ".0f") + (THIN if "first audio p99" in thin and first["p99"] is not None else "")
        errors = ", ".join(f"{k}: {n}" for k, n in lv["errors"].items()) or "-"
        rows.append([str(_size(lv)), _fmt(lv["arrivals_per_s"]), f"{lv['ok']}/{lv['requests']}",
                     _fmt(first["p50"], ".0f"), p99, _fmt(under["share"], ".3%"), f"{under['streams']}/{lv['streamed']}",
                     _fmt(lv["audio_seconds_per_wall_second"], ".1f"), str(lv["rejected"]), errors,
                     "pass" if lv["passed"] else "FAIL"])
    return rows


def format_capacity_table(report: dict) -> str:
    """The capacity curve as a fixed-width text table: one row per level, under a line saying
    what loaded them (open or closed loop)."""
    columns = capacity_columns(report)
    rows = [columns] + capacity_rows(report)
    widths = [max(len(r[i]) for r in rows) for i in range(len(columns))]
    lines = ["  ".join(cell.rjust(w) if i < len(widths) - 1 else cell for i, (cell, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join([population_line(report), *lines])


def capacity_summary(report: dict) -> str:
    """One line: the capacity under the SLO and what it means per GPU, per instance-hour and in dollars."""
    cap, settings = report["capacity"], report["settings"]
    slo = (f"p99 first audio <= {settings['slo_first_audio_ms']:g} ms, underrun <= {settings['slo_underrun']:.2%} "
           f"of playback")
    unit = _unit(report)
    if not cap.get(unit):
        return f"capacity: no level meets the SLO ({slo})"
    what = ("listeners (closed loop) keep real-time playback within the SLO" if unit == "listeners" else
            "concurrent real-time streams meet the SLO")
    line = (f"capacity: {cap[unit]} {what} ({slo}): "
            f"{cap[f'{unit}_per_gpu']:.1f} per GPU ({cap['gpus']} GPU(s) x {cap['instances']} instance(s)), "
            f"{cap['audio_hours_per_instance_hour']:.1f} audio-hours per instance-hour")
    if cap.get("usd_per_audio_hour") is not None:
        line += (f", ${cap['usd_per_audio_hour']:.4f} per audio-hour at ${cap['usd_per_hour']:.4g}/h"
                 + (f" ({cap['price_source']})" if cap.get("price_source") else ""))
    return line


def capacity_lines(report: dict) -> list[str]:
    """Why each failed level failed, the summary line, how lengths were held, notes, and the
    percentiles resting on too few samples."""
    unit = _unit(report)
    lines = [f"{_size(lv)} {unit}: FAIL: {'; '.join(lv['slo_failures'])}" for lv in report["levels"]
             if not lv["passed"]]
    lines.append(capacity_summary(report))
    lines.append(f"lengths: {report['lengths']}")
    lines += report.get("notes", [])
    warned = [f"{_size(lv)} {unit}: {', '.join(lv['warnings'])}" for lv in report["levels"] if lv["warnings"]]
    if warned:
        needs = ", ".join(f"{q} needs {n}" for q, n in MIN_SAMPLES.items())
        lines.append(f"{THIN} too few samples for the percentile ({needs}), or a client short of time: "
                     + "; ".join(warned))
    return lines


def capacity_plots(report: dict) -> dict[str, str]:
    """title -> PNG data URI: first audio p50/p99 and underrun share against offered streams or
    listeners (with the SLO's limits), and audio seconds per second; failed levels marked."""
    levels = report["levels"]
    if not any(lv["ok"] for lv in levels):
        return {}
    plt = _pyplot()

    settings = report["settings"]
    streams = [_size(lv) for lv in levels]
    failed = [_size(lv) for lv in levels if not lv["passed"]]
    against, xlabel = (("listeners", "listeners (closed loop)") if _closed(report)
                       else ("offered streams", "offered concurrent streams"))
    log_x = len(streams) > 1 and max(streams) / min(streams) >= 8

    def axes(ylabel: str, title: str):
        fig, ax = plt.subplots(figsize=(7, 4))
        if log_x:
            ax.set_xscale("log", base=2)
        ax.set_xticks(streams, [str(n) if n not in failed else f"{n}\n(failed)" for n in streams])
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        return fig, ax

    def values(get):
        return [np.nan if get(lv) is None else get(lv) for lv in levels]

    out = {}
    fig, ax = axes("time to first audio (ms)", f"First audio against {against}")
    ax.plot(streams, values(lambda lv: lv["first_audio_ms"]["p99"]), "o-", label="p99")
    ax.plot(streams, values(lambda lv: lv["first_audio_ms"]["p50"]), "s--", label="p50")
    ax.axhline(settings["slo_first_audio_ms"], color="tab:red", linestyle=":", label="SLO")
    ax.set_ylim(bottom=0)
    ax.legend()
    out[f"First audio against {against}"] = _png(fig)
    plt.close(fig)

    fig, ax = axes("underrun (% of playback time)", f"Underrun against {against}")
    ax.plot(streams, values(lambda lv: None if lv["underrun"]["share"] is None else 100 * lv["underrun"]["share"]),
            "o-", label="underrun")
    ax.axhline(100 * settings["slo_underrun"], color="tab:red", linestyle=":", label="SLO")
    ax.set_ylim(bottom=0)
    ax.legend()
    out[f"Underrun against {against}"] = _png(fig)
    plt.close(fig)

    fig, ax = axes("audio seconds per wall second", f"Audio produced against {against}")
    ax.plot(streams, [lv["audio_seconds_per_wall_second"] for lv in levels], "o-")
    ax.set_ylim(bottom=0)
    out[f"Audio produced against {against}"] = _png(fig)
    plt.close(fig)
    return out


def _capacity_html(report: dict) -> tuple[str, str, str]:
    """(verdict, the levels' section, plots and errors) of a capacity run's page."""
    esc = html.escape
    images = capacity_plots(report)
    head = "".join(f"<th>{esc(c)}</th>" for c in capacity_columns(report))
    body = "".join(f'<tr class="{"pass" if lv["passed"] else "fail"}">' + "".join(f"<td>{esc(c)}</td>" for c in row)
                   + "</tr>" for lv, row in zip(report["levels"], capacity_rows(report)))
    lines = "".join(f"<li>{esc(line)}</li>" for line in capacity_lines(report))
    closed = _closed(report)
    section = (f"<h2>Capacity curve ({'closed' if closed else 'open'} loop)</h2>"
               f"<p id=\"population\">{esc(population_line(report))}</p><ul>{lines}</ul>\n"
               f"<table><tr>{head}</tr>{body}</table>\n"
               f"<p>1st p50/p99 ms: time from a stream's {'asking' if closed else 'arrival'} to its first audio byte. "
               "underrun: time listeners waited after playback began, as a share of playback time; stalled: streams "
               "that waited at all."
               + (" requests/s: what the listeners asked over the level's duration." if closed else "") + "</p>")
    figs = "".join(f'<h2>{esc(t)}</h2>\n<img alt="{esc(t)}" src="{uri}">\n' for t, uri in images.items())
    if not images:
        figs = "<h2>Plots</h2>\n<p class=\"fail\">No request brought audio: nothing to plot.</p>\n"
    errors = "".join(f"<li>{_size(lv)} {_unit(report)}, {esc(kind)}: {esc(str(msg))}</li>"
                     for lv in report["levels"] for kind, msg in lv["error_examples"].items())
    figs += f"<h2>Errors and rejections</h2><ul>{errors or '<li>none</li>'}</ul>"
    return capacity_summary(report), section, figs


def _verdict(report: dict) -> str:
    failed = [lv for lv in report["levels"] if not lv.get("passed", True)]
    if not failed:
        return "PASS: every level within the error rate allowed"
    return "FAIL: " + ", ".join(f"concurrency {lv['concurrency']}" for lv in failed) + " over the error rate allowed"


def write_html(report: dict, path: Path) -> Path:
    """A self-contained page (nothing fetched from the network): what was measured on what, the
    verdict and a pass/fail line per level, the table, the plots as <img> data URIs, and the
    error examples. A run without any audio has no plots, and says so."""
    esc = html.escape
    settings = report.get("settings", {})
    if report.get("kind") == "capacity":
        return _write_page(report, path, *_capacity_html(report), accept="audio/wav")
    images = plots(report)
    head = "".join(f"<th>{esc(c)}</th>" for c in table_columns(report)) + "<th>result</th>"
    body = "".join(
        f'<tr class="{"pass" if lv.get("passed", True) else "fail"}">'
        + "".join(f"<td>{esc(cell)}</td>" for cell in row)
        + f"<td>{'pass' if lv.get('passed', True) else 'FAIL'}</td></tr>"
        for lv, row in zip(report["levels"], table_rows(report)))
    figs = "".join(f'<h2>{esc(t)}</h2>\n<img alt="{esc(t)}" src="{uri}">\n' for t, uri in images.items())
    if not images:
        figs = "<h2>Plots</h2>\n<p class=\"fail\">No request brought audio: nothing to plot.</p>\n"
    errors = "".join(f"<li>concurrency {lv['concurrency']}, {esc(kind)}: {esc(str(msg))}</li>"
                     for lv in report["levels"] for kind, msg in lv["error_examples"].items())
    verdicts = "".join(f'<li class="{"pass" if lv.get("passed", True) else "fail"}">'
                       f'{esc(level_verdict(lv, settings.get("max_error_rate", 0.0)))}</li>' for lv in report["levels"])
    notes = "".join(f"<p>{esc(line)}</p>" for line in verdict_lines(report)[len(report["levels"]):])
    streamed = ("<p>Streamed: 1st p50/p95 ms is the time to the first audio byte.</p>"
                if report.get("stream") else "")
    section = f"<h2>Levels</h2><ul>{verdicts}</ul>{notes}{streamed}\n<table><tr>{head}</tr>{body}</table>\n"
    figs += f"<h2>Errors and rejections</h2><ul>{errors or '<li>none</li>'}</ul>"
    return _write_page(report, path, _verdict(report), section, figs, accept=report["accept"])


def _write_page(report: dict, path: Path, overall: str, section: str, figs: str, accept: str) -> Path:
    """The page around a run's own sections: the verdict, what was measured on what, then the sections."""
    esc = html.escape
    about = "".join(f"<tr><th>{esc(k)}</th><td>{esc(str(v))}</td></tr>" for k, v in (
        ("target", report["target"]), ("device", report.get("device", "unknown")),
        ("fish-sm", report.get("fish_sm_version", "unknown")),
        ("started", f"{report['started']} UTC"), ("finished", f"{report.get('finished', '-')} UTC"),
        *((k.replace("_", " "), "-" if v is None else v) for k, v in report.get("settings", {}).items()),
        *((f"mix: {k.replace('_', ' ')}", "-" if v is None else v) for k, v in report.get("mix", {}).items()),
        ("accept", accept)))
    title = "fish-sm capacity" if report.get("kind") == "capacity" else "fish-sm bench"
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{title}: {esc(report['target'])}</title>
<style>body{{font-family:sans-serif;max-width:960px;margin:2em auto}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}img{{max-width:100%}}
.pass{{color:#1a7f37}}.fail{{color:#b42318;font-weight:bold}}tr.pass{{color:inherit}}</style></head>
<body><h1>{title}</h1>
<p class="{'pass' if report.get('passed', True) else 'fail'}" id="verdict">{esc(overall)}</p>
<table>{about}</table>
{section}
{figs}
</body></html>
"""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path
