"""Re-render a benchmark's docs/benchmarks.md section and SVG from its saved JSON:

    python -m bench.report.render recovery|control-plane|init|goodput|sharded RESULT.json [--no-doc] [--svg PATH]
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

MODULES = {"recovery": ("bench.recovery", "bench-recovery.svg"),
           "control-plane": ("bench.control_plane", "bench-control-plane.svg"),
           "init": ("bench.init_bench", "bench-init.svg"),
           "goodput": ("bench.goodput", "bench-goodput.svg"),
           "sharded": ("bench.sharded", None)}  # a table only


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("benchmark", choices=sorted(MODULES))
    p.add_argument("json")
    p.add_argument("--no-doc", action="store_true", help="print only")
    p.add_argument("--svg", help="SVG path (default: docs/img/<name>.svg)")
    a = p.parse_args(argv)
    from bench.report import svg
    from bench.common import write_section

    mod_name, img = MODULES[a.benchmark]
    mod = importlib.import_module(mod_name)
    res = json.loads(Path(a.json).read_text())
    md = mod.markdown(res)
    print(md)
    if not a.no_doc:
        write_section(mod.SECTION, md)
        if img is None:
            return 0
        out = Path(a.svg) if a.svg else svg.IMG / img
        svg.write(out.name, mod.plot(res), out.parent)
    return 0


if __name__ == "__main__":
    sys.exit(main())
