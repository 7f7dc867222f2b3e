"""Benchmark of agent.data: throughput, reposition, spare first batch, open-time checks.

    python -m bench.data_bench [--tokens 20000000] [--seq-len 256] [--micro 16] [--global 64]
                               [--steps 200] [--check-tokens 100000000] [--no-write]

Prints a JSON result and a markdown table, and (unless --no-write) rewrites the benchmark
section of docs/data.md with the table, the machine, the command and the date.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "data.md"
START, END = "<!-- bench:start -->", "<!-- bench:end -->"


def _drop_cache(paths) -> bool:
    """posix_fadvise(DONTNEED) on files nobody maps; True when the kernel took it."""
    ok = True
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        except (OSError, AttributeError):
            ok = False
    return ok


def _resident_pct(path) -> float | None:
    if not shutil.which("fincore"):
        return None
    try:
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES,SIZE", str(path)],
                             capture_output=True, text=True, timeout=10).stdout.split()
        return round(100.0 * int(out[0]) / max(1, int(out[1])), 1)
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


# ---- throughput -------------------------------------------------------------------------


class _MicroBatchSampler(torch.utils.data.Sampler):
    """The same micro-batches (same indices, same order) as the ElasticLoader at W=1."""

    def __init__(self, order, steps, m):
        self.order, self.steps, self.m = order, steps, m

    def __iter__(self):
        M = self.order.global_batch_size // self.m
        for s in range(self.steps):
            for k in range(M):
                yield self.order.indices(s, k, self.m).tolist()

    def __len__(self):
        return self.steps * (self.order.global_batch_size // self.m)


def _consume(it, first_cb=None):
    n = 0
    t_first = None
    t0 = time.perf_counter()
    for item in it:
        x = item[1][0] if isinstance(item, tuple) and isinstance(item[0], int) else item[0]
        if t_first is None:
            t_first = time.perf_counter()
        n += x.shape[0]
    t1 = time.perf_counter()
    return n, t0, t_first, t1


def bench_throughput(data_dir, seq_len, B, m, steps, reps=3):
    from agent.data import ElasticLoader, TokenDataset

    ds = TokenDataset(data_dir, seq_len)
    order = ds.global_order(B, seed=0)
    order.warm(0)
    ds.warm()
    res = {}

    def elastic(prefetch):
        def run():
            ld = ElasticLoader(ds, order, m, prefetch=prefetch)
            ld.seek(0, 0, 1)

            def gen():
                for _ in range(steps):
                    yield from ld
            out = _consume(gen())
            ld.close()
            return out
        return run

    def dataloader(workers):
        def run():
            dl = torch.utils.data.DataLoader(ds, batch_sampler=_MicroBatchSampler(order, steps, m),
                                             num_workers=workers,
                                             persistent_workers=False)
            return _consume(iter(dl))
        return run

    cases = {"ElasticLoader (prefetch=2)": elastic(2), "ElasticLoader (prefetch=0)": elastic(0),
             "DataLoader num_workers=0": dataloader(0), "DataLoader num_workers=2": dataloader(2)}
    for name, fn in cases.items():
        best = None
        for _ in range(reps):
            n, t0, tf, t1 = fn()
            total = n / (t1 - t0)
            steady = (n - m) / max(1e-9, t1 - tf)
            cur = {"samples_per_s": round(total), "steady_samples_per_s": round(steady),
                   "first_batch_ms": round((tf - t0) * 1e3, 2)}
            if best is None or cur["samples_per_s"] > best["samples_per_s"]:
                best = cur
        res[name] = best
    return res


def bench_reposition(data_dir, seq_len, B, m, n=2000):
    from agent.data import ElasticLoader, TokenDataset

    ds = TokenDataset(data_dir, seq_len)
    order = ds.global_order(B, seed=0)
    M = B // m
    rng = np.random.default_rng(0)
    max_step = order.steps_per_epoch - 1  # one epoch's permutation, loaded once
    order.warm(0)
    with ElasticLoader(ds, order, m) as ld:
        seeks, firsts = [], []
        for _ in range(n):
            W = int(rng.integers(1, min(M, 8) + 1))
            r, s = int(rng.integers(0, W)), int(rng.integers(0, max_step))
            t0 = time.perf_counter()
            ld.seek(s, r, W)
            t1 = time.perf_counter()
            next(iter(ld))
            t2 = time.perf_counter()
            seeks.append(t1 - t0)
            firsts.append(t2 - t0)
    return {"seek_median_us": round(statistics.median(seeks) * 1e6, 1),
            "seek_p99_us": round(float(np.percentile(seeks, 99)) * 1e6, 1),
            "seek_to_first_batch_median_us": round(statistics.median(firsts) * 1e6, 1),
            "seek_to_first_batch_p99_us": round(float(np.percentile(firsts, 99)) * 1e6, 1),
            "n": n}


# ---- spare: fresh process ---------------------------------------------------------------

_SPARE = textwrap.dedent("""
    import json, sys, time
    t_start = time.perf_counter()
    from agent.data import ElasticLoader
    t_import = time.perf_counter()
    data_dir, seq_len, B, m, step, warm = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6] == "1"
    ld = ElasticLoader.from_dir(data_dir, global_batch_size=B, micro_batch_size=m, seq_len=seq_len)
    t_open = time.perf_counter()
    warm_s = ld.warm(step) if warm else 0.0
    # promotion: the plan names the rank, the transfer names restore_step
    t0 = time.perf_counter()
    ld.seek(step, 1, 2)
    k, (x, y) = next(iter(ld))
    t1 = time.perf_counter()
    ld.close()
    print(json.dumps({"import_ms": (t_import - t_start) * 1e3, "open_ms": (t_open - t_import) * 1e3,
                      "warm_ms": warm_s * 1e3, "first_batch_ms": (t1 - t0) * 1e3}))
""")


def _spare(data_dir, seq_len, B, m, step, warm, env):
    out = subprocess.run([sys.executable, "-c", _SPARE, str(data_dir), str(seq_len), str(B), str(m),
                          str(step), "1" if warm else "0"], capture_output=True, text=True,
                         cwd=REPO, env=env, timeout=300)
    if out.returncode:
        raise RuntimeError(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_spare(data_dir, seq_len, B, m, env, reps=5):
    from agent.data import TokenDataset

    ds = TokenDataset(data_dir, seq_len)
    order = ds.global_order(B, seed=0)
    step = order.steps_per_epoch // 2
    order.warm(step)  # cache the permutation file
    files = [ds.path, order.cache_path(order.epoch_of(step))]
    del ds, order
    res = {}
    for label, warm, drop in (("warm cache, after warm()", True, False),
                              ("cold cache, after warm()", True, True),
                              ("cold cache, no warm()", False, True)):
        runs, resident = [], []
        for _ in range(reps):
            if drop:
                _drop_cache(files)
                resident.append(_resident_pct(files[0]))
            else:
                _spare(data_dir, seq_len, B, m, step, True, env)  # pages in cache
            runs.append(_spare(data_dir, seq_len, B, m, step, warm, env))
        med = {k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]}
        if drop:
            med["resident_before_pct"] = resident[0]
        res[label] = med
    return res


# ---- open-time checks at scale ----------------------------------------------------------


def bench_checks(n_tokens, tmp, env):
    from agent.data.format import Index, write_index

    d = Path(tmp) / "checks"
    d.mkdir()
    arr = (np.arange(n_tokens, dtype=np.int64) % 257).astype(np.uint16)
    arr.tofile(d / "tokens.bin")
    import hashlib

    h = hashlib.sha256(arr.tobytes()).hexdigest()
    del arr
    write_index(d, Index(dtype="uint16", n_tokens=n_tokens, vocab_size=257, tokenizer="byte",
                         sha256=h, seq_len=256, max_token=256))
    code = textwrap.dedent("""
        import json, sys, time
        from agent.data import TokenDataset
        from agent.data.format import check_tokens
        d = sys.argv[1]
        out = {}
        for label, verify in (("first open on node (size + sha256 + max)", "auto"),
                              ("later opens (size + marker + max)", "auto"),
                              ("verify='size' (size + max)", "size")):
            ds = TokenDataset(d, verify=verify)
            out[label] = round(ds.open_seconds * 1e3, 2)
        ts = []
        for _ in range(5):
            t = time.perf_counter(); check_tokens(ds.path, ds.tokens, ds.index); ts.append(time.perf_counter() - t)
        out["max check alone"] = round(sorted(ts)[2] * 1e3, 2)
        print(json.dumps(out))
    """)
    out = subprocess.run([sys.executable, "-c", code, str(d)], capture_output=True, text=True,
                         cwd=REPO, env=env, timeout=300)
    if out.returncode:
        raise RuntimeError(out.stderr)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["n_tokens"] = n_tokens
    shutil.rmtree(d)
    return res


# ---- report -----------------------------------------------------------------------------


def markdown(r) -> str:
    c = r["config"]
    lines = [f"Data: synthetic corpus, {c['tokens']:,} tokens (uint16), seq_len {c['seq_len']}, "
             f"micro-batch {c['micro']} samples, global batch {c['global']}, {c['steps']} steps "
             "per throughput run (best of 3). Batches are `(x, y)` int64 `[m, seq_len]`.", "",
             "| measurement | result |", "|---|---|"]
    for name, v in r["throughput"].items():
        lines.append(f"| throughput, {name} | {v['samples_per_s']:,} samples/s "
                     f"(steady {v['steady_samples_per_s']:,}; first batch {v['first_batch_ms']} ms) |")
    rp = r["reposition"]
    lines.append(f"| reposition `seek(step, rank, world)` (median / p99 of {rp['n']}) | "
                 f"{rp['seek_median_us']} µs / {rp['seek_p99_us']} µs |")
    lines.append(f"| `seek` + first batch of a random step, in process (median / p99) | "
                 f"{rp['seek_to_first_batch_median_us']} µs / {rp['seek_to_first_batch_p99_us']} µs |")
    for name, v in r["spare"].items():
        extra = f"; resident before: {v['resident_before_pct']}%" if v.get("resident_before_pct") is not None else ""
        lines.append(f"| promoted spare (fresh process), {name}: seek + first batch | "
                     f"{v['first_batch_ms']} ms (open {v['open_ms']} ms, warm() {v['warm_ms']} ms, "
                     f"import {v['import_ms']} ms{extra}) |")
    ch = r["checks"]
    for name, v in ch.items():
        if name != "n_tokens":
            lines.append(f"| open-time checks, {ch['n_tokens']:,} tokens: {name} | {v} ms |")
    return "\n".join(lines)


def write_doc(md: str, r) -> None:
    m = r["machine"]
    block = "\n".join([
        START,
        f"Measured {r['date']} on {m['cpu']} ({m['cores']} cores, shared with other work), "
        f"{m['platform']}, Python {m['python']}, torch {m['torch']}, numpy {m['numpy']}.",
        f"Command: `{r['command']}`", "", md, END])
    text = DOC.read_text() if DOC.exists() else "# Data loading\n\n## Benchmark\n\n"
    if START in text and END in text:
        a, b = text.index(START), text.index(END) + len(END)
        text = text[:a] + block + text[b:]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    DOC.write_text(text)


def _cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.data_bench")
    ap.add_argument("--tokens", type=int, default=20_000_000)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--global", dest="global_", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--check-tokens", type=int, default=100_000_000)
    ap.add_argument("--no-write", action="store_true", help="do not update docs/data.md")
    args = ap.parse_args(argv)

    from agent.data import generate

    tmp = tempfile.mkdtemp(prefix="ceaseless-data-bench-")
    env = dict(os.environ, CEASELESS_DATA_CACHE=str(Path(tmp) / "node-cache"),
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    os.environ["CEASELESS_DATA_CACHE"] = env["CEASELESS_DATA_CACHE"]
    try:
        data = Path(tmp) / "corpus"
        t0 = time.perf_counter()
        generate(data, args.tokens, seed=0, seq_len=args.seq_len)
        gen_s = time.perf_counter() - t0
        r = {
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": "python -m bench.data_bench " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": {"cpu": _cpu(), "cores": os.cpu_count(), "platform": platform.platform(),
                        "python": platform.python_version(), "torch": torch.__version__,
                        "numpy": np.__version__},
            "config": {"tokens": args.tokens, "seq_len": args.seq_len, "micro": args.micro,
                       "global": args.global_, "steps": args.steps},
            "generate_s": round(gen_s, 2),
        }
        r["spare"] = bench_spare(data, args.seq_len, args.global_, args.micro, env)
        r["throughput"] = bench_throughput(data, args.seq_len, args.global_, args.micro, args.steps)
        r["reposition"] = bench_reposition(data, args.seq_len, args.global_, args.micro)
        r["checks"] = bench_checks(args.check_tokens, tmp, env) if args.check_tokens else {}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    md = markdown(r)
    print(json.dumps(r, indent=2))
    print()
    print(md)
    if not args.no_write:
        write_doc(md, r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
