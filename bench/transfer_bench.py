"""The state transfer alone (agent/transfer.py), without a cluster: ``k`` source processes
send a model's state (parameters + AdamW state, sent from the live tensors) to one recipient
process that receives into a fresh model and a never-stepped optimizer, as a joiner does,
over a real gloo group on loopback. Reports the recipient's transfer seconds and GB/s per
repeat, their median, and one loopback TCP stream measured in the same run (bench/size.py).

    python -m bench.transfer_bench --shape mlp --width 4096 --sources 2 --repeats 3
    python -m bench.transfer_bench --shape 124m

Shapes: ``mlp`` (issue 43: depth x Linear(W, W) + a 16-class head: few 64 MiB tensors at
W = 4096) and ``124m`` (GPT-2 small's tensor shapes: one 154 MB embedding, many 2 to 9 MB
tensors). Bitwise equality of the received state is checked every repeat."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build(shape: str, width: int, depth: int, seed: int, stepped: bool):
    import torch
    torch.manual_seed(seed)
    if shape == "mlp":
        layers: list = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
        m = torch.nn.Sequential(*layers, torch.nn.Linear(width, 16))
    else:  # GPT-2 124m's tensors (shapes only)
        d, shapes = 768, [(50257, 768), (1024, 768)]
        for _ in range(12):
            shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,),
                       (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
        shapes += [(d,), (d,)]
        m = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes])
    o = torch.optim.AdamW(m.parameters(), lr=1e-3)
    if stepped:
        g = torch.Generator().manual_seed(1)
        for p in m.parameters():
            o.state[p] = {"step": torch.tensor(3.0),
                          "exp_avg": torch.randn(p.shape, generator=g) * 1e-3,
                          "exp_avg_sq": torch.rand(p.shape, generator=g) * 1e-6}
    return {"model": m, "opt": o}


def fingerprint(objs) -> str:
    import torch
    h = hashlib.sha256()
    for p in objs["model"].parameters():
        h.update(p.detach().numpy().tobytes())
        for k in ("exp_avg", "exp_avg_sq"):
            h.update(objs["opt"].state[p][k].numpy().tobytes())
    return h.hexdigest()[:16]


def worker(rank: int, args: argparse.Namespace, store_path: str) -> None:
    import threading
    import torch
    import torch.distributed as dist
    from agent.collectives import AbortableGroup, make_group
    from agent.state import describe, destinations
    from agent.transfer import recv_state, send_state

    torch.set_num_threads(1)
    k = args.sources
    recipient, sources = k, list(range(k))
    store = dist.FileStore(store_path, k + 1)
    g = AbortableGroup(make_group(store, rank, k + 1, 60.0, "gloo"))
    abort = threading.Event()
    src = build(args.shape, args.width, args.depth, 0, True) if rank != recipient else None
    out = []
    for rep in range(args.repeats):
        g.barrier(abort)
        if rank == recipient:
            objs = build(args.shape, args.width, args.depth, 100 + rep, False)
            g.barrier(abort)
            st = recv_state(g, rank, sources, abort, into=lambda sk: destinations(objs, sk))
            st.restore(objs)
            s = st.stats
            out.append({"seconds": s["seconds"], "transfer_seconds": s["transfer_seconds"],
                        "verify_seconds": s["verify_seconds"], "bytes": s["bytes"],
                        "header_seconds": s.get("header_seconds"),
                        "copy_seconds": s.get("copy_seconds"),
                        "gbs": s["bytes"] / s["seconds"] / 1e9,
                        "per_source": {str(a): b for a, b in s["per_source"].items()},
                        "fingerprint": fingerprint(objs)})
            del objs, st
        else:
            g.barrier(abort)
            send_state(g, describe(src, {"step": 3}), rank, {recipient: sources}, abort)
    g.barrier(abort)
    if rank == recipient:
        print("@@ " + json.dumps(out), flush=True)
    elif rank == 0:
        print("@@src " + fingerprint(src), flush=True)
    g.close()
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=["mlp", "124m"], default="mlp")
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--sources", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--store", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        worker(args.worker, args, args.store)
        return 0
    import subprocess
    from bench.size import memcpy_gbs, tcp_gbs
    tcp = tcp_gbs()
    store = tempfile.mktemp(prefix="xfer-store-")
    cmd = [sys.executable, "-m", "bench.transfer_bench", "--shape", args.shape,
           "--width", str(args.width), "--depth", str(args.depth), "--sources",
           str(args.sources), "--repeats", str(args.repeats), "--store", store]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    procs = [subprocess.Popen(cmd + ["--worker", str(r)], stdout=subprocess.PIPE, text=True,
                              env=env) for r in range(args.sources + 1)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    tcp2 = tcp_gbs()
    rows = next(json.loads(line[3:]) for line in outs[-1].splitlines() if line.startswith("@@ "))
    src_fp = next(line.split()[1] for line in outs[0].splitlines() if line.startswith("@@src"))
    med = statistics.median(r["gbs"] for r in rows)
    link = statistics.median([tcp, tcp2])
    res = {"shape": args.shape, "width": args.width, "sources": args.sources,
           "gb": rows[0]["bytes"] / 1e9, "repeats": rows, "median_gbs": med,
           "tcp_gbs": [tcp, tcp2], "memcpy_gbs": memcpy_gbs(),
           "vs_tcp": med / link, "bitwise": all(r["fingerprint"] == src_fp for r in rows)}
    for r in rows:
        print(f"  {r['bytes'] / 1e9:.2f} GB in {r['seconds']:.2f} s ({r['gbs']:.2f} GB/s; "
              f"header {r['header_seconds'] or 0:.2f} s, copy {r['copy_seconds'] or 0:.2f} s, "
              f"verify {r['verify_seconds']:.2f} s) per source {r['per_source']}")
    print(f"{args.shape} W={args.width} k={args.sources}: median {med:.2f} GB/s, "
          f"TCP {tcp:.2f}/{tcp2:.2f} GB/s -> {100 * res['vs_tcp']:.0f} % of TCP; "
          f"bitwise {res['bitwise']}; load {os.getloadavg()[0]:.2f}")
    print("@@ " + json.dumps(res))
    return 0 if res["bitwise"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
