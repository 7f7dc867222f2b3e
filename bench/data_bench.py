"""Benchmark of agent.data: loader throughput vs torch DataLoader, reposition, spare first batch.

    python -m bench.data_bench [--rounds 5] [--tokens 20000000] [--seq-len 256] [--micro 16]
                               [--global 64] [--steps 300] [--check-tokens 50000000]
                               [--json PATH] [--write-doc]
    ceaseless bench data ...            (same options)

Every measurement is repeated ``--rounds`` times (at least 3), interleaved: each round runs
every case once, in a rotated order, so drift on a shared machine hits all cases alike.
Reported: the median over rounds and the min-max range. The throughput ratio against
``torch.utils.data.DataLoader`` is computed per round (same round, same data, same batch
shapes) and then summarised.

Cold page cache: the token file and the cached permutation are dropped from the page cache
with ``os.posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED)`` (after ``fsync``; works only for
pages no process maps, so the spare is started after the drop), checked with ``fincore``
when it is installed. This needs no root; a VM's host may still cache the disk.

Writes the JSON result to ``--json`` and prints a markdown table; ``--write-doc`` replaces
the ``## Data loading`` section of docs/benchmarks.md (other sections are kept verbatim).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import hashlib
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

from bench import common
from bench.common import cpu_model, summary

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "benchmarks.md"
SECTION = "## Data loading"


# ---- helpers ----------------------------------------------------------------------------


def drop_cache(paths) -> bool:
    """posix_fadvise(DONTNEED) on each file (unmapped pages only); True when all calls worked."""
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


def fill_cache(path) -> None:
    with open(path, "rb", buffering=0) as f:
        while f.read(8 << 20):
            pass


def resident_pct(path) -> float | None:
    """Share of ``path`` in the page cache, from util-linux ``fincore`` (None without it)."""
    if not shutil.which("fincore"):
        return None
    try:
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES,SIZE", str(path)],
                             capture_output=True, text=True, timeout=10).stdout.split()
        return round(100.0 * int(out[0]) / max(1, int(out[1])), 1)
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def rotated(items: list, r: int) -> list:
    k = r % len(items)
    return items[k:] + items[:k]


# ---- throughput -------------------------------------------------------------------------


class _MicroBatchSampler(torch.utils.data.Sampler):
    """The ElasticLoader's micro-batches at world size 1 (same indices, same order)."""

    def __init__(self, order, steps, m):
        self.order, self.steps, self.m = order, steps, m

    def __iter__(self):
        M = self.order.global_batch_size // self.m
        for s in range(self.steps):
            for k in range(M):
                yield self.order.indices(s, k, self.m).tolist()

    def __len__(self):
        return self.steps * (self.order.global_batch_size // self.m)


class _BatchFetch(torch.utils.data.Dataset):
    """DataLoader with a batched fetch: ``dataset[list_of_indices]`` -> ``ds.batch``."""

    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, idx):
        return self.ds.batch(np.asarray(idx, dtype=np.int64))


def _consume(it, work_s=0.0):
    """Run an iterator of batches, sleeping ``work_s`` after each (a training step that releases
    the GIL, like waiting for a GPU); (samples, t_start, t_first_batch, t_end)."""
    n, t_first = 0, None
    t0 = time.perf_counter()
    for item in it:
        if isinstance(item, tuple) and isinstance(item[0], int):  # ElasticLoader: (k, (x, y))
            item = item[1]
        x = item[0]
        if t_first is None:
            t_first = time.perf_counter()
        n += x.shape[0]
        assert x.dtype == torch.int64 and x.shape[1] > 0
        if work_s:
            time.sleep(work_s)
    return n, t0, t_first, time.perf_counter()


EL2, EL0 = "ElasticLoader, prefetch=2", "ElasticLoader, prefetch=0"
DL0, DL2 = "DataLoader, num_workers=0", "DataLoader, num_workers=2"
DLB = "DataLoader, num_workers=0, batched fetch (ds.batch)"
UPPER = "upper bound: no loading (one pre-built batch, reused)"


def bench_throughput(ds, order, m, steps, rounds, work_s=0.0):
    from agent.data import ElasticLoader

    def elastic(prefetch):
        def run():
            ld = ElasticLoader(ds, order, m, prefetch=prefetch)
            ld.seek(0, 0, 1)

            def gen():
                for _ in range(steps):
                    yield from ld
            try:
                return _consume(gen(), work_s)
            finally:
                ld.close()
        return run

    def dataloader(workers):
        def run():
            dl = torch.utils.data.DataLoader(ds, batch_sampler=_MicroBatchSampler(order, steps, m),
                                             num_workers=workers)
            return _consume(iter(dl), work_s)
        return run

    def dataloader_batched():
        dl = torch.utils.data.DataLoader(_BatchFetch(ds), sampler=_MicroBatchSampler(order, steps, m),
                                         batch_size=None)
        return _consume(iter(dl), work_s)

    cases = {EL2: elastic(2), EL0: elastic(0), DL0: dataloader(0), DL2: dataloader(2),
             DLB: dataloader_batched}
    if work_s:
        fixed = ds.batch(order.indices(0, 0, m))
        n_micro = steps * (order.global_batch_size // m)
        cases[UPPER] = lambda: _consume((fixed for _ in range(n_micro)), work_s)
    for fn in cases.values():  # one untimed pass each: imports, first-call costs
        fn()
    per = {name: {"total": [], "steady": [], "first_ms": []} for name in cases}
    ratios = {"vs_best_dataloader": [], "vs_" + DL0: [], "vs_" + DL2: [], "vs_" + DLB: [],
              "steady_vs_best_dataloader": []}
    for r in range(rounds):
        got = {}
        for name in rotated(list(cases), r):
            n, t0, tf, t1 = cases[name]()
            got[name] = (n / (t1 - t0), (n - m) / max(1e-9, t1 - tf))
            per[name]["total"].append(got[name][0])
            per[name]["steady"].append(got[name][1])
            per[name]["first_ms"].append((tf - t0) * 1e3)
        dls = (DL0, DL2, DLB)
        ratios["vs_best_dataloader"].append(got[EL2][0] / max(got[d][0] for d in dls))
        ratios["steady_vs_best_dataloader"].append(got[EL2][1] / max(got[d][1] for d in dls))
        for d in dls:
            ratios["vs_" + d].append(got[EL2][0] / got[d][0])
    return {"samples_per_run": steps * order.global_batch_size, "work_ms_per_micro_batch": work_s * 1e3,
            "cases": {name: {k: summary(v) for k, v in d.items()} for name, d in per.items()},
            "ratio_elastic_prefetch2": {k: summary(v) for k, v in ratios.items()}}


# ---- reposition -------------------------------------------------------------------------


def bench_reposition(ds, order, m, rounds, n=2000):
    """``seek(step, rank, world)`` to random positions; also seek + that rank's first batch."""
    from agent.data import ElasticLoader

    M = order.global_batch_size // m
    rng = np.random.default_rng(0)
    order.warm(0)
    n_far = 200
    far_epochs = 8  # permutations cached on disk beforehand; only 2 kept in memory
    for e in range(far_epochs):
        order.permutation(e)
    res = {"seek_us": [], "seek_p99_us": [], "seek_first_batch_us": [], "seek_first_batch_p99_us": [],
           "other_epoch_seek_first_batch_us": []}
    with ElasticLoader(ds, order, m, prefetch=2) as ld:
        for _ in range(rounds):
            seeks, firsts, far = [], [], []
            for i in range(n):
                W = int(rng.integers(1, min(M, 8) + 1))
                rk, s = int(rng.integers(0, W)), int(rng.integers(0, order.steps_per_epoch))
                t0 = time.perf_counter()
                ld.seek(s, rk, W)
                t1 = time.perf_counter()
                next(iter(ld))
                t2 = time.perf_counter()
                seeks.append(t1 - t0)
                firsts.append(t2 - t0)
            for i in range(n_far):  # steps in other epochs: permutation loaded from its .npy
                s = int(rng.integers(0, far_epochs * order.steps_per_epoch))
                t0 = time.perf_counter()
                ld.seek(s, 0, 1)
                next(iter(ld))
                far.append(time.perf_counter() - t0)
            res["seek_us"].append(statistics.median(seeks) * 1e6)
            res["seek_p99_us"].append(float(np.percentile(seeks, 99)) * 1e6)
            res["seek_first_batch_us"].append(statistics.median(firsts) * 1e6)
            res["seek_first_batch_p99_us"].append(float(np.percentile(firsts, 99)) * 1e6)
            res["other_epoch_seek_first_batch_us"].append(statistics.median(far) * 1e6)
    out = {k: summary(v) for k, v in res.items()}
    out["seeks_per_round"] = n
    out["other_epoch_seeks_per_round"] = n_far
    return out


# ---- promoted spare: a fresh process ----------------------------------------------------

_SPARE = textwrap.dedent("""
    import json, sys, time
    t_start = time.perf_counter()
    from agent.data import ElasticLoader
    t_import = time.perf_counter()
    data_dir, seq_len, B, m, step = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    mode = sys.argv[6]  # "warm": default open + warm(); "lean": no checks beyond size, no warm()
    if mode == "lean":
        from agent.data import TokenDataset
        ds = TokenDataset(data_dir, seq_len, verify="size", check_tokens=False)
        ld = ElasticLoader(ds, ds.global_order(B, 0), m)
    else:
        ld = ElasticLoader.from_dir(data_dir, global_batch_size=B, micro_batch_size=m, seq_len=seq_len)
    t_open = time.perf_counter()
    warm_s = ld.warm(step) if mode == "warm" else 0.0
    # promotion: the plan names the rank and world, the state transfer names the step
    t0 = time.perf_counter()
    ld.seek(step, 1, 2)
    k, (x, y) = next(iter(ld))
    t1 = time.perf_counter()
    ld.close()
    print(json.dumps({"import_ms": (t_import - t_start) * 1e3, "open_ms": (t_open - t_import) * 1e3,
                      "warm_ms": warm_s * 1e3, "first_batch_ms": (t1 - t0) * 1e3}))
""")

SPARE_CASES = (
    ("warm cache: open + warm(), then promoted", "warm", False),
    ("cold cache: open + warm(), then promoted", "warm", True),
    ("cold cache: size-only open, no warm(), then promoted", "lean", True),
)


def _spare(data_dir, seq_len, B, m, step, mode, env):
    out = subprocess.run([sys.executable, "-c", _SPARE, str(data_dir), str(seq_len), str(B), str(m),
                          str(step), mode], capture_output=True, text=True, cwd=REPO, env=env,
                         timeout=300)
    if out.returncode:
        raise RuntimeError(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_spare(ds, order, B, m, env, rounds):
    step = order.steps_per_epoch // 2 + 7
    order.warm(step)  # the permutation file exists on disk, as on a node that has trained
    files = [ds.path, order.cache_path(order.epoch_of(step))]
    order._epochs.clear()  # unmap it here, so that fadvise can drop its pages
    gc.collect()
    data_dir, seq_len = ds.data_dir, ds.seq_len
    per = {label: {"first_batch_ms": [], "open_ms": [], "warm_ms": [], "import_ms": [], "resident_pct": []}
           for label, _, _ in SPARE_CASES}
    for r in range(rounds):
        for label, mode, cold in rotated(list(SPARE_CASES), r):
            if cold:
                drop_cache(files)
            else:
                for f in files:
                    fill_cache(f)
            pct = resident_pct(files[0])
            got = _spare(data_dir, seq_len, B, m, step, mode, env)
            for k, v in got.items():
                per[label][k].append(v)
            if pct is not None:
                per[label]["resident_pct"].append(pct)
    return {"step": step, "cases": {label: {k: summary(v) for k, v in d.items() if v}
                                    for label, d in per.items()}}


# ---- open-time checks at scale ----------------------------------------------------------


def bench_checks(n_tokens, tmp, env, rounds):
    from agent.data.format import Index, write_index

    d = Path(tmp) / "checks"
    d.mkdir()
    h = hashlib.sha256()
    with open(d / "tokens.bin", "wb") as f:
        for a in range(0, n_tokens, 1 << 24):
            chunk = (np.arange(a, min(n_tokens, a + (1 << 24)), dtype=np.uint32) % 257).astype("<u2")
            f.write(chunk.tobytes())
            h.update(chunk.tobytes())
    write_index(d, Index(dtype="uint16", n_tokens=n_tokens, vocab_size=257, tokenizer="byte",
                         sha256=h.hexdigest(), seq_len=256, max_token=256))
    code = textwrap.dedent("""
        import json, sys, time
        from agent.data import TokenDataset
        d = sys.argv[1]
        out = {}
        for label, verify in (("first open on the node (size + sha256 + max token)", "auto"),
                              ("later opens (size + node marker + max token)", "auto"),
                              ("verify='size' (size + max token)", "size")):
            out[label] = TokenDataset(d, verify=verify).open_seconds * 1e3
        print(json.dumps(out))
    """)
    per: dict[str, list] = {}
    for _ in range(rounds):
        shutil.rmtree(Path(env["CEASELESS_DATA_CACHE"]) / "verified", ignore_errors=True)
        out = subprocess.run([sys.executable, "-c", code, str(d)], capture_output=True, text=True,
                             cwd=REPO, env=env, timeout=300)
        if out.returncode:
            raise RuntimeError(out.stderr)
        for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items():
            per.setdefault(k, []).append(v)
    shutil.rmtree(d)
    return {"n_tokens": n_tokens, "cases": {k: summary(v) for k, v in per.items()}}


# ---- report -----------------------------------------------------------------------------


def _rng(s, fmt="{:,.0f}") -> str:
    return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}–{fmt.format(s['max'])})"


def _throughput_md(tp, title) -> list[str]:
    L = [title, "", "| loader | samples/s | steady samples/s | first batch (ms) |", "|---|---|---|---|"]
    for name, v in tp["cases"].items():
        L.append(f"| {name} | {_rng(v['total'])} | {_rng(v['steady'])} | {_rng(v['first_ms'], '{:.2f}')} |")
    L += ["", "| ElasticLoader (prefetch=2) ÷ DataLoader, same round | ratio |", "|---|---|"]
    names = {"vs_best_dataloader": "vs the fastest DataLoader variant of the round",
             "steady_vs_best_dataloader": "steady state, vs the fastest DataLoader variant"}
    for k, v in tp["ratio_elastic_prefetch2"].items():
        L.append(f"| {names.get(k, k.replace('vs_', 'vs '))} | {_rng(v, '{:.2f}×')} |")
    return L


def markdown(r) -> str:
    c = r["config"]
    tp = r["throughput"]
    tw = r.get("throughput_with_step")
    L = [f"Data: built-in synthetic corpus, {c['tokens']:,} uint16 tokens ({c['tokens'] * 2 / 2**20:.0f} MiB), "
         f"seq_len {c['seq_len']}, micro-batch {c['micro']} samples, global batch {c['global']} "
         f"(world size 1 for throughput), {c['steps']} steps = {tp['samples_per_run']:,} samples per "
         f"throughput run. Batches are `(x, y)`, two int64 `[{c['micro']}, {c['seq_len']}]` tensors. "
         f"{c['rounds']} interleaved rounds; each cell is the median over rounds with the min–max in "
         "parentheses.", ""]
    L += _throughput_md(tp, "**Throughput, loading only** (the consumer does nothing but take batches; "
                            "samples/s; loader built fresh each run, first batch included; \"steady\" "
                            "excludes the first batch)")
    if tw:
        L += [""] + _throughput_md(
            tw, f"**Throughput with a simulated training step** (the consumer sleeps "
                f"{tw['work_ms_per_micro_batch']:g} ms after each micro-batch, releasing the GIL as a "
                "wait on a GPU does; samples/s)")
    rp = r["reposition"]
    L += ["", f"**Reposition** (in process, {rp['seeks_per_round']} random `(step, rank, world)` "
          "per round, µs)", "", "| measurement | median of round medians (min–max) |", "|---|---|",
          f"| `seek(step, rank, world)` | {_rng(rp['seek_us'], '{:.1f}')} µs |",
          f"| `seek`, p99 within a round | {_rng(rp['seek_p99_us'], '{:.1f}')} µs |",
          f"| `seek` + that rank's first micro-batch (not prefetched) | "
          f"{_rng(rp['seek_first_batch_us'], '{:.1f}')} µs |",
          f"| same, p99 within a round | {_rng(rp['seek_first_batch_p99_us'], '{:.1f}')} µs |",
          f"| `seek` + first batch of a step in another epoch (permutation `.npy` loaded by mmap; "
          f"{rp['other_epoch_seeks_per_round']} per round) | "
          f"{_rng(rp['other_epoch_seek_first_batch_us'], '{:.1f}')} µs |"]
    sp = r["spare"]
    L += ["", f"**Promoted spare** (fresh process per run; promotion = `seek(step={sp['step']}, rank=1, "
          "world=2)` + first micro-batch; ms)", "",
          "| case | promotion → first batch | open | warm() | import | resident before |",
          "|---|---|---|---|---|---|"]
    for name, v in sp["cases"].items():
        res = _rng(v["resident_pct"], "{:.0f}%") if "resident_pct" in v else "n/a"
        L.append(f"| {name} | {_rng(v['first_batch_ms'], '{:.2f}')} | {_rng(v['open_ms'], '{:.1f}')} | "
                 f"{_rng(v['warm_ms'], '{:.1f}')} | {_rng(v['import_ms'], '{:.0f}')} | {res} |")
    ch = r.get("checks")
    if ch:
        L += ["", f"**Open-time checks**, {ch['n_tokens']:,} uint16 tokens, warm cache (ms)", "",
              "| open | ms |", "|---|---|"]
        for name, v in ch["cases"].items():
            L.append(f"| {name} | {_rng(v, '{:.1f}')} |")
    return "\n".join(L)


def replace_section(text: str, section: str) -> str:
    """``text`` with its ``## Data loading`` section (up to the next ``## ``) replaced."""
    return common.replace_section(text, SECTION, section)


# ---- entry points -----------------------------------------------------------------------


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--rounds", type=int, default=5, help="interleaved repetitions (>= 3; default 5)")
    ap.add_argument("--tokens", type=int, default=20_000_000)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--global", dest="global_", type=int, default=64)
    ap.add_argument("--steps", type=int, default=300, help="steps per throughput run")
    ap.add_argument("--step-ms", type=float, default=0.5,
                    help="simulated training step per micro-batch for the second throughput table (0: skip)")
    ap.add_argument("--check-tokens", type=int, default=50_000_000,
                    help="size of the open-time check file (0: skip)")
    ap.add_argument("--json", default=str(Path(tempfile.gettempdir()) / "ceaseless-data-bench.json"),
                    help="where to write the JSON result")
    ap.add_argument("--write-doc", action="store_true",
                    help="replace the '## Data loading' section of docs/benchmarks.md")


def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    if args.rounds < 3:
        print("data_bench: --rounds must be at least 3", file=sys.stderr)
        return 2
    from agent.data import TokenDataset, generate

    tmp = tempfile.mkdtemp(prefix="ceaseless-data-bench-", dir=os.environ.get("CEASELESS_BENCH_TMP"))
    env = dict(os.environ, CEASELESS_DATA_CACHE=str(Path(tmp) / "node-cache"),
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    os.environ["CEASELESS_DATA_CACHE"] = env["CEASELESS_DATA_CACHE"]
    argv = sys.argv[1:] if argv is None else argv
    try:
        data = Path(tmp) / "corpus"
        t0 = time.perf_counter()
        generate(data, args.tokens, seed=0, seq_len=args.seq_len)
        gen_s = time.perf_counter() - t0
        r = {
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": ".venv/bin/python -m bench.data_bench " + " ".join(argv),
            "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "platform": platform.platform(),
                        "python": platform.python_version(), "torch": torch.__version__,
                        "numpy": np.__version__, "tmp_dir": tmp,
                        "fincore": shutil.which("fincore") is not None},
            "config": {"tokens": args.tokens, "seq_len": args.seq_len, "micro": args.micro,
                       "global": args.global_, "steps": args.steps, "rounds": args.rounds,
                       "step_ms": args.step_ms},
            "generate_s": round(gen_s, 2),
        }
        ds = TokenDataset(data, args.seq_len)
        order = ds.global_order(args.global_, seed=0)
        order.warm(0)
        ds.warm()
        r["throughput"] = bench_throughput(ds, order, args.micro, args.steps, args.rounds)
        if args.step_ms:
            r["throughput_with_step"] = bench_throughput(ds, order, args.micro, args.steps, args.rounds,
                                                         args.step_ms / 1e3)
        r["reposition"] = bench_reposition(ds, order, args.micro, args.rounds)
        ds.close()
        del ds, order
        ds = TokenDataset(data, args.seq_len)
        order = ds.global_order(args.global_, seed=0)
        info = (ds.path, ds.data_dir, ds.seq_len)
        ds.close()  # the parent must not map the file, or fadvise cannot drop its pages
        r["spare"] = bench_spare(_Closed(*info), order, args.global_, args.micro, env, args.rounds)
        if args.check_tokens:
            r["checks"] = bench_checks(args.check_tokens, tmp, env, args.rounds)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    md = markdown(r)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(r, indent=2) + "\n")
    print(md)
    print(f"\nJSON: {args.json}")
    if args.write_doc:
        write_doc(md, r)
        print(f"updated: {DOC} ({SECTION})")
    return 0


class _Closed:
    """What bench_spare needs of a dataset, without holding its map."""

    def __init__(self, path, data_dir, seq_len):
        self.path, self.data_dir, self.seq_len = path, data_dir, seq_len


def write_doc(md: str, r) -> None:
    m = r["machine"]
    section = "\n".join([
        SECTION, "",
        f"Measured {r['date']} on {m['cpu']} ({m['cores']} cores, a shared VM), {m['platform']}, "
        f"Python {m['python']}, torch {m['torch']}, numpy {m['numpy']}.", "",
        f"Command: `{r['command']}`", "", md, ""])
    DOC.parent.mkdir(parents=True, exist_ok=True)
    text = DOC.read_text() if DOC.exists() else ""  # re-read right before writing
    DOC.write_text(replace_section(text, section))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.data_bench", description=__doc__.split("\n")[0])
    add_arguments(ap)
    args = ap.parse_args(argv)
    return run(args, argv)


if __name__ == "__main__":
    sys.exit(main())
