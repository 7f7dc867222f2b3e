"""Preparation, format checks, corpus and CLI of agent.data."""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys

import numpy as np
import pytest
import torch

from agent.data import DataError, TokenDataset, generate, prepare, read_index
from agent.data.format import INDEX_FILE, TOKENS_FILE, sha256_file
from agent.data.prepare import BYTE_EOS, ByteTokenizer, TokenWriter

DOCS = ["hello world\n", "ünïcödé ☃ text", "third document, a bit longer than the others."]


@pytest.fixture(autouse=True)
def _node_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CEASELESS_DATA_CACHE", str(tmp_path / "node-cache"))


def _expected(docs):
    out = []
    for d in docs:
        out.extend(d.encode())
        out.append(BYTE_EOS)
    return out


def _tokens(d):
    idx = read_index(d)
    return np.fromfile(d / TOKENS_FILE, dtype=idx.np_dtype).tolist()


def _write_inputs(tmp_path):
    (tmp_path / "a.txt").write_text(DOCS[0])
    with open(tmp_path / "b.jsonl", "w") as f:
        for d in DOCS:
            f.write(json.dumps({"text": d, "id": 1}) + "\n\n")
    with gzip.open(tmp_path / "c.jsonl.gz", "wt") as f:
        for d in DOCS[::-1]:
            f.write(json.dumps({"text": d}) + "\n")


def test_prepare_txt_jsonl_gz_round_trip(tmp_path):
    _write_inputs(tmp_path)
    out = tmp_path / "out"
    index = prepare([tmp_path / "a.txt", tmp_path / "b.jsonl", tmp_path / "c.jsonl.gz"], out, seq_len=8)
    docs = [DOCS[0], *DOCS, *DOCS[::-1]]
    assert _tokens(out) == _expected(docs)
    assert index.n_documents == 7 and index.dtype == "uint16" and index.vocab_size == 257
    assert index.tokenizer == "byte" and index.seq_len == 8 and index.format_version == 1
    assert index.sha256 == sha256_file(out / TOKENS_FILE)
    raw = json.loads((out / INDEX_FILE).read_text())
    for key in ("dtype", "n_tokens", "vocab_size", "tokenizer", "seq_len", "sha256", "format_version"):
        assert key in raw
    # decode round trip, document by document
    toks = np.array(_tokens(out))
    cuts = np.flatnonzero(toks == BYTE_EOS)
    starts = np.concatenate([[0], cuts[:-1] + 1])
    assert [ByteTokenizer().decode(toks[a:b]) for a, b in zip(starts, cuts)] == docs
    # a directory input expands to its supported files, sorted
    out2 = tmp_path / "out2"
    (tmp_path / "ignored.bin").write_bytes(b"\x00")
    (tmp_path / "out").rename(tmp_path / "prepared")  # not an input
    srcdir = tmp_path / "src"
    srcdir.mkdir()
    for name in ("a.txt", "b.jsonl", "c.jsonl.gz"):
        (tmp_path / name).rename(srcdir / name)
    prepare([srcdir], out2)
    assert _tokens(out2) == _expected(docs)
    ds = TokenDataset(out2, 8)
    x, y = ds[0]
    assert x.tolist() == _expected(docs)[:8] and y.tolist() == _expected(docs)[1:9]


def test_prepare_bad_inputs(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": 3}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: 'text' is int"):
        prepare([tmp_path / "bad.jsonl"], tmp_path / "o")
    (tmp_path / "bad2.jsonl").write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(DataError, match=r"bad2\.jsonl:2: not valid JSON"):
        prepare([tmp_path / "bad2.jsonl"], tmp_path / "o")
    (tmp_path / "nofield.jsonl").write_text('{"body": "ok"}\n')
    with pytest.raises(DataError, match="no 'text' field"):
        prepare([tmp_path / "nofield.jsonl"], tmp_path / "o")
    (tmp_path / "bad.jsonl.gz").write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match=r"bad\.jsonl\.gz: unreadable"):
        prepare([tmp_path / "bad.jsonl.gz"], tmp_path / "o")
    with pytest.raises(DataError, match="input not found"):
        prepare([tmp_path / "missing.txt"], tmp_path / "o")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "e2").mkdir()
    with pytest.raises(DataError, match="need at least 2"):
        prepare([tmp_path / "empty.txt"], tmp_path / "e2")
    assert not (tmp_path / "e2" / TOKENS_FILE).exists()  # nothing half-written
    assert not list((tmp_path / "e2").glob("*.tmp"))


def test_prepare_parquet_and_arrow(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"text": DOCS, "n": [1, 2, 3]})
    pq.write_table(table, tmp_path / "d.parquet")
    with pa.OSFile(str(tmp_path / "d.arrow"), "wb") as sink:  # IPC stream (HF datasets style)
        with pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
    with pa.OSFile(str(tmp_path / "f.feather"), "wb") as sink:  # IPC file format
        with pa.ipc.new_file(sink, table.schema) as w:
            w.write_table(table)
    prepare([tmp_path / "d.parquet", tmp_path / "d.arrow", tmp_path / "f.feather"], tmp_path / "o")
    assert _tokens(tmp_path / "o") == _expected(DOCS * 3)
    with pytest.raises(DataError, match="no 'body' column"):
        prepare([tmp_path / "d.parquet"], tmp_path / "o2", text_field="body")


def test_parquet_without_pyarrow_says_install(tmp_path, monkeypatch):
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(DataError, match=r"needs the `pyarrow` package: pip install 'ceaseless\[arrow\]'"):
        prepare([tmp_path / "d.parquet"], tmp_path / "o")


def test_tokenizer_json_without_tokenizers_says_install(tmp_path, monkeypatch):
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "a.txt").write_text("hello")
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(DataError, match=r"needs the `tokenizers` package: pip install 'ceaseless\[tokenizers\]'"):
        prepare([tmp_path / "a.txt"], tmp_path / "o", tokenizer=tmp_path / "tokenizer.json")
    assert not (tmp_path / "o" / TOKENS_FILE).exists()


def test_hf_tokenizer_json(tmp_path, monkeypatch):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "</s>": 1, "hello": 2, "world": 3, "text": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.jsonl").write_text('{"text": "hello world"}\n{"text": "text foo"}\n')
    index = prepare([tmp_path / "a.jsonl"], tmp_path / "o", tokenizer=tmp_path / "tokenizer.json")
    assert _tokens(tmp_path / "o") == [2, 3, 1, 4, 0, 1]
    assert index.vocab_size == 5 and index.eos_id == 1 and index.tokenizer.startswith("hf:tokenizer.json:")
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(DataError, match="needs the `tokenizers` package"):
        prepare([tmp_path / "a.jsonl"], tmp_path / "o3", tokenizer=tmp_path / "tokenizer.json")
    with pytest.raises(DataError, match="tokenizer file not found"):
        prepare([tmp_path / "a.jsonl"], tmp_path / "o3", tokenizer=tmp_path / "nope.json")


def test_uint32_for_large_vocab(tmp_path):
    w = TokenWriter(tmp_path, 70_000)
    w.write(np.array([1, 69_999, 65_536, 5]))
    w.finish(tokenizer="test", seq_len=2)
    ds = TokenDataset(tmp_path, 2)
    assert ds.index.dtype == "uint32" and ds.tokens.dtype == np.uint32
    x, y = ds.batch(np.array([0]))
    assert x.tolist() == [[1, 69_999]] and y.tolist() == [[69_999, 65_536]]
    with pytest.raises(DataError, match="outside vocab"):
        TokenWriter(tmp_path / "w", 10).write(np.array([3, 10]))


# ---- corruption -----------------------------------------------------------------------


@pytest.fixture
def good(tmp_path):
    d = tmp_path / "good"
    generate(d, n_tokens=5_000, seed=1, seq_len=16)
    return d


def _rewrite_index(d, **changes):
    raw = json.loads((d / INDEX_FILE).read_text())
    raw.update(changes)
    (d / INDEX_FILE).write_text(json.dumps(raw))


def test_truncated_file_refused(good):
    path = good / TOKENS_FILE
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 1)
    with pytest.raises(DataError, match=r"tokens\.bin: truncated or corrupt: size 9999 bytes is not a multiple of 2"):
        TokenDataset(good)


def test_index_not_matching_data_refused(good):
    with open(good / TOKENS_FILE, "ab") as f:
        f.write(b"\x00\x00")
    with pytest.raises(DataError, match=r"does not match .*index\.json: index says 5000 uint16 tokens .* has 5001"):
        TokenDataset(good)


def test_hash_mismatch_refused_and_marker_is_keyed_by_mtime(good):
    TokenDataset(good)  # first open on this "node": full hash, marker written
    assert not TokenDataset(good).verified_now  # marker hit
    path = good / TOKENS_FILE
    data = bytearray(path.read_bytes())
    data[100] ^= 0x01  # still a valid byte token: only the hash can tell
    path.write_bytes(bytes(data))
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    with pytest.raises(DataError, match=r"tokens\.bin: content hash mismatch"):
        TokenDataset(good)
    TokenDataset(good, verify="size")  # opt-out: only size + max checks
    with pytest.raises(DataError, match="content hash mismatch"):
        TokenDataset(good, verify="full")


def test_token_out_of_vocab_refused(good):
    path = good / TOKENS_FILE
    arr = np.fromfile(path, dtype=np.uint16)
    arr[1234] = 300
    arr.tofile(path)
    _rewrite_index(good, sha256=sha256_file(path))  # consistent hash: only the max check catches it
    with pytest.raises(DataError, match=r"tokens\.bin: token 300 >= vocab_size 257 \(first bad token at position 1234\)"):
        TokenDataset(good)
    _rewrite_index(good, vocab_size=200)
    with pytest.raises(DataError, match="max_token 256 >= vocab_size 200"):
        TokenDataset(good)


def test_sample_longer_than_data_refused(good):
    with pytest.raises(DataError, match=r"seq_len \+ 1 = 5001 tokens but the data has only 5000"):
        TokenDataset(good, seq_len=5000)
    TokenDataset(good, seq_len=4999)


def test_index_problems_refused(good, tmp_path):
    with pytest.raises(DataError, match="no such data directory"):
        TokenDataset(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"index\.json: missing"):
        TokenDataset(tmp_path / "empty")
    _rewrite_index(good, format_version=99)
    with pytest.raises(DataError, match="format_version 99 is not supported"):
        TokenDataset(good)
    (good / INDEX_FILE).write_text("{not json")
    with pytest.raises(DataError, match="unreadable index"):
        TokenDataset(good)


def test_missing_token_file_refused(good):
    os.unlink(good / TOKENS_FILE)
    with pytest.raises(DataError, match="token file missing"):
        TokenDataset(good)


# ---- dataset --------------------------------------------------------------------------


def test_dataset_samples_and_batch(good):
    ds = TokenDataset(good, 16)
    toks = np.fromfile(good / TOKENS_FILE, dtype=np.uint16)
    assert len(ds) == (5000 - 1) // 16
    x, y = ds[3]
    assert x.tolist() == toks[48:64].tolist() and y.tolist() == toks[49:65].tolist()
    idx = np.array([len(ds) - 1, 0, 3, 3])
    bx, by = ds.batch(idx)
    assert bx.dtype == torch.int64 and bx.shape == (4, 16) and bx.is_contiguous() and by.is_contiguous()
    assert torch.equal(bx[2], x) and torch.equal(by[3], y)
    raw = ds.raw(3)
    assert raw.dtype == torch.uint16 and raw.shape == (17,)
    assert np.shares_memory(ds.window(3), ds.tokens)  # zero copy
    with pytest.raises(IndexError):
        ds.batch(np.array([len(ds)]))
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_dataset_pickles_without_copying_data(good):
    import pickle

    ds = TokenDataset(good, 16)
    blob = pickle.dumps(ds)
    assert len(blob) < 5_000
    ds2 = pickle.loads(blob)
    assert torch.equal(ds2.batch(np.arange(5))[0], ds.batch(np.arange(5))[0])


def test_cache_to_shm_copies_once_by_hash(good, tmp_path):
    shm = tmp_path / "shm"
    a = TokenDataset(good, 16, cache_to_shm=True, shm_dir=shm)
    assert a.path.parent == shm and a.index.sha256 in a.path.name and a.verified_now
    mtime = a.path.stat().st_mtime_ns
    b = TokenDataset(good, 16, cache_to_shm=True, shm_dir=shm)
    assert b.path == a.path and b.path.stat().st_mtime_ns == mtime and not b.verified_now
    assert torch.equal(a.batch(np.arange(10))[0], TokenDataset(good, 16).batch(np.arange(10))[0])
    assert not list(shm.glob("*.tmp"))


def test_cache_to_shm_refuses_corrupt_source(good, tmp_path):
    path = good / TOKENS_FILE
    data = bytearray(path.read_bytes())
    data[7] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match="content hash mismatch"):
        TokenDataset(good, 16, cache_to_shm=True, shm_dir=tmp_path / "shm")
    assert not list((tmp_path / "shm").iterdir()) or all(p.suffix == ".lock" for p in (tmp_path / "shm").iterdir())


# ---- corpus ---------------------------------------------------------------------------


def test_corpus_deterministic(tmp_path):
    a = generate(tmp_path / "a", 30_000, seed=3)
    b = generate(tmp_path / "b", 30_000, seed=3)
    c = generate(tmp_path / "c", 30_000, seed=4)
    assert a.sha256 == b.sha256 != c.sha256
    assert a.n_tokens == 30_000 and a.n_documents > 10
    text = ByteTokenizer().decode(_tokens(tmp_path / "a")[:2000])
    assert " plus " in text and " has " in text and "the " in text


def test_corpus_is_learnable(tmp_path):
    """Even a bigram model's loss drops well below ln(257) in a few dozen steps."""
    generate(tmp_path, 100_000, seed=0, seq_len=64)
    ds = TokenDataset(tmp_path, 64)
    order = ds.global_order(16, seed=0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(257, 32), torch.nn.Linear(32, 257))
    opt = torch.optim.Adam(model.parameters(), lr=3e-2)
    losses = []
    for step in range(40):
        x, y = ds.batch(order.step_indices(step))
        loss = torch.nn.functional.cross_entropy(model(x).view(-1, 257), y.view(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 5.0 and min(losses[-5:]) < 3.0, losses


# ---- CLI ------------------------------------------------------------------------------


def _cli(argv):
    from ops.cli_data import register

    parser = argparse.ArgumentParser(prog="ceaseless")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_generate_info_prepare(tmp_path, capsys):
    assert _cli(["data", "generate", "--out", str(tmp_path / "g"), "--tokens", "20000", "--seed", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["n_tokens"] == 20000
    assert _cli(["data", "info", str(tmp_path / "g"), "--verify", "--global-batch-size", "8"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["n_tokens"] == 20000 and info["samples"] == (20000 - 1) // 128 and "sha256" in info["checks"]
    assert info["steps_per_epoch"] == info["samples"] // 8
    (tmp_path / "a.txt").write_text("some text to prepare")
    assert _cli(["data", "prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "p"), "--seq-len", "4"]) == 0
    assert read_index(tmp_path / "p").seq_len == 4
    capsys.readouterr()
    with open(tmp_path / "g" / TOKENS_FILE, "ab") as f:
        f.write(b"\x01")
    assert _cli(["data", "info", str(tmp_path / "g")]) == 2
    assert "truncated or corrupt" in capsys.readouterr().err
    assert _cli(["data", "prepare", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "q")]) == 2
    assert "input not found" in capsys.readouterr().err


def test_corpus_cache_is_built_once_and_falls_back(tmp_path, monkeypatch):
    from agent.data import corpus

    monkeypatch.setenv(corpus.CACHE_ENV, str(tmp_path / "cache"))
    a = corpus.cached(n_tokens=5000, seed=3)
    assert a is not None and a.parent == tmp_path / "cache"
    first = (a / "tokens.bin").stat().st_mtime_ns
    assert corpus.cached(n_tokens=5000, seed=3) == a                  # reused, not rebuilt
    assert (a / "tokens.bin").stat().st_mtime_ns == first
    assert corpus.cached(n_tokens=5000, seed=4) != a                  # keyed on its arguments
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")]
    fresh = tmp_path / "fresh"
    corpus.generate(fresh, n_tokens=5000, seed=3)
    assert (fresh / "tokens.bin").read_bytes() == (a / "tokens.bin").read_bytes()
    # an unwritable cache: generated into the caller's directory instead
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(corpus.CACHE_ENV, str(blocker / "cache"))
    assert corpus.cached(n_tokens=5000, seed=3) is None
    out = corpus.ensure(tmp_path / "own", n_tokens=5000, seed=3)
    assert out == tmp_path / "own" and (out / "tokens.bin").read_bytes() == fresh.joinpath(
        "tokens.bin").read_bytes()
