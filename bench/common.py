"""Shared by the benchmarks: summaries, machine facts, and docs/benchmarks.md sections."""

from __future__ import annotations

import datetime as dt
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterable

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "benchmarks.md"


def summary(values: Iterable[float]) -> dict[str, Any]:
    v = [float(x) for x in values]
    if not v:
        return {"median": None, "min": None, "max": None, "n": 0, "values": []}
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v),
            "values": [round(x, 4) for x in v]}


def timings(f: Callable[[], Any], repeat: int) -> list[float]:
    """Seconds each of ``repeat`` calls of ``f()`` took."""
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        f()
        out.append(time.perf_counter() - t)
    return out


def fmt(s: dict[str, Any], unit: str = "s", digits: int = 3) -> str:
    """``median (min–max)`` of a :func:`summary`."""
    if not s or s.get("median") is None:
        return "–"
    f = f"{{:.{digits}f}}"
    return f"{f.format(s['median'])} {unit} ({f.format(s['min'])}–{f.format(s['max'])})"


def config(a: Any) -> dict[str, Any]:
    """An argparse namespace as JSON-able config (without the CLI's ``func``)."""
    return {k: v for k, v in vars(a).items() if not callable(v)}


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine() -> dict[str, Any]:
    import torch

    return {"cpu": cpu_model(), "cores": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def machine_line(m: dict[str, Any]) -> str:
    return (f"Measured {m['date']} on {m['cpu']} ({m['cores']} cores), {m['platform']}, "
            f"Python {m['python']}, torch {m['torch']}.")


def replace_section(text: str, heading: str, block: str) -> str:
    """``text`` with the ``heading`` (a ``## `` line) section replaced by ``block``, or
    ``block`` appended; every other section is kept verbatim."""
    lines = text.splitlines(keepends=True)
    block = block.rstrip("\n") + "\n"
    start = next((i for i, ln in enumerate(lines) if ln.rstrip("\n") == heading), None)
    if start is None:
        if not text.strip():
            return "# Benchmarks\n\n" + block
        return text.rstrip("\n") + "\n\n" + block
    end = next((i for i in range(start + 1, len(lines))
                if lines[i].startswith("## ") or lines[i].startswith("# ")), len(lines))
    tail = "".join(lines[end:])
    return "".join(lines[:start]) + block + ("\n" + tail if tail else "")


def write_section(heading: str, block: str, doc: Path = DOC) -> None:
    text = doc.read_text() if doc.exists() else ""
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(replace_section(text, heading, block))


def cmdline(module: str) -> str:
    """How this benchmark was invoked: ``python -m bench.<module> ...`` or ``ceaseless ...``."""
    import sys

    if sys.argv[0].endswith(f"{module}.py"):
        return f"python -m bench.{module} " + " ".join(sys.argv[1:])
    return " ".join(["ceaseless", *sys.argv[1:]])


def emit_with_plot(a: Any, res: dict[str, Any], md: str, heading: str, img: str,
                   plot: Any) -> int:
    """``emit``, plus the plot ``plot(res)`` (SVG text) written to ``--svg`` or, with
    ``--write-doc``, to docs/img/``img``."""
    if a.svg or a.write_doc:
        from bench.report import svg

        p = Path(a.svg) if a.svg else svg.IMG / img
        svg.write(p.name, plot(res), p.parent)
    return emit(res, md, heading, a.json, a.write_doc)


def emit(res: dict[str, Any], md: str, heading: str, json_path: str | None,
         write_doc: bool, doc: Path = DOC) -> int:
    """Print a benchmark's table; keep its JSON; update its section of ``doc``
    (docs/benchmarks.md unless told)."""
    import json

    print(md)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(res, indent=1))
    if write_doc:
        write_section(heading, md, doc)
    return 0


def window_gap(commits: list[tuple[int, float]], t_kill: float, t_end: float) -> float | None:
    """The longest gap between consecutive commits (time order) that ends after ``t_kill`` and
    no later than ``t_end`` (the first step of the recovered job on this process)."""
    ts = sorted(t for _, t in commits)
    gaps = [b - a for a, b in zip(ts, ts[1:]) if t_kill <= b <= t_end and a < t_end]
    return max(gaps) if gaps else None


def main(module: str, argv: list[str] | None = None,
         modes: dict[str, Callable[[list[str]], Any]] | None = None) -> int:
    """The one command line of every benchmark: ``python -m bench.<name> [args]`` parses
    ``add_arguments`` and calls ``run`` of ``module`` (``__name__`` of the caller), as
    ``ceaseless bench <name>`` does (bench/cli.py). ``modes``: internal first words (a
    benchmark's own worker processes, ``worker ...``) and what runs them."""
    import argparse
    import importlib
    import sys

    mod = sys.modules.get(module) or importlib.import_module(module)
    argv = sys.argv[1:] if argv is None else argv
    if modes and argv[:1] and argv[0] in modes:
        modes[argv[0]](argv[1:])
        return 0
    name = getattr(mod.__spec__, "name", module) if module == "__main__" else module
    p = argparse.ArgumentParser(prog=f"python -m {name}", description=mod.__doc__.split("\n")[0])
    mod.add_arguments(p)
    return mod.run(p.parse_args(argv))
