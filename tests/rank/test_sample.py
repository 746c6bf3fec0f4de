"""``python -m runner.sample RUN_DIR``: text from a finished language-model run, on run folders written as
the launcher writes them (its config.yaml) with a freshly initialised model saved as a run saves it; one slow
test trains the recipe first."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from runner.rank.sample import Sampler, generate, open_run, pick_device, sample_run
from runner.rank.saved_model import save_model
from runner.run_folder import CONFIG, CONFIG_SHA_ENV, MODEL
from runner.sample import main
from tests.conftest import ROOT, compose_config

SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare"
needs_corpus = pytest.mark.skipif(
    not (SHAKESPEARE / "input.txt").is_file(), reason=f"no {SHAKESPEARE / 'input.txt'} (../shared/data)"
)
TINY_GPT = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2"]


@pytest.fixture(autouse=True)
def _not_vouched_and_one_thread(monkeypatch):
    """The folders are read as a folder from elsewhere is: no launcher vouches for their config.yaml. One
    torch thread: a 1-token batch of a tiny model gains nothing from more, and on cores shared with other
    processes their threads spin against each other (20-50x slower here)."""
    monkeypatch.delenv(CONFIG_SHA_ENV, raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def finished_run(run_dir: Path, overrides: list[str]) -> Path:
    """A run folder as a finished run leaves it: the launcher's config.yaml and a model.pt with its record
    (the model freshly initialised, seed 0)."""
    from runner.launcher.launch import prepare
    from runner.schema.config import load

    prepare(compose_config(["hardware.bind=none", *overrides]), run_dir)
    torch.manual_seed(0)
    save_model(load(run_dir / CONFIG).model.build().state_dict(), run_dir / MODEL)
    return run_dir


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory) -> Path:
    if not (SHAKESPEARE / "input.txt").is_file():
        pytest.skip(f"no {SHAKESPEARE / 'input.txt'} (../shared/data)")
    return finished_run(
        tmp_path_factory.mktemp("lm") / "run",
        ["recipe=shakespeare_char", f"data.root={SHAKESPEARE}", *TINY_GPT],
    )


def sampled(capsys, *argv: str) -> tuple[int, str, str]:
    """``python -m runner.sample ARGV`` in this process: (exit status, stdout, stderr)."""
    try:
        status = main(list(argv))
    except SystemExit as exit:  # argparse's refusals
        status = exit.code
    out, err = capsys.readouterr()
    return status, out, err


@needs_corpus
def test_the_text_is_the_prompt_and_exactly_tokens_more_characters_of_the_vocabulary(lm_run, capsys):
    status, out, err = sampled(capsys, str(lm_run), "--start", "ROMEO:", "--tokens", "40")
    assert status == 0, err
    text = out.removesuffix("\n")
    assert text.startswith("ROMEO:") and len(text) == len("ROMEO:") + 40
    assert set(text) <= set(open_run(lm_run).data.vocabulary())


@needs_corpus
def test_the_same_seed_gives_the_same_text_and_another_seed_another(lm_run):
    sampler = open_run(lm_run)
    assert sampler.context == 64 and not sampler.model.training
    first, again, other = (generate(sampler, [0], 30, 0.8, 200, seed) for seed in (0, 0, 1))
    assert first == again and first != other and len(first) == 31
    top1 = generate(sampler, [0], 10, 1.0, 1, 5)  # top-k 1: the likeliest token each time, whatever the seed
    assert top1 == generate(sampler, [0], 10, 1.0, 1, 6)
    default = sample_run(lm_run, tokens=5)  # prompt: a newline
    assert default.text is not None and default.text.startswith("\n") and len(default.text) == 6


@needs_corpus
def test_refusals_are_one_line_with_status_2(lm_run, tmp_path, capsys):
    for temperature in ("0", "-1"):
        status, _, err = sampled(capsys, str(lm_run), "--temperature", temperature)
        assert status == 2 and "--temperature" in err and "must be > 0" in err
    status, out, err = sampled(capsys, str(lm_run), "--start", "ROMEO€")
    assert (
        (status, out) == (2, "") and err.count("\n") == 1 and "outside the vocabulary" in err and "€" in err
    )
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    shutil.copy(lm_run / CONFIG, unfinished / CONFIG)
    status, _, err = sampled(capsys, str(unfinished))
    assert status == 2 and err.count("\n") == 1
    assert (
        f"{unfinished / MODEL} does not exist: the run did not finish" in err
        and f"resume={unfinished}" in err
    )
    status, _, err = sampled(capsys, str(tmp_path / "empty"))
    assert status == 2 and err.count("\n") == 1 and f"{tmp_path / 'empty' / CONFIG} does not exist" in err


@needs_corpus
def test_a_damaged_or_code_carrying_model_pt_is_refused_by_the_checked_load(lm_run, tmp_path, capsys):
    """model.pt is read with weights_only: a pickle that would call a function is refused (not called), even
    with a record that matches it; a changed byte fails the CRC-32."""
    run = tmp_path / "run"
    shutil.copytree(lm_run, run)
    marker = tmp_path / "called"
    save_model({"weight": Calls(marker)}, run / MODEL)
    status, _, err = sampled(capsys, str(run))
    assert status == 2 and err.count("\n") == 1 and "is damaged (torch.load cannot read it" in err
    assert not marker.exists()
    shutil.copy(lm_run / MODEL, run / MODEL)
    shutil.copy(lm_run / (MODEL + ".crc"), run / (MODEL + ".crc"))
    data = bytearray((run / MODEL).read_bytes())
    (run / MODEL).write_bytes(bytes(data[:-10]))
    status, _, err = sampled(capsys, str(run))
    assert status == 2 and f"{run / MODEL} is damaged" in err and "train the run again" in err


class Calls:
    """Pickled as a call of ``Path.touch``: what torch.load without weights_only would run."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_run_of_another_task_is_refused(tmp_path, capsys):
    run = finished_run(tmp_path / "digits", [])  # the default job: the CNN on digits, classification
    status, out, err = sampled(capsys, str(run))
    assert (status, out) == (2, "") and err.count("\n") == 1
    assert "task=classification (model=cnn, data=digits), not a language model" in err


def test_without_a_decoder_the_ids_are_printed_with_a_note(tmp_path, capsys):
    root = tmp_path / "corpus"
    root.mkdir()
    ids = np.random.default_rng(0).integers(0, 50, 400).astype("uint16")
    ids.tofile(root / "train.bin")
    ids[:100].tofile(root / "val.bin")
    (root / "meta.json").write_text(json.dumps({"vocab_size": 50}))
    overrides = ["model=gpt", "task=language_model", "data=tokens", f"data.root={root}", "data.block_size=8"]
    run = finished_run(tmp_path / "run", [*overrides, *TINY_GPT, "devices=1"])
    status, out, err = sampled(capsys, str(run), "--start-ids", "3,1,4", "--tokens", "20")
    assert status == 0 and "data=tokens has no decoder" in err
    drawn = [int(i) for i in out.split()]
    assert drawn[:3] == [3, 1, 4] and len(drawn) == 23 and all(0 <= i < 50 for i in drawn)
    status, _, err = sampled(capsys, str(run), "--start", "abc")
    assert status == 2 and "--start-ids" in err
    status, _, err = sampled(capsys, str(run), "--start-ids", "50")
    assert status == 2 and "token id 50 is outside the model's vocabulary of 50" in err


def test_a_model_without_per_position_logits_is_refused_by_name():
    """A model of a language-model run must score every position: [batch, time, vocabulary]."""
    classifier = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Flatten())  # [batch, time * 4]
    sampler = Sampler(classifier, None, 8, torch.device("cpu"), "model=custom, data=tokens", "data=tokens")
    with pytest.raises(ValueError, match=r"model=custom, data=tokens gives \[1, 4\] for token ids \[1, 1\]"):
        generate(sampler, [1], 3, 0.8, 200, 0)


def test_the_device_is_the_runs_where_one_is_here():
    assert pick_device(None, "cpu").type == "cpu"
    assert pick_device(None, "cuda").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--device cuda: no CUDA device"):
            pick_device("cuda", "cpu")


def test_the_command_lists_its_options():
    """The module runs as ``python -m runner.sample`` (--help imports no torch: quick)."""
    proc = subprocess.run(
        [sys.executable, "-m", "runner.sample", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    for option in ("--tokens", "--temperature", "--top-k", "--seed", "--start", "--start-ids", "--device"):
        assert option in proc.stdout


@needs_corpus
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_trained_recipe_samples_text(cli):
    run = cli("recipe=shakespeare_char", f"data.root={SHAKESPEARE}", "train.max_steps=100", *TINY_GPT)
    assert run.returncode == 0, run.output
    proc = subprocess.run(
        [sys.executable, "-m", "runner.sample", str(run.dir), "--tokens", "200", "--start", "ROMEO:"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "OMP_NUM_THREADS": "1"},  # (one thread: as the fixture above, on shared cores)
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ROMEO:") and len(proc.stdout) == len("ROMEO:") + 200 + 1, proc.stdout
    assert "Traceback" not in proc.stderr
