"""`ceaseless data ...`: prepare, generate and inspect memory-mapped token data.

``register(sub)`` adds the ``data`` command to an argparse subparsers object; every leaf
sets ``func`` to a callable ``args -> exit code`` (0 ok, 2 bad data or arguments).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _prepare(args: argparse.Namespace) -> int:
    from agent.data import DataError, prepare

    t0 = time.perf_counter()
    try:
        index = prepare(args.inputs, args.out, tokenizer=args.tokenizer, seq_len=args.seq_len,
                        text_field=args.text_field)
    except DataError as exc:
        print(f"ceaseless data prepare: {exc}", file=sys.stderr)
        return 2
    _print_summary(args.out, index, time.perf_counter() - t0)
    return 0


def _generate(args: argparse.Namespace) -> int:
    from agent.data import DataError, generate

    t0 = time.perf_counter()
    try:
        index = generate(args.out, n_tokens=args.tokens, seed=args.seed, seq_len=args.seq_len)
    except (DataError, ValueError) as exc:
        print(f"ceaseless data generate: {exc}", file=sys.stderr)
        return 2
    _print_summary(args.out, index, time.perf_counter() - t0)
    return 0


def _print_summary(out, index, seconds: float) -> None:
    print(json.dumps({"dir": str(out), "n_tokens": index.n_tokens, "n_documents": index.n_documents,
                      "dtype": index.dtype, "vocab_size": index.vocab_size,
                      "tokenizer": index.tokenizer, "sha256": index.sha256,
                      "seconds": round(seconds, 3)}, indent=2))


def _info(args: argparse.Namespace) -> int:
    from agent.data import DataError, TokenDataset

    verify = "full" if args.verify else "size"
    try:
        ds = TokenDataset(args.dir, args.seq_len, verify=verify)
    except DataError as exc:
        print(f"ceaseless data info: {exc}", file=sys.stderr)
        return 2
    info = ds.index.to_json()
    info.update({"dir": str(args.dir), "samples": ds.n_samples, "sample_seq_len": ds.seq_len,
                 "max_token_seen": ds.max_token,
                 "checks": "size, index, max token" + (", sha256" if args.verify else ""),
                 "open_ms": round(ds.open_seconds * 1e3, 2)})
    if args.global_batch_size:
        spe = ds.n_samples // args.global_batch_size
        info["steps_per_epoch"] = spe
    print(json.dumps(info, indent=2, sort_keys=True))
    return 0


def register(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("data", help="prepare, generate and inspect token data",
                       description="Memory-mapped token data (tokens.bin + index.json).")
    dsub = p.add_subparsers(dest="data_command", metavar="{prepare,generate,info}")
    dsub.required = True

    pp = dsub.add_parser("prepare", help="tokenise text/jsonl/jsonl.gz/parquet/arrow files")
    pp.add_argument("inputs", nargs="+", metavar="INPUT", help="files or directories")
    pp.add_argument("--out", required=True, metavar="DIR")
    pp.add_argument("--tokenizer", default="byte", help="'byte' (default) or a tokenizer.json path")
    pp.add_argument("--seq-len", type=int, default=256, help="default sample length (default 256)")
    pp.add_argument("--text-field", default="text", help="JSON field / column with the text")
    pp.set_defaults(func=_prepare)

    pg = dsub.add_parser("generate", help="write the built-in deterministic synthetic corpus")
    pg.add_argument("--out", required=True, metavar="DIR")
    pg.add_argument("--tokens", type=int, default=1_000_000, help="token count (default 1000000)")
    pg.add_argument("--seed", type=int, default=0)
    pg.add_argument("--seq-len", type=int, default=128, help="default sample length (default 128)")
    pg.set_defaults(func=_generate)

    pi = dsub.add_parser("info", help="show and check a prepared data directory")
    pi.add_argument("dir", metavar="DIR")
    pi.add_argument("--seq-len", type=int, default=None)
    pi.add_argument("--global-batch-size", type=int, default=None)
    pi.add_argument("--verify", action="store_true", help="also check the full sha256")
    pi.set_defaults(func=_info)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ceaseless")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
