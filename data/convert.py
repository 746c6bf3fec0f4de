"""Convert an image folder (``SRC/{train,val}/<class>/*.jpg``) into memory-mappable uint8 shards.

    python -m runner.data.convert SRC DST [--size 224]

Every image is resized (shorter side to ``size``) and centre-cropped to size×size, then written to
``DST/{train,val}_x.npy`` (N×size×size×3 uint8) and ``DST/{train,val}_y.npy``; ``DST/meta.json`` records
the classes and the training images' per-channel mean and std. Arrays are written through memory maps, so
a data set larger than memory converts too.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from runner.data.imagefolder import list_images, load_image


def convert_split(samples: list, size: int, dst: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """Write one split; returns the per-channel sums of values and of squares (for mean and std)."""
    x = np.lib.format.open_memmap(
        dst / f"{split}_x.npy", mode="w+", dtype=np.uint8, shape=(len(samples), size, size, 3)
    )
    total, squares = np.zeros(3), np.zeros(3)
    for i, (path, _) in enumerate(samples):
        img = np.asarray(load_image(path, size), dtype=np.uint8)
        top, left = (img.shape[0] - size) // 2, (img.shape[1] - size) // 2
        x[i] = img[top : top + size, left : left + size]
        pixels = x[i].reshape(-1, 3).astype(np.float64) / 255
        total += pixels.sum(0)
        squares += (pixels**2).sum(0)
    x.flush()
    np.save(dst / f"{split}_y.npy", np.array([label for _, label in samples], dtype=np.int64))
    return total, squares


def convert(src: Path, dst: Path, size: int) -> dict:
    train, classes = list_images(src / "train")
    val, _ = list_images(src / "val", classes)
    dst.mkdir(parents=True, exist_ok=True)
    total, squares = convert_split(train, size, dst, "train")
    convert_split(val, size, dst, "val")
    count = len(train) * size * size
    mean = total / count
    std = np.sqrt(np.maximum(squares / count - mean**2, 1e-12))
    meta = {
        "classes": classes,
        "image_shape": [size, size, 3],
        "mean": mean.tolist(),
        "std": std.tolist(),
        "train": len(train),
        "val": len(val),
        "source": str(src),
    }
    (dst / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m runner.data.convert",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("src", type=Path, help="image folder with train/ and val/")
    p.add_argument("dst", type=Path, help="output folder for the shards")
    p.add_argument("--size", type=int, default=224, help="side of the stored square images")
    args = p.parse_args(argv)
    try:
        meta = convert(args.src, args.dst, args.size)
    except (ValueError, FileNotFoundError) as err:
        sys.exit(f"error: {err}")
    print(
        f"wrote {meta['train']} training and {meta['val']} validation images of {len(meta['classes'])} "
        f"classes, {args.size}×{args.size}, to {args.dst}"
    )


if __name__ == "__main__":
    main()
