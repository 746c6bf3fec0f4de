"""Streaming DiLoCo's fragments by the model's repeated blocks (``rule.fragment_by=blocks``).

The paper (Douillard et al. 2025, arXiv 2501.18512) cuts a transformer by its blocks, strided: with F
fragments and L blocks, fragment p holds blocks p, p+F, p+2F, ... The blocks are found generically: the
``nn.ModuleList`` of modules of one type holding the most trainable values (model=gpt's ``h``). Every other
trainable parameter (embeddings, position embeddings, the final norm; the head tied to the token embedding)
goes with fragment 0: the tied head cannot be split from the embedding, and fragment 0 already carries the
model's non-parameter state (BatchNorm statistics) at DiLoCo's round ends. (torchtitan's contiguous split,
components/ft/diloco, likewise puts the token embedding with the first fragment.)

Read by the launcher with the rule's schema: torch is imported where it is first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from runner.lazy import lazy_import

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_import("torch")


def find_blocks(model: torch.nn.Module) -> tuple[str, list[torch.nn.Module]] | None:
    """The model's repeated blocks, with the list's name; None if it has none.

    The blocks are the ``nn.ModuleList`` whose modules are all of one type and which holds the most trainable
    values (the first such list on a tie)."""
    best: tuple[int, str, list[torch.nn.Module]] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or len({type(m) for m in module}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters() if p.requires_grad)
        if size and (best is None or size > best[0]):
            best = (size, name, list(module))
    return None if best is None else (best[1], best[2])


def block_fragments(model: torch.nn.Module, fragments: int) -> list[int]:
    """The fragment of each trainable parameter of ``model`` (in ``model.parameters()`` order).

    Block b's go to b mod ``fragments``, all others to 0. ValueError, naming the fix, without blocks or with
    more fragments than blocks."""
    found = find_blocks(model)
    if found is None:
        raise ValueError(
            f"rule.fragment_by='blocks' is invalid: the model ({type(model).__name__}) has no repeated "
            "blocks to fragment by (an nn.ModuleList of modules of one type with trainable parameters, such "
            "as model=gpt's transformer blocks); set rule.fragment_by=size (F equal ranges of the parameters)"
        )
    name, blocks = found
    if fragments > len(blocks):
        raise ValueError(
            f"rule.fragments={fragments} is invalid: the model has {len(blocks)} blocks ({name}.0 .. "
            f"{name}.{len(blocks) - 1}) and with rule.fragment_by=blocks each fragment holds whole ones; "
            f"give rule.fragments <= {len(blocks)}, or rule.fragment_by=size"
        )
    owner: dict[int, int] = {}
    for b, block in enumerate(blocks):
        for p in block.parameters():
            owner.setdefault(id(p), b % fragments)
    return [owner.get(id(p), 0) for p in model.parameters() if p.requires_grad]


def layout(
    params: list[torch.Tensor], fragment_of: list[int], fragments: int
) -> tuple[list[torch.Tensor], list[list[int]]]:
    """``params`` in fragment order, and each fragment's bounds in each of the flat buffers made of them.

    The order is stable: the model's order within a fragment. The flat buffers are those
    :class:`runner.comm.flat.FlatTensors` makes of ``params`` (one per dtype and device, in order of first
    appearance)."""
    order = sorted(range(len(params)), key=fragment_of.__getitem__)
    keys = list(
        dict.fromkeys((params[i].dtype, params[i].device) for i in order)
    )  # (as FlatTensors meets them)
    sizes = [[0] * fragments for _ in keys]
    for p, f in zip(params, fragment_of, strict=True):
        sizes[keys.index((p.dtype, p.device))][f] += p.numel()
    bounds = []
    for row in sizes:
        bounds.append([0])
        for n in row:
            bounds[-1].append(bounds[-1][-1] + n)
    return [params[i] for i in order], bounds
