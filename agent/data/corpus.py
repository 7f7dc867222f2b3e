"""A deterministic, learnable synthetic corpus (byte tokens) for demos, tests and benchmarks.

Text is a stream of short templated English sentences with grammatical agreement
(``the small cat sits on the mat.`` / ``two small cats sit on the mat.``), correct
arithmetic (``seven plus five is twelve.``) and copy structure (``ada has three apples,
so ada has three apples.``), grouped into documents separated by EOS (256). A small GPT
drops from ln(257) = 5.55 nats to well under 3 within a few dozen steps, and keeps
improving as it learns agreement, sums and copying.

Every choice comes from a splitmix64 hash of (seed, position), never from a library RNG,
so the output is byte-identical for a given (n_tokens, seed) on every machine and numpy
version; the content hash in ``index.json`` says so.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from .format import Index
from .order import hash64
from .prepare import BYTE_EOS, TokenWriter

_POOL = 8192
_CHUNK_SLOTS = 1 << 18  # sentences per write (about 10M tokens)

_DETS_SG = ["the", "a", "one", "every", "this", "that"]
_DETS_PL = ["the", "two", "three", "some", "many", "these", "those"]
_ADJS = ["small", "big", "red", "green", "old", "young", "quiet", "loud", "happy", "clever",
         "lazy", "brave"]
_NOUNS = [("cat", "cats"), ("dog", "dogs"), ("bird", "birds"), ("child", "children"),
          ("robot", "robots"), ("farmer", "farmers"), ("teacher", "teachers"),
          ("fox", "foxes"), ("mouse", "mice"), ("horse", "horses")]
_VERBS = [("sits", "sit"), ("sleeps", "sleep"), ("waits", "wait"), ("runs", "run"),
          ("looks", "look"), ("sings", "sing"), ("plays", "play"), ("jumps", "jump")]
_PREPS = ["on", "under", "near", "behind", "beside", "over"]
_PLACES = ["mat", "table", "hill", "bridge", "tree", "house", "river", "wall", "fence", "road"]
_NAMES = ["ada", "bob", "cy", "dee", "eve", "fay", "gus", "hal", "ivy", "joe"]
_THINGS = ["apples", "books", "coins", "shells", "stones", "cards", "pens", "keys"]
_NUM = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
        "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
        "eighteen", "nineteen", "twenty"]


def _pick(seq, v: int):
    return seq[v % len(seq)]


def _sentence(h: list[int]) -> str:
    kind = h[0] % 4
    if kind <= 1:  # agreement (half of all sentences)
        plural = (h[1] >> 7) & 1
        noun = _pick(_NOUNS, h[2])[plural]
        verb = _pick(_VERBS, h[3])[plural]
        det = _pick(_DETS_PL if plural else _DETS_SG, h[4])
        if det == "a" and _pick(_ADJS, h[5])[0] in "aeiou":
            det = "an"
        return f"{det} {_pick(_ADJS, h[5])} {noun} {verb} {_pick(_PREPS, h[6])} the {_pick(_PLACES, h[7])}."
    if kind == 2:  # arithmetic with correct answers
        a, b = h[1] % 11, h[2] % 11
        if (h[3] >> 5) & 1 and a >= b:
            return f"{_NUM[a]} minus {_NUM[b]} is {_NUM[a - b]}."
        return f"{_NUM[a]} plus {_NUM[b]} is {_NUM[a + b]}."
    name, n, thing = _pick(_NAMES, h[1]), _NUM[1 + h[2] % 9], _pick(_THINGS, h[3])
    return f"{name} has {n} {thing}, so {name} has {n} {thing}."


def _pool(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``_POOL`` distinct-ish sentences as one byte buffer with offsets and lengths."""
    fields = hash64(seed, 0xC0, np.arange(_POOL * 8, dtype=np.uint64)).reshape(_POOL, 8)
    fields = (fields >> np.uint64(16)).astype(np.int64)  # non-negative python-sized ints
    texts = [(_sentence(row) + " ").encode() for row in fields.tolist()]
    lens = np.array([len(t) for t in texts], dtype=np.int64)
    offs = np.concatenate([[0], np.cumsum(lens)[:-1]])
    buf = np.frombuffer(b"".join(texts), dtype=np.uint8).astype(np.uint16)
    return buf, offs, lens


def generate(out_dir: str | os.PathLike, n_tokens: int = 1_000_000, seed: int = 0,
             seq_len: int = 128) -> Index:
    """Write ``n_tokens`` tokens of the synthetic corpus to ``out_dir``; returns the index."""
    if n_tokens < 2:
        raise ValueError(f"n_tokens must be at least 2, got {n_tokens}")
    buf, offs, lens = _pool(seed)
    eos_slot = -1
    writer = TokenWriter(Path(out_dir), 257)
    try:
        slot = 0
        while writer.n_tokens < n_tokens:
            # Every slot is hashed by its global position: output is independent of chunking.
            n_slots = min(_CHUNK_SLOTS, (n_tokens - writer.n_tokens) // 16 + 16)
            t = np.arange(slot, slot + n_slots, dtype=np.uint64)
            pick = (hash64(seed, 0x5E, t) % np.uint64(_POOL)).astype(np.int64)
            # A slot is an end of document with p = 1/8, never twice in a row.
            is_eos = hash64(seed, 0xD0, t) % np.uint64(8) == 0
            prev = np.concatenate([[slot > 0 and bool(hash64(seed, 0xD0, t[:1] - 1)[0] % 8 == 0)],
                                   is_eos[:-1]])
            is_eos &= ~prev
            pick[is_eos] = eos_slot
            n = np.where(is_eos, 1, lens[pick])
            starts = np.where(is_eos, 0, offs[pick])
            total = int(n.sum())
            base = np.repeat(np.cumsum(n) - n, n)
            src = np.repeat(starts, n) + (np.arange(total) - base)
            chunk = buf[src]
            chunk[np.repeat(is_eos, n)] = BYTE_EOS
            need = n_tokens - writer.n_tokens
            chunk = chunk[:need]
            writer.write(chunk)
            writer.n_documents += int(np.count_nonzero(chunk == BYTE_EOS))
            slot += n_slots
        return writer.finish(tokenizer="byte", eos_id=BYTE_EOS, seq_len=seq_len,
                             sources=[f"generated:ceaseless-corpus-v1:seed={seed}"])
    except BaseException:
        writer.abort()
        raise


CACHE_ENV = "CEASELESS_CACHE_DIR"


def cache_root() -> Path:
    """``$CEASELESS_CACHE_DIR``, else ``$XDG_CACHE_HOME/ceaseless``, else ``~/.cache/ceaseless``."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "ceaseless"


def cached(n_tokens: int = 2_000_000, seed: int = 0, seq_len: int = 128) -> Path | None:
    """The generated corpus in the user's cache, written once (2M tokens take ~2.5 s on a
    small machine, paid by every ``ceaseless up`` before this). The output is a pure function
    of the arguments, so a finished directory is reused as it is; it is built in a private
    directory and renamed into place, so concurrent callers never see half of one.
    None if the cache is not writable (the caller generates into its own directory)."""
    root = cache_root()
    final = root / f"corpus-v1-n{n_tokens}-s{seed}-l{seq_len}"
    if (final / "index.json").exists() and (final / "tokens.bin").exists():
        return final
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".corpus-", dir=root))
    except OSError:
        return None
    try:
        generate(tmp / "c", n_tokens=n_tokens, seed=seed, seq_len=seq_len)
        try:
            os.rename(tmp / "c", final)
        except OSError:
            if not (final / "index.json").exists():  # not a lost race: something else
                raise
        return final
    except OSError:
        return None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ensure(fallback: str | os.PathLike, n_tokens: int = 2_000_000, seed: int = 0) -> Path:
    """The corpus directory to train on: the cached one, else generated into ``fallback``."""
    hit = cached(n_tokens=n_tokens, seed=seed)
    if hit is not None:
        return hit
    out = Path(fallback)
    if not (out / "index.json").exists():
        generate(out, n_tokens=n_tokens, seed=seed)
    return out
