"""The language-model data sets: data=shakespeare_char (nanoGPT's split and vocabulary, the corpus fetched and
checked) and data=tokens (nanoGPT's .bin layout), and their windows: x = window[:-1], y = window[1:], every
target of a split once per epoch over the ranks."""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import re
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from runner.data import shakespeare_char, tokens
from runner.data.shakespeare_char import SHA256, SIZE, URL, ShakespeareCharConfig, cache_folder
from runner.data.tokens import TokensConfig
from tests.conftest import ROOT, checked_config

#: The real corpus, on the test machines (../shared/data/README.md); users' machines fetch it from URL.
CORPUS = ROOT.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"
needs_corpus = pytest.mark.skipif(
    not CORPUS.is_file(), reason=f"no {CORPUS} (the shared data folder of the test machines) to read"
)
LM = ["model=gpt", "task=language_model"]


@pytest.fixture(autouse=True)
def no_network(monkeypatch, tmp_path):
    """No test reaches the network or the user's cache: fetching fails unless a test says otherwise."""

    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network here")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    monkeypatch.setenv("MPITRAIN_CACHE", str(tmp_path / "cache"))


def windows_of(data, indices: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    x, y = data.__getitems__(indices)
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (len(indices), data.block_size)
    return x.tolist(), y.tolist()


@needs_corpus
def test_shakespeare_char_splits_and_windows_like_nanogpt():
    text = CORPUS.read_text(encoding="utf-8")
    cfg = ShakespeareCharConfig(root=str(CORPUS.parent))
    assert cfg.shape == [64] and cfg.vocab_size == cfg.num_classes == 65 and cfg.workers == 0
    vocabulary = cfg.vocabulary()
    assert vocabulary == sorted(set(text)) and len(vocabulary) == 65, "the training split has them all"
    data = cfg.build()
    assert data.shape == (64,) and data.num_classes == 65 and data.classes == vocabulary
    train, val = data.train, data.val
    assert (len(train.tokens), len(val.tokens)) == (1_003_854, 111_540), "nanoGPT's int(n * 0.9)"
    assert (len(train), len(val)) == (1_003_853 // 64, 111_539 // 64)
    assert (
        cfg.decode(train.tokens[:200]) == text[:200]
        and cfg.decode(val.tokens[:200]) == text[1_003_854:][:200]
    )
    assert (
        cfg.decode(val.tokens[-50:]) == text[-50:] and cfg.encode(text[:300]) == train.tokens[:300].tolist()
    )
    for split, offset in ((train, 0), (val, 1_003_854)):
        last = len(split) - 1
        xs, ys = windows_of(split, [last, 0, 7])
        for i, x, y in zip([last, 0, 7], xs, ys, strict=True):
            start = offset + i * 64
            assert cfg.decode(x) == text[start : start + 64] and cfg.decode(y) == text[start + 1 : start + 65]
    assert train[3][1][-1] == train[4][0][0], "consecutive windows share one token"
    with pytest.raises(ValueError, match="outside the vocabulary.*'é'"):
        cfg.encode("café")


@needs_corpus
def test_shakespeare_char_composes_its_outputs_through_hydra():
    cfg = checked_config(["data=shakespeare_char", f"data.root={CORPUS.parent}", *LM])
    assert cfg.data.shape == [64] and cfg.data.vocab_size == 65 and cfg.data.num_classes == 65
    assert cfg.model.input_shape == [64] and cfg.model.vocab_size == 65
    cfg = checked_config(["data=shakespeare_char", f"data.root={CORPUS.parent}", "data.block_size=32", *LM])
    assert cfg.data.shape == cfg.model.input_shape == [32]
    with pytest.raises(
        ValueError, match=r"data\.vocab_size=64 is invalid: .*input\.txt has a vocabulary of 65"
    ):
        checked_config(["data=shakespeare_char", f"data.root={CORPUS.parent}", "data.vocab_size=64", *LM])
    with pytest.raises(
        ValueError, match=r"data\.shape=\[32\] is invalid: a window is \[block_size\] = \[64\]"
    ):
        checked_config(["data=shakespeare_char", f"data.root={CORPUS.parent}", "data.shape=[32]", *LM])


def test_a_corrupted_corpus_is_refused_naming_data_root_and_the_url(tmp_path):
    (tmp_path / "input.txt").write_bytes(b"x" * SIZE)  # the right size: its sha256 tells
    refusal = rf"data\.root='{tmp_path}' is invalid: .*input\.txt is not the tinyshakespeare corpus.*"
    with pytest.raises(ValueError, match=refusal + re.escape(URL)) as refused:
        checked_config(["data=shakespeare_char", f"data.root={tmp_path}", *LM])
    assert "\n" not in str(refused.value), "one line"
    misses = shakespeare_char._sha256.cache_info().misses
    for _ in range(3):
        with pytest.raises(ValueError, match="sha256 " + SHA256):
            ShakespeareCharConfig(root=str(tmp_path))
    assert shakespeare_char._sha256.cache_info().misses == misses, "hashed once per version of the file"
    (tmp_path / "input.txt").write_text("too short\n")
    with pytest.raises(ValueError, match=r"10 bytes; expected 1115394 bytes"):
        ShakespeareCharConfig(root=str(tmp_path))


def test_no_network_says_what_to_download_where(tmp_path):
    where = tmp_path / "cache" / "shakespeare_char" / "input.txt"
    with pytest.raises(ValueError) as refused:
        checked_config(["data=shakespeare_char", *LM])
    told = str(refused.value)
    assert told.startswith("data.root=null is invalid: ") and "\n" not in told, told
    assert f"fetching it failed (<urlopen error no network here>): download {URL} to {where}" in told, told
    assert not where.parent.exists() or not list(where.parent.iterdir()), "nothing written"


@needs_corpus
def test_the_corpus_is_fetched_checked_and_written_atomically(monkeypatch, tmp_path, capsys):
    body = CORPUS.read_bytes()
    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout: io.BytesIO(body[:-1] + b"?"))
    with pytest.raises(ValueError, match=f"gave {SIZE} bytes that are not the corpus: download"):
        ShakespeareCharConfig()
    assert not list(tmp_path.rglob("*input.txt*")), "a wrong download is not kept"
    asked = []
    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout: asked.append(url) or io.BytesIO(body))
    cfg = ShakespeareCharConfig()
    where = tmp_path / "cache" / "shakespeare_char" / "input.txt"
    assert asked == [URL] and f"saved {URL} to {where}" in capsys.readouterr().out
    assert [p.name for p in where.parent.iterdir()] == ["input.txt"] and cfg.vocab_size == 65
    assert hashlib.sha256(where.read_bytes()).hexdigest() == SHA256
    ShakespeareCharConfig()
    assert asked == [URL], "fetched once"


def test_the_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    assert cache_folder() == tmp_path / "cache" / "shakespeare_char"
    monkeypatch.delenv("MPITRAIN_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    assert cache_folder() == Path("/xdg/mpitrain/shakespeare_char")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_folder() == Path.home() / ".cache" / "mpitrain" / "shakespeare_char"


def test_a_text_of_ones_own(tmp_path):
    own = tmp_path / "own.txt"
    own.write_text("abcd" * 45 + "dcba" * 5, encoding="utf-8")  # 200 characters: 180 train, 20 validate
    cfg = ShakespeareCharConfig(file=str(own), block_size=8)
    assert cfg.vocabulary() == ["a", "b", "c", "d"] and cfg.vocab_size == cfg.num_classes == 4
    data = cfg.build()
    assert (len(data.train), len(data.val)) == (179 // 8, 19 // 8)
    xs, ys = windows_of(data.val, [1, 0])
    assert cfg.decode(xs[0]) == "dcbadcba" and cfg.decode(ys[0]) == "cbadcbad"
    checked = checked_config(["data=shakespeare_char", f"data.file={own}", "data.block_size=8", *LM])
    assert checked.data.vocab_size == checked.model.vocab_size == 4 and checked.data.shape == [8]
    own.write_text("abcd" * 45 + "abcé" * 5, encoding="utf-8")
    with pytest.raises(
        ValueError, match=r"file=.*own\.txt.*validation split .*\('é'\), outside the vocabulary"
    ):
        ShakespeareCharConfig(file=str(own), block_size=8)
    with pytest.raises(ValueError, match=r"data\.file=.*nowhere\.txt' is invalid: no such file"):
        checked_config(["data=shakespeare_char", f"data.file={tmp_path / 'nowhere.txt'}", *LM])
    with pytest.raises(ValueError, match="root=.*data.file gives the text: leave data.root unset"):
        ShakespeareCharConfig(file=str(own), root=str(tmp_path))
    own.write_text("abcd" * 45 + "abcd" * 5, encoding="utf-8")
    with pytest.raises(
        ValueError, match=r"block_size=64 .*validation split of .*own\.txt \(its last 10%\) has 20"
    ):
        ShakespeareCharConfig(file=str(own))
    own.write_bytes(b"\xff\xfe" * 200)
    with pytest.raises(ValueError, match=r"file=.*own\.txt is not UTF-8 text"):
        ShakespeareCharConfig(file=str(own))


def write_tokens(root: Path, ids: np.ndarray, val: np.ndarray, meta: dict | None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    ids.tofile(root / "train.bin")
    val.tofile(root / "val.bin")
    if meta is not None:
        (root / "meta.json").write_text(json.dumps(meta))
    return root


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_tokens_round_trip(tmp_path, dtype):
    top = 70_000 if dtype == "uint32" else 60_000  # beyond uint16 for uint32
    ids = np.random.default_rng(0).integers(0, top, 1000).astype(dtype)
    root = write_tokens(tmp_path / "corpus", ids, ids[:100], {"vocab_size": top})
    cfg = checked_config(
        ["data=tokens", f"data.root={root}", f"data.dtype={dtype}", "data.block_size=16", *LM]
    )
    assert cfg.data.vocab_size == cfg.data.num_classes == cfg.model.vocab_size == top
    assert cfg.data.shape == cfg.model.input_shape == [16] and cfg.data.workers == 0
    data = cfg.data.build()
    assert (len(data.train), len(data.val)) == (999 // 16, 99 // 16) and data.num_classes == top
    xs, ys = windows_of(data.train, [61, 0, 5])
    for i, x, y in zip([61, 0, 5], xs, ys, strict=True):
        assert x == ids[i * 16 : i * 16 + 16].tolist() and y == ids[i * 16 + 1 : i * 16 + 17].tolist()
    copy = pickle.loads(pickle.dumps(data.train))
    assert copy._map is None and copy[5][1].tolist() == ys[2], (
        "memory maps are not pickled to loader processes"
    )


def test_every_target_once_per_epoch_over_four_ranks(tmp_path):
    """Token id = position: the targets name themselves. The sampler pads 62 windows to 64 for 4 ranks."""
    ids = np.arange(1000, dtype=np.uint32)  # 999 // 16 = 62 windows; positions 993..999 fill none
    data = TokensConfig(
        root=str(write_tokens(tmp_path, ids, ids[:40], {"vocab_size": 1000})), dtype="uint32", block_size=16
    ).build()
    for epoch in (0, 1):
        targets, orders = Counter(), []
        for rank in range(4):
            loader = data.train_loader(rank, 4, 5, seed=3)
            loader.sampler.set_epoch(epoch)
            orders.append(list(loader.sampler))
            for x, y in loader:
                assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y, x + 1)
                targets.update(y.flatten().tolist())
        assert set(targets) == set(range(1, 993)), "every target of the split, the tail left out"
        padded = [i for i, n in Counter(i for order in orders for i in order).items() if n > 1]
        assert len(padded) == 64 - 62 and sum(targets.values()) == 64 * 16
        assert {p for p, n in targets.items() if n > 1} == {i * 16 + k for i in padded for k in range(1, 17)}
    assert orders[0] != [i for i in range(0, 64, 4)], "shuffled"


def test_tokens_reject_bad_files(monkeypatch, tmp_path):
    ids = np.arange(100, dtype=np.uint16)
    root = write_tokens(tmp_path / "a", ids, ids, {"vocab_size": 100})
    (root / "val.bin").write_bytes(ids.tobytes() + b"\0")
    with pytest.raises(
        ValueError, match=r"data\.dtype='uint16' is invalid: .*val\.bin has 201 bytes.*data\.dtype"
    ):
        checked_config(["data=tokens", f"data.root={root}", *LM])
    (root / "val.bin").write_bytes(ids[:10].tobytes())
    with pytest.raises(
        ValueError, match=r"block_size=64 is invalid: the val split .*val\.bin holds 10 tokens"
    ):
        TokensConfig(root=str(root))
    (root / "val.bin").write_bytes(ids.tobytes())
    (root / "meta.json").write_text(json.dumps({"vocab_size": 50}))
    with pytest.raises(ValueError, match=r"data\.vocab_size=50 is invalid: .*train\.bin holds token id 99"):
        TokensConfig(root=str(root)).build()  # read when built, on the ranks: not in the launcher
    monkeypatch.setattr(tokens, "FULL_CHECK_BYTES", 100)  # a big file: checked batch by batch, as it is read
    data = TokensConfig(root=str(root), block_size=16).build()
    assert data.train.__getitems__([0, 2])[1].max() == 48
    with pytest.raises(ValueError, match=r"data\.vocab_size=50 is invalid: .*train\.bin holds token id 64"):
        data.train.__getitems__([0, 3])
    with pytest.raises(
        ValueError, match=r"vocab_size=120 .*meta\.json has a vocabulary of 50: .*vocab_size=50"
    ):
        TokensConfig(root=str(root), vocab_size=120)
    (root / "meta.json").write_text("{}")
    with pytest.raises(ValueError, match=r"root=.* is invalid: .*meta\.json must be \{\"vocab_size\": N\}"):
        TokensConfig(root=str(root))
    with pytest.raises(ValueError, match=r"data\.root=.*missing train\.bin, val\.bin"):
        checked_config(["data=tokens", f"data.root={tmp_path}", *LM])


def test_tokens_without_meta_json(tmp_path):
    """meta.pkl is never read (unpickling runs code): meta.json, or data.vocab_size, says the size."""
    ids = np.arange(100, dtype=np.uint16)
    root = write_tokens(tmp_path, ids, ids, None)
    (root / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 100}))
    with pytest.raises(ValueError) as refused:
        checked_config(["data=tokens", f"data.root={root}", *LM])
    told = str(refused.value)
    assert re.fullmatch(
        r"data\.vocab_size=null is invalid: .* holds meta\.pkl, which is not read .* write .*meta\.json as "
        r"\{\"vocab_size\": N\}, or set data\.vocab_size=N",
        told,
    ), told
    cfg = checked_config(["data=tokens", f"data.root={root}", "data.vocab_size=128", *LM])
    assert cfg.data.vocab_size == cfg.data.num_classes == cfg.model.vocab_size == 128
    assert TokensConfig(root=str(root), vocab_size=100).build().num_classes == 100
    with pytest.raises(ValueError, match="no meta.json"):
        TokensConfig(root=str(root))


def test_a_vocabulary_over_65536_is_refused_as_uint16(tmp_path):
    import json

    import numpy as np

    from runner.data.tokens import TokensConfig

    for split in ("train", "val"):
        np.arange(200, dtype=np.uint16).tofile(tmp_path / f"{split}.bin")
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 100_277}))
    with pytest.raises(
        ValueError, match=r"dtype='uint16' is invalid: a vocabulary of 100277 .*data\.dtype=uint32"
    ):
        TokensConfig(root=str(tmp_path), block_size=8)


def test_a_run_folder_s_config_fetches_and_writes_nothing(tmp_path):
    """Reading a run folder's config.yaml (the ranks, eval=, runner.sample) with the corpus absent where it
    says: refused with what to download where, and nothing created there (not even the folder)."""
    from runner.schema import READING_RUN_FOLDER

    where = tmp_path / "elsewhere" / "input.txt"
    token = READING_RUN_FOLDER.set(True)
    try:
        with pytest.raises(ValueError, match=rf"{where} is absent: download {URL} to {where}"):
            ShakespeareCharConfig(root=str(where.parent))
    finally:
        READING_RUN_FOLDER.reset(token)
    assert not where.parent.exists()


def test_a_relative_data_path_is_written_absolute_into_the_run_folder(tmp_path, monkeypatch):
    """``data.root=corpus`` given in one folder: the run folder's config.yaml names the same files from
    any folder (eval=, resume=, runner.sample run elsewhere)."""
    from runner.launcher.launch import prepare
    from tests.conftest import compose_config

    ids = np.arange(1000, dtype="uint16") % 50
    write_tokens(tmp_path / "corpus", ids, ids[:100], {"vocab_size": 50})
    monkeypatch.chdir(tmp_path)
    prepare(compose_config(["data=tokens", "data.root=corpus", "data.block_size=16", *LM]), tmp_path / "run")
    written = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert written["data"]["root"] == str(tmp_path / "corpus")
    given = ["data=shakespeare_char", f"data.file={CORPUS}", "data.root=null", *LM]
    if CORPUS.is_file():  # an absolute path stays as given
        prepare(compose_config(given), tmp_path / "run2")
        assert yaml.safe_load((tmp_path / "run2" / "config.yaml").read_text())["data"]["file"] == str(CORPUS)
