"""Turn raw text into a prepared data directory (``tokens.bin`` + ``index.json``).

Inputs, in the order given (a directory is expanded to its supported files, sorted):

* ``*.txt`` (any other suffix is read as text too): the whole file is one document;
* ``*.jsonl`` / ``*.jsonl.gz`` / ``*.json.gz``: one JSON object per line, its ``text``
  field (``text_field``) is one document; blank lines are skipped;
* ``*.parquet``, ``*.arrow`` / ``*.feather`` / ``*.ipc`` (needs ``pyarrow``): the
  ``text`` column, one document per row.

Each document is tokenised and followed by the tokenizer's EOS token (when it has one).
The byte tokenizer (default) maps UTF-8 bytes to 0..255 and uses 256 as EOS (vocab 257).
A ``tokenizer.json`` path uses the Hugging Face ``tokenizers`` library.
"""

from __future__ import annotations

import datetime as _dt
import gzip
import hashlib
import io
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from .format import (
    TOKENS_FILE,
    DataError,
    Index,
    _unlink,
    dtype_for_vocab,
    numpy_dtype,
    write_index,
)

BYTE_EOS = 256
_TEXT_SUFFIXES = (".txt", ".text", ".md")
_JSONL_SUFFIXES = (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz", ".json.gz")
_ARROW_SUFFIXES = (".parquet", ".arrow", ".feather", ".ipc")
_SUPPORTED = _TEXT_SUFFIXES + _JSONL_SUFFIXES + _ARROW_SUFFIXES
_BATCH_DOCS = 1024
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]", "<|im_end|>")


# --------------------------------------------------------------------------------------
# Tokenizers


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, EOS = 256; vocab 257."""

    id = "byte"
    vocab_size = 257
    eos_id = BYTE_EOS

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8", "surrogatepass"), dtype=np.uint8) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", "replace")


class HFTokenizer:
    """A local ``tokenizer.json`` through the ``tokenizers`` library."""

    def __init__(self, path: str | os.PathLike):
        path = Path(path)
        if not path.is_file():
            raise DataError(f"{path}: tokenizer file not found")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DataError(
                f"{path}: a tokenizer.json needs the `tokenizers` package: "
                "pip install 'ceaseless[tokenizers]' (or pip install 'tokenizers>=0.15')"
            ) from None
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # the library raises bare Exceptions
            raise DataError(f"{path}: not a loadable tokenizer.json ({exc})") from None
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        self.id = f"hf:{path.name}:{digest}"
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.eos_id = None
        for cand in _EOS_CANDIDATES:
            tid = self._tok.token_to_id(cand)
            if tid is not None:
                self.eos_id = int(tid)
                break

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encs = self._tok.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encs]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids])


def load_tokenizer(spec: str | os.PathLike | None = "byte"):
    if spec in (None, "byte", "bytes"):
        return ByteTokenizer()
    if isinstance(spec, str) and spec.startswith("hf:"):
        raise DataError(f"tokenizer {spec!r}: pass the path of the tokenizer.json, not its id")
    return HFTokenizer(spec)


# --------------------------------------------------------------------------------------
# Readers: each yields documents (str)


def _suffix(path: Path) -> str:
    name = path.name.lower()
    for s in sorted(_SUPPORTED, key=len, reverse=True):
        if name.endswith(s):
            return s
    return path.suffix.lower()


def expand_inputs(inputs: Iterable[str | os.PathLike]) -> list[Path]:
    out: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            found = sorted(
                q for q in p.rglob("*") if q.is_file() and _suffix(q) in _SUPPORTED
            )
            if not found:
                raise DataError(f"{p}: directory holds no supported input files ({', '.join(_SUPPORTED)})")
            out.extend(found)
        elif p.is_file():
            out.append(p)
        else:
            raise DataError(f"{p}: input not found")
    if not out:
        raise DataError("no inputs given")
    return out


def _read_text(path: Path) -> Iterator[str]:
    try:
        yield path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc})") from None


def _read_jsonl(path: Path, text_field: str) -> Iterator[str]:
    gz = path.name.lower().endswith(".gz")
    try:
        raw = gzip.open(path, "rb") if gz else open(path, "rb")
        with raw, io.TextIOWrapper(raw, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
                if not isinstance(obj, dict) or text_field not in obj:
                    raise DataError(f"{path}:{lineno}: record has no {text_field!r} field")
                text = obj[text_field]
                if not isinstance(text, str):
                    raise DataError(f"{path}:{lineno}: {text_field!r} is {type(text).__name__}, not a string")
                yield text
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        if isinstance(exc, DataError):
            raise
        raise DataError(f"{path}: unreadable ({exc})") from None


def _pyarrow():
    try:
        import pyarrow  # noqa: F401
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise DataError(
            "Parquet/Arrow input needs the `pyarrow` package: pip install 'ceaseless[arrow]' "
            "(or pip install 'pyarrow>=14')"
        ) from None
    return pyarrow


def _read_arrow(path: Path, text_field: str) -> Iterator[str]:
    pa = _pyarrow()

    def column_batches():
        if _suffix(path) == ".parquet":
            pf = pa.parquet.ParquetFile(path)
            if text_field not in pf.schema_arrow.names:
                raise DataError(f"{path}: no {text_field!r} column (columns: {pf.schema_arrow.names})")
            for b in pf.iter_batches(batch_size=_BATCH_DOCS, columns=[text_field]):
                yield b.column(0)
            return
        src = pa.memory_map(str(path), "r")
        try:
            reader = pa.ipc.open_file(src)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            schema = reader.schema
        except pa.ArrowInvalid:
            src.seek(0)
            reader = pa.ipc.open_stream(src)  # Hugging Face datasets write the stream format
            batches = iter(reader)
            schema = reader.schema
        if text_field not in schema.names:
            raise DataError(f"{path}: no {text_field!r} column (columns: {schema.names})")
        for b in batches:
            yield b.column(text_field)

    try:
        for col in column_batches():
            for v in col.to_pylist():
                if v is not None:
                    yield v
    except pa.ArrowException as exc:
        raise DataError(f"{path}: unreadable Arrow/Parquet ({exc})") from None


def read_documents(path: Path, text_field: str = "text") -> Iterator[str]:
    s = _suffix(path)
    if s in _JSONL_SUFFIXES:
        return _read_jsonl(path, text_field)
    if s in _ARROW_SUFFIXES:
        return _read_arrow(path, text_field)
    return _read_text(path)


def _batched(it: Iterable[str], n: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for x in it:
        batch.append(x)
        if len(batch) >= n:
            yield batch
            batch = []
    if batch:
        yield batch


# --------------------------------------------------------------------------------------
# Writer


class TokenWriter:
    """Streams token arrays into ``tokens.bin`` (via a temp file), hashing as it goes."""

    def __init__(self, out_dir: str | os.PathLike, vocab_size: int):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.vocab_size = vocab_size
        self.dtype = dtype_for_vocab(vocab_size)
        self._np = numpy_dtype(self.dtype)
        self._tmp = self.out_dir / f".{TOKENS_FILE}.{os.getpid()}.tmp"
        self._f = open(self._tmp, "wb")
        self._h = hashlib.sha256()
        self.n_tokens = 0
        self.n_documents = 0
        self.max_token = -1

    def write(self, ids: np.ndarray, *, where: str = "") -> None:
        if ids.size == 0:
            return
        top = int(ids.max())
        if top >= self.vocab_size or int(ids.min()) < 0:
            raise DataError(f"{where or 'input'}: token {top} outside vocab 0..{self.vocab_size - 1}")
        self.max_token = max(self.max_token, top)
        buf = np.ascontiguousarray(ids, dtype=self._np).tobytes()
        self._f.write(buf)
        self._h.update(buf)
        self.n_tokens += ids.size

    def finish(self, **fields) -> Index:
        self._f.close()
        os.replace(self._tmp, self.out_dir / TOKENS_FILE)
        index = Index(
            dtype=self.dtype,
            n_tokens=self.n_tokens,
            vocab_size=self.vocab_size,
            sha256=self._h.hexdigest(),
            n_documents=self.n_documents,
            max_token=self.max_token,
            created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            **fields,
        )
        write_index(self.out_dir, index)
        return index

    def abort(self) -> None:
        self._f.close()
        _unlink(self._tmp)


def prepare(
    inputs: Iterable[str | os.PathLike] | str | os.PathLike,
    out_dir: str | os.PathLike,
    tokenizer: str | os.PathLike = "byte",
    seq_len: int = 256,
    *,
    text_field: str = "text",
) -> Index:
    """Tokenise ``inputs`` into ``out_dir``; returns the written :class:`Index`."""
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    if seq_len <= 0:
        raise DataError(f"seq_len must be positive, got {seq_len}")
    files = expand_inputs(inputs)
    tok = load_tokenizer(tokenizer)
    writer = TokenWriter(out_dir, tok.vocab_size)
    eos = None if tok.eos_id is None else np.array([tok.eos_id], dtype=np.int64)
    try:
        for path in files:
            for docs in _batched(read_documents(path, text_field), _BATCH_DOCS):
                encoded = tok.encode_batch(docs)
                parts: list[np.ndarray] = []
                for ids in encoded:
                    parts.append(ids.astype(np.int64, copy=False))
                    if eos is not None:
                        parts.append(eos)
                if parts:
                    writer.write(np.concatenate(parts), where=str(path))
                writer.n_documents += len(docs)
        if writer.n_tokens < 2:
            raise DataError(f"inputs hold {writer.n_tokens} token(s); need at least 2")
        return writer.finish(
            tokenizer=tok.id, eos_id=tok.eos_id, seq_len=seq_len, sources=[str(p) for p in files]
        )
    except BaseException:
        writer.abort()
        raise
