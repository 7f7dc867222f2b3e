"""`ceaseless trace list|show|plot|steps`: read a run's trace files and explain its incidents
(and, with CEASELESS_TRACE_STEPS=1, the overlap of each step's gradient sync).

``register(sub)`` adds the ``trace`` command to an argparse subparsers object; every leaf sets
``func`` (``args.func(args)`` returns the exit code). ``python -m ops.cli_trace ...`` runs
it stand-alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Sequence

from ops import trace_tools as tt

RUNS_DIR = Path("runs")


class RunDirError(Exception):
    pass


def find_run_dir(arg: str | os.PathLike | None = None, runs: str | os.PathLike = RUNS_DIR) -> Path:
    """The run directory to read: ``arg`` if given; else ``<runs>/latest`` (a symlink to the
    run, or a file holding its path, absolute or relative to ``<runs>``); else the newest
    ``<runs>/*`` holding a ``cluster.json``."""
    if arg:
        p = Path(arg)
        if not p.exists():
            raise RunDirError(f"run dir {p} does not exist")
        return p
    runs = Path(runs)
    latest = runs / "latest"
    if latest.is_dir():  # a symlink to the run (or a plain directory)
        return latest.resolve()
    if latest.is_file():
        text = latest.read_text().strip()
        if text:
            p = Path(text)
            for cand in ((p,) if p.is_absolute() else (runs / p, p)):
                if cand.is_dir():
                    return cand.resolve()
    cands = [d for d in runs.glob("*") if d.is_dir() and (d / "cluster.json").is_file()]
    if cands:
        return max(cands, key=lambda d: ((d / "cluster.json").stat().st_mtime, d.name))
    raise RunDirError(f"no run dir: pass --run-dir, or run `ceaseless up` (looked for "
                      f"{latest} and {runs}/*/cluster.json)")


def _load(args: argparse.Namespace) -> tuple[Path, list[tt.Incident], tt.LoadStats]:
    run = find_run_dir(args.run_dir)
    stats = tt.LoadStats()
    spans = tt.load_spans(run, stats)
    if stats.files == 0:
        raise RunDirError(f"no trace files under {run} (expected {run}/traces/*.jsonl; are the "
                          "processes exporting OTLP instead? see docs/observability.md)")
    return run, tt.incidents(spans), stats


def _warn(stats: tt.LoadStats) -> None:
    if stats.bad_lines:
        print(f"note: skipped {stats.bad_lines} unreadable line(s) (a process killed "
              "mid-write leaves a partial last line)", file=sys.stderr)


def _guard(fn):
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except (RunDirError, tt.IncidentNotFound) as e:
            print(f"ceaseless trace: {e}", file=sys.stderr)
            return 2
    return run


@_guard
def cmd_list(args: argparse.Namespace) -> int:
    run, items, stats = _load(args)
    _warn(stats)
    if args.json:
        print(json.dumps([i.summary() for i in items], indent=2))
        return 0
    print(f"run {run}: {stats.spans} spans in {stats.files} file(s), {len(items)} incident(s)")
    print(tt.render_list(items))
    return 0


@_guard
def cmd_show(args: argparse.Namespace) -> int:
    _run, items, stats = _load(args)
    _warn(stats)
    inc = tt.find_incident(items, args.id)
    if args.json:
        print(json.dumps(tt.show_dict(inc), indent=2, default=str))
    else:
        print(tt.render_show(inc))
    return 0


@_guard
def cmd_plot(args: argparse.Namespace) -> int:
    _run, items, stats = _load(args)
    _warn(stats)
    inc = tt.find_incident(items, args.id)
    out = Path(args.out)
    suffix = out.suffix.lower()
    if suffix == ".svg":
        out.write_text(tt.render_svg(inc), encoding="utf-8")
    elif suffix == ".png":
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("ceaseless trace: PNG needs matplotlib: pip install 'ceaseless[plot]' "
                  "(or write .svg, which needs nothing)", file=sys.stderr)
            return 2
        tt.render_png(inc, out)
    else:
        print(f"ceaseless trace: --out must end in .svg or .png, not {out.name!r}",
              file=sys.stderr)
        return 2
    print(f"wrote {out} ({inc.id}, {len(tt.lanes(inc))} lanes)")
    return 0


@_guard
def cmd_steps(args: argparse.Namespace) -> int:
    run = find_run_dir(args.run_dir)
    stats = tt.LoadStats()
    rows = tt.grad_syncs(tt.load_spans(run, stats))
    _warn(stats)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print(f"run {run}: no traced steps (run the job with CEASELESS_TRACE_STEPS=1 and the "
              "gradient sync overlapped, CEASELESS_OVERLAP=1)")
        return 0
    print(tt.table(["step", "pod", "rank", "last backward", "all-reduce", "overlap",
                    "exposed", "buckets in bw"],
                   [[r["step"], r["pod"], r["rank"], tt.fmt_ms(r["backward_ms"]),
                     tt.fmt_ms(r["allreduce_ms"]), tt.fmt_ms(r["overlap_ms"]),
                     tt.fmt_ms(r["exposed_ms"]), f"{r['during_backward']}/{r['buckets']}"]
                    for r in rows]))
    return 0


def register(sub) -> argparse.ArgumentParser:
    """Add ``trace`` (list/show/plot) to the subparsers object ``sub``."""
    p = sub.add_parser("trace", help="analyse recovery traces of a run",
                       description="Read <run-dir>/traces/*.jsonl and explain incidents.")
    tsub = p.add_subparsers(dest="trace_cmd", metavar="{list,show,plot,steps}")

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--run-dir", default=None,
                       help="run directory (default: ./runs/latest, else the newest "
                            "./runs/* with a cluster.json)")

    q = tsub.add_parser("list", help="one line per incident")
    common(q)
    q.add_argument("--json", action="store_true", help="machine-readable output")
    q.set_defaults(func=lambda args: cmd_list(args))

    q = tsub.add_parser("show", help="phases and critical path of one incident")
    q.add_argument("id", nargs="?", default="last",
                   help="incident id, list number, trace id prefix or `last` (default)")
    common(q)
    q.add_argument("--json", action="store_true", help="machine-readable output")
    q.set_defaults(func=lambda args: cmd_show(args))

    q = tsub.add_parser("plot", help="timeline of one incident (.svg, or .png with matplotlib)")
    q.add_argument("id", nargs="?", default="last",
                   help="incident id, list number, trace id prefix or `last` (default)")
    common(q)
    q.add_argument("--out", "-o", required=True, help="output file: .svg or .png")
    q.set_defaults(func=lambda args: cmd_plot(args))

    q = tsub.add_parser("steps", help="the gradient sync of each traced step: how much of "
                        "the all-reduce overlapped the last backward (CEASELESS_TRACE_STEPS=1)")
    common(q)
    q.add_argument("--json", action="store_true", help="machine-readable output")
    q.set_defaults(func=lambda args: cmd_steps(args))

    def _help(args: argparse.Namespace) -> int:
        p.print_help(sys.stderr)
        return 2

    p.set_defaults(func=_help)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ceaseless")
    sub = parser.add_subparsers(dest="cmd", required=True)
    register(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
