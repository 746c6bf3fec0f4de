"""``python -m runner.sample RUN_DIR``: text sampled from a finished language-model run's saved model.

One process, without MPI, as :mod:`runner.rank.evaluate`: the run folder is data. Its ``config.yaml`` is
checked by :func:`runner.schema.config.load` before anything it names is built (:mod:`runner.schema.trust`),
and ``model.pt`` is checked against its size and CRC-32 and read with ``torch.load(weights_only=True)``
(:func:`runner.rank.saved_model.load_model`); nothing in the folder is executed. Tokens are drawn with
nanoGPT's loop (its ``model.generate``). The same seed on the same device gives the same tokens; a CPU and a
GPU draw differently. A problem is a ValueError of one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runner.rank.saved_model import load_model
from runner.run_folder import CONFIG, MODEL


@dataclass
class Sampler:
    """A run's model, ready to sample from, with what its data set says about tokens."""

    model: torch.nn.Module
    data: Any  # the run's data config: encode, decode and vocabulary where its tokens are characters
    context: int  # the longest sequence the model reads
    device: torch.device
    names: str  # "model=gpt, data=shakespeare_char", for messages
    data_name: str  # "data=shakespeare_char"

    @property
    def decodes(self) -> bool:
        """Whether the data set turns token ids back into text (``data.decode``)."""
        return callable(getattr(self.data, "decode", None)) and callable(getattr(self.data, "encode", None))


def option(group_cfg: Any) -> str:
    """The option a group was given as on the command line: ``gpt``, or ``custom`` for a ``_target_``."""
    from runner.schema import option_name
    from runner.schema.target import Target

    return "custom" if isinstance(group_cfg, Target) else option_name(type(group_cfg))


def pick_device(name: str | None, run_device: str) -> torch.device:
    """``name`` (cpu or cuda); None: cuda where the run trained on a GPU and one is here, else cpu."""
    if name is None:
        name = "cuda" if run_device != "cpu" and torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available here; use --device cpu")
    return torch.device(name)


def load_config(run_dir: Path) -> Any:
    """The run's checked config; ValueError where the folder is not a finished run's."""
    from omegaconf.errors import OmegaConfBaseException
    from yaml import YAMLError

    from runner.schema.config import load

    if not (run_dir / CONFIG).is_file():
        raise ValueError(f"{run_dir / CONFIG} does not exist: give the folder of a run (python -m runner)")
    if not (run_dir / MODEL).is_file():
        raise ValueError(
            f"{run_dir / MODEL} does not exist: the run did not finish (a run saves its model at its end, "
            f"unless train.save_model=none); train it to the end, or continue it with "
            f"python -m runner resume={run_dir}"
        )
    try:
        return load(run_dir / CONFIG)
    except (OmegaConfBaseException, YAMLError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{run_dir / CONFIG} cannot be read: {first}") from None


def open_run(run_dir: Path, device: str | None = None) -> Sampler:
    """Build ``run_dir``'s model from its config and load its ``model.pt``, in eval mode on ``device``."""
    from runner.tasks.language_model import LanguageModelConfig

    cfg = load_config(run_dir)
    names = f"model={option(cfg.model)}, data={option(cfg.data)}"
    if not isinstance(cfg.task, LanguageModelConfig):
        raise ValueError(
            f"{run_dir} is a run of task={option(cfg.task)} ({names}), not a language model: sampling needs "
            "a run of task=language_model, e.g. recipe=shakespeare_char"
        )
    where = pick_device(device, cfg.hardware.device)
    model = cfg.model.build().to(where)
    state = load_model(run_dir / MODEL, "train the run again to sample from it", map_location=where)
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        first = str(err).strip().splitlines()[0]
        raise ValueError(
            f"{run_dir / MODEL} does not fit the {names} of {run_dir / CONFIG}: {first}"
        ) from None
    context = cfg.model.context() if hasattr(cfg.model, "context") else int(cfg.data.shape[-1])
    return Sampler(model.eval(), cfg.data, context, where, names, f"data={option(cfg.data)}")


def start_ids(sampler: Sampler, start: str | None, ids: list[int] | None) -> list[int]:
    """The prompt's token ids: ``ids``, ``start`` encoded, or a newline (character data) or token 0."""
    if ids is not None:
        if not ids:
            raise ValueError("--start-ids is empty: give at least one token id")
        return ids
    if start is None:
        newline = sampler.decodes and "\n" in sampler.data.vocabulary()
        return sampler.data.encode("\n") if newline else [0]
    if not sampler.decodes:
        raise ValueError(
            f"--start: {sampler.data_name} has no text encoding; give token ids with --start-ids"
        )
    if not start:
        raise ValueError("--start is empty: give at least one character")
    try:
        return sampler.data.encode(start)
    except ValueError as err:
        raise ValueError(f"--start: {err}") from None


def next_logits(sampler: Sampler, idx: torch.Tensor) -> torch.Tensor:
    """The logits [1, V] of the token after ``idx`` [1, T], cropped to the model's context.

    Raises ValueError where the model gives no [B, T, V] scores."""
    idx = idx[:, -sampler.context :]
    try:
        out = sampler.model(idx)
    except Exception as err:  # the model cannot read token ids at all
        raise ValueError(
            f"{sampler.names} cannot read token ids [1, {idx.shape[1]}] ({type(err).__name__}: {err}): "
            "sampling needs a language model that gives logits [batch, time, vocabulary]"
        ) from None
    if not (isinstance(out, torch.Tensor) and out.dim() == 3 and out.shape[:2] == idx.shape):
        shape = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(
            f"{sampler.names} gives {shape} for token ids {list(idx.shape)}, not logits [batch, time, "
            "vocabulary]: sampling needs a language model"
        )
    return out[:, -1, :]


@torch.no_grad()
def generate(
    sampler: Sampler, ids: list[int], tokens: int, temperature: float, top_k: int, seed: int
) -> list[int]:
    """``ids`` followed by ``tokens`` drawn one at a time (top-k 0: from the whole vocabulary)."""
    if temperature <= 0:
        raise ValueError(f"temperature {temperature} must be > 0")
    vocab = next_logits(sampler, torch.zeros((1, 1), dtype=torch.long, device=sampler.device)).shape[-1]
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the model's vocabulary of {vocab} (0..{vocab - 1})")
    if sampler.decodes and vocab > len(sampler.data.vocabulary()):
        raise ValueError(f"{sampler.names}: the model scores {vocab} tokens, more than the data set decodes")
    generator = torch.Generator(device=sampler.device).manual_seed(seed)
    idx = torch.tensor([ids], device=sampler.device)
    for _ in range(tokens):
        logits = next_logits(sampler, idx).float() / temperature
        if top_k:
            kth = torch.topk(logits, min(top_k, vocab)).values[:, [-1]]
            logits[logits < kth] = -float("inf")
        probs = torch.softmax(logits, dim=-1)
        idx = torch.cat((idx, torch.multinomial(probs, 1, generator=generator)), dim=1)
    return idx[0].tolist()


@dataclass
class Drawn:
    """What :func:`sample_run` drew: the token ids (prompt included), and their text.

    The text is there where the data set has a decoder (None: it has none)."""

    ids: list[int]
    text: str | None
    data_name: str  # "data=tokens", for the note that there is no decoder


def sample_run(
    run_dir: Path,
    tokens: int = 500,
    temperature: float = 0.8,
    top_k: int = 200,
    seed: int = 0,
    start: str | None = None,
    ids: list[int] | None = None,
    device: str | None = None,
) -> Drawn:
    """Sample ``tokens`` tokens from ``run_dir``'s model after the prompt ``start`` (text) or ``ids``."""
    sampler = open_run(run_dir, device)
    drawn = generate(sampler, start_ids(sampler, start, ids), tokens, temperature, top_k, seed)
    return Drawn(drawn, sampler.data.decode(drawn) if sampler.decodes else None, sampler.data_name)
