"""Load tests: closed-loop clients at several concurrencies against an endpoint, a URL or a local server.

Each concurrency level runs its requests through a pool of that many threads (each thread
sends its next request when the last one is answered), so the level measures what that many
simultaneous users see. Figures: latency percentiles, requests per second, audio seconds
produced per wall second (the capacity figure for TTS), real-time factor, errors by kind,
and requests the server rejected because it was full (503 with Retry-After: counted, not
retried, as a client that gives up would see it). With streaming, also the time to the
first audio byte, which is what a listener waits for.
Reports: a terminal table, JSON, and HTML with matplotlib plots embedded as PNG data URIs.
"""

from __future__ import annotations

import base64
import contextlib
import html
import io
import json
import socket
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from fish_sm.aws import AWSError
from fish_sm.aws.invoke import STREAM_FORMATS, ServiceError, ping
from fish_sm.errors import InputError

# Varied lengths on purpose: TTS latency grows with the audio produced, so a benchmark of one
# short sentence says little about a service that reads paragraphs.
BUILTIN_TEXTS = [
    "Hello.",
    "Your order has shipped and will arrive on Thursday.",
    "The quick brown fox jumps over the lazy dog, and the dog does not seem to mind at all.",
    "Please hold while I transfer your call. A member of our team will be with you in just a moment, "
    "and we appreciate your patience.",
    "In the beginning, the river was only a thin line of silver between the hills. Over many centuries it "
    "cut deeper, carrying sand and stone to the sea, until the valley we know today took shape around it.",
    "Welcome to the quarterly review. Revenue grew eleven percent over the previous quarter, driven mostly by "
    "new customers in Europe and Asia. Operating costs stayed flat, and we expect the same trend to continue "
    "through the end of the year, although currency movements remain a risk that we are watching closely.",
    "Numbers and dates test a reader too: on March 3rd, 2024, at 4:15 pm, flight 208 left gate B12 with "
    "164 passengers.",
    "Is it raining? Bring an umbrella, just in case!",
]


def load_texts(path: Path) -> list[dict]:
    """One request per line: plain text, or a JSON object with at least "text"."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"--texts file not found: {path}")
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        if line.startswith("{"):
            try:
                doc = json.loads(line)
            except ValueError as exc:
                raise InputError(f"{path}:{n}: not valid JSON ({exc})") from None
            if not isinstance(doc.get("text"), str) or not doc["text"].strip():
                raise InputError(f"{path}:{n}: a JSON line needs a non-empty \"text\"")
            out.append(doc)
        else:
            out.append({"text": line})
    if not out:
        raise InputError(f"{path} holds no texts")
    return out


def parse_concurrency(spec: str) -> list[int]:
    try:
        levels = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"--concurrency must be numbers separated by commas, got {spec!r}") from None
    if not levels or any(c < 1 for c in levels):
        raise InputError(f"--concurrency levels must be at least 1, got {spec!r}")
    return sorted(set(levels))


@dataclass
class Sample:
    concurrency: int
    index: int
    start_s: float  # since the level began
    latency_s: float
    ok: bool
    kind: str  # "ok" or the error kind
    audio_seconds: float | None
    text_chars: int
    error: str | None = None
    first_audio_s: float | None = None  # streamed requests: time to the first audio byte


def _one(target, request: dict, accept: str, concurrency: int, index: int, t0: float) -> Sample:
    start = time.perf_counter()
    chars = len(request.get("text", ""))
    try:
        response = target.send(request, accept)
    except ServiceError as exc:
        return Sample(concurrency, index, start - t0, time.perf_counter() - start, False, exc.kind, None, chars, str(exc))
    except Exception as exc:  # anything else still counts, by its type, rather than killing the run
        return Sample(concurrency, index, start - t0, time.perf_counter() - start, False, type(exc).__name__, None,
                      chars, str(exc))
    return Sample(concurrency, index, start - t0, response.latency_s, True, "ok", response.audio_seconds, chars,
                  first_audio_s=response.first_audio_s)


def run_level(target, requests: list[dict], concurrency: int,
              accept: str = "audio/wav") -> tuple[list[Sample], float]:
    """Send every request with `concurrency` workers; returns the samples and the wall time."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix=f"bench-c{concurrency}") as pool:
        futures = [pool.submit(_one, target, r, accept, concurrency, i, t0) for i, r in enumerate(requests)]
        samples = [f.result() for f in futures]
    return samples, time.perf_counter() - t0


def _pct(values, q) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


REJECTED = "rejected"  # the kind of a 503 with Retry-After: the server was full


def summarize(samples: list[Sample], wall_s: float, concurrency: int) -> dict:
    """Figures for one level; latency, first audio and RTF over successful requests only."""
    ok = [s for s in samples if s.ok]
    lat = np.array([s.latency_s for s in ok])
    first = np.array([s.first_audio_s for s in ok if s.first_audio_s is not None]) * 1000
    audio = [s.audio_seconds for s in ok if s.audio_seconds is not None]
    rtf = np.array([s.latency_s / s.audio_seconds for s in ok if s.audio_seconds])
    errors = Counter(s.kind for s in samples if not s.ok and s.kind != REJECTED)
    examples = {}
    for s in samples:
        if not s.ok and s.kind not in examples:
            examples[s.kind] = s.error
    total_audio = float(sum(audio))
    return {
        "concurrency": concurrency,
        "requests": len(samples),
        "ok": len(ok),
        "rejected": sum(1 for s in samples if not s.ok and s.kind == REJECTED),
        "errors": dict(sorted(errors.items())),
        "error_examples": examples,
        "wall_s": wall_s,
        "rps": len(ok) / wall_s if wall_s > 0 else 0.0,
        "audio_seconds": total_audio,
        "audio_seconds_per_wall_second": total_audio / wall_s if wall_s > 0 else 0.0,
        "latency_s": {"p50": _pct(lat, 50), "p95": _pct(lat, 95), "p99": _pct(lat, 99),
                      "mean": float(lat.mean()) if len(lat) else None,
                      "min": float(lat.min()) if len(lat) else None,
                      "max": float(lat.max()) if len(lat) else None},
        "first_audio_ms": {"p50": _pct(first, 50), "p95": _pct(first, 95),
                           "mean": float(first.mean()) if len(first) else None},
        "rtf": {"p50": _pct(rtf, 50), "p95": _pct(rtf, 95), "mean": float(rtf.mean()) if len(rtf) else None},
    }


def run_bench(target, *, concurrencies: list[int], requests_per_level: int, texts: list[dict],
              base: dict | None = None, accept: str = "audio/wav", warmup: int = 1, stream: bool = False,
              log=lambda s: None) -> dict:
    """The whole benchmark: warm-up, then each level in turn; returns the report as plain data.

    stream: every request asks for a streamed answer, and each sample records its first audio.
    """
    if requests_per_level < 1:
        raise InputError(f"--requests must be at least 1, got {requests_per_level}")
    base = dict(base or {})
    if stream:
        fmt = base.get("format", "wav")
        if fmt not in STREAM_FORMATS:
            raise InputError(f"--stream sends {' or '.join(STREAM_FORMATS)}, not {fmt}")
        base["stream"] = True
    requests = [{**base, **texts[i % len(texts)]} for i in range(requests_per_level)]
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    for i in range(warmup):  # first requests pay for lazy loading and compilation: not measured
        s = _one(target, requests[i % len(requests)], accept, 0, i, time.perf_counter())
        log(f"warm-up {i + 1}/{warmup}: {'ok' if s.ok else s.error} in {s.latency_s:.2f} s")
    levels, samples = [], []
    for c in concurrencies:
        level_samples, wall = run_level(target, requests, c, accept)
        summary = summarize(level_samples, wall, c)
        levels.append(summary)
        samples.extend(level_samples)
        lat, first = summary["latency_s"]["p50"], summary["first_audio_ms"]["p50"]
        log(f"concurrency {c}: {summary['ok']}/{summary['requests']} ok in {wall:.1f} s"
            + (f", p50 {lat:.2f} s" if lat is not None else "")
            + (f", first audio p50 {first:.0f} ms" if first is not None else "")
            + (f", {summary['rejected']} rejected (server full)" if summary["rejected"] else ""))
    return {
        "target": str(target), "started": started, "accept": accept, "stream": stream,
        "requests_per_level": requests_per_level, "texts": len(texts), "warmup": warmup, "levels": levels,
        "samples": [asdict(s) for s in samples],
    }


def _fmt(v, spec=".2f") -> str:
    return "-" if v is None else format(v, spec)


TABLE_COLUMNS = ["conc", "ok/n", "p50 s", "p95 s", "p99 s", "req/s", "audio s/s", "RTF p50", "rejected", "errors"]
FIRST_AUDIO_COLUMNS = ["1st p50 ms", "1st p95 ms"]  # streamed runs: after the latency percentiles


def table_columns(report: dict) -> list[str]:
    if not report.get("stream"):
        return TABLE_COLUMNS
    return TABLE_COLUMNS[:5] + FIRST_AUDIO_COLUMNS + TABLE_COLUMNS[5:]


def table_rows(report: dict) -> list[list[str]]:
    rows = []
    for lv in report["levels"]:
        lat = lv["latency_s"]
        errors = ", ".join(f"{k}: {n}" for k, n in lv["errors"].items()) or "-"
        first = lv.get("first_audio_ms") or {}
        row = [str(lv["concurrency"]), f"{lv['ok']}/{lv['requests']}", _fmt(lat["p50"]), _fmt(lat["p95"]),
               _fmt(lat["p99"]), _fmt(lv["rps"]), _fmt(lv["audio_seconds_per_wall_second"]),
               _fmt(lv["rtf"]["p50"], ".3f"), str(lv.get("rejected", 0)), errors]
        if report.get("stream"):
            row[5:5] = [_fmt(first.get("p50"), ".0f"), _fmt(first.get("p95"), ".0f")]
        rows.append(row)
    return rows


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


def plots(report: dict) -> dict[str, str]:
    """title -> PNG data URI: latency per concurrency, throughput vs concurrency, latency vs audio length,
    and for streamed runs the time to first audio vs concurrency."""
    try:
        import matplotlib
    except ImportError:
        raise AWSError("the HTML report's plots need matplotlib: pip install 'fish-sm[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    ax.set_xticks(range(1, len(conc) + 1), [str(c) for c in conc])
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
    ax.set_xticks(conc, [str(c) for c in conc])
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
        ax.set_xticks(conc, [str(c) for c in conc])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("time to first audio (ms)")
        ax.set_title("Time to first audio against concurrency")
        ax.legend()
        out["Time to first audio against concurrency"] = _png(fig)
        plt.close(fig)
    return out


def write_html(report: dict, path: Path) -> Path:
    """A self-contained page: the table, the plots as <img> data URIs, and the error examples."""
    images = plots(report)
    esc = html.escape
    head = "".join(f"<th>{esc(c)}</th>" for c in table_columns(report))
    body = "".join("<tr>" + "".join(f"<td>{esc(cell)}</td>" for cell in row) + "</tr>" for row in table_rows(report))
    figs = "".join(f'<h2>{esc(t)}</h2>\n<img alt="{esc(t)}" src="{uri}">\n' for t, uri in images.items())
    errors = "".join(f"<li>concurrency {lv['concurrency']}, {esc(kind)}: {esc(str(msg))}</li>"
                     for lv in report["levels"] for kind, msg in lv["error_examples"].items())
    streamed = (", streamed: 1st p50/p95 ms is the time to the first audio byte"
                if report.get("stream") else "")
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>fish-sm bench: {esc(report['target'])}</title>
<style>body{{font-family:sans-serif;max-width:960px;margin:2em auto}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}img{{max-width:100%}}</style></head>
<body><h1>fish-sm bench</h1>
<p>Target: {esc(report['target'])}<br>Started: {esc(report['started'])} UTC<br>
{report['requests_per_level']} requests per level over {report['texts']} texts, {report['warmup']} warm-up, Accept {esc(report['accept'])}{streamed}</p>
<table><tr>{head}</tr>{body}</table>
{figs}<h2>Errors and rejections</h2><ul>{errors or '<li>none</li>'}</ul>
</body></html>
"""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path


# --- a local `fish-sm serve` to benchmark -------------------------------------------------

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_server(model_dir: Path, *, log_path: Path, startup_timeout_s: float = 600, command: list[str] | None = None):
    """Run `fish-sm serve MODEL_DIR` on a free port until the block ends (also on errors and Ctrl-C).

    Yields the base URL once /ping answers; the server's output goes to log_path, whose tail
    is shown if it dies or never becomes ready.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise InputError(f"--local needs a model directory, not found: {model_dir}")
    port = free_port()
    cmd = command or [sys.executable, "-m", "fish_sm.cli", "serve", str(model_dir), "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            t0 = time.monotonic()
            while not ping(url, timeout_s=2.0):
                if proc.poll() is not None:
                    raise AWSError(f"the local server exited with code {proc.returncode} before it was ready: "
                                   f"{_tail(log_path)}")
                if time.monotonic() - t0 > startup_timeout_s:
                    raise AWSError(f"the local server did not answer /ping within {startup_timeout_s:g} s "
                                   f"(log: {log_path})")
                time.sleep(0.25)
            yield url
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _tail(path: Path, lines: int = 3) -> str:
    text = Path(path).read_text(encoding="utf-8", errors="replace").strip().splitlines()
    return " | ".join(text[-lines:]) or "(no output)"
