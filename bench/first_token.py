"""A [CLS] pooler's forward with the last layer at the first tokens alone, against the whole
last layer, in one process.

    python bench/first_token.py [--model FOLDER] [--dtype auto] [--short 3000 --long 300]

Where every pooler reads nothing but the last layer's first token, the fused forward computes
that layer's queries, attention output and feed-forward over one token a row
(``FusedEncoder.forward(first_token_only=)``). This encodes the same PyPI summaries and long
texts both ways, alternated ``--rounds`` times, and prints each way's seconds, the median
ratio and how far the vectors lie apart. ``--model``: a sentence-transformers folder whose
Pooling is [CLS] (its own set, ``model``; ``python bench/base_models.py bge-small FOLDER``
saves one of bge-small-en-v1.5's shape); default: the packaged MiniLM with a ``cls`` pooler.
Never a timed test: a script.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.encode_bench import DATA, load_texts  # noqa: E402
from bench.speed import cpu_flags  # noqa: E402
from pipeline.config import EncoderConfig, PoolerSpec  # noqa: E402
from pipeline.embedder import Embedder  # noqa: E402
from pipeline.vectors import row_cosines  # noqa: E402


def embedder(model: str | None, dtype: str) -> Embedder:
    spec = PoolerSpec(name="model") if model else PoolerSpec(name="cls")
    embedder = Embedder(EncoderConfig(model=model, device="cpu", dtype=dtype), [spec])
    if not embedder.first_token_only:
        raise SystemExit(f"{model or 'MiniLM'}: its pooler reads more than the first tokens")
    return embedder


def alternate(embedder: Embedder, texts: list[str], rounds: int) -> dict:
    """Seconds of each way over ``texts``, alternated; the vectors' distance."""
    seconds: dict[bool, list[float]] = {True: [], False: []}
    vectors = {}
    embedder.encode(texts[:64])  # warm-up
    for first in (True, False) * rounds:
        embedder.first_token_only = first
        started = time.perf_counter()
        vectors[first] = embedder.encode(texts)
        seconds[first].append(time.perf_counter() - started)
    embedder.first_token_only = True
    a, b = vectors[True], vectors[False]
    cosine = row_cosines(a, b)
    return {"texts": len(texts), "first_s": sorted(seconds[True]),
            "whole_s": sorted(seconds[False]),
            "median_ratio": float(np.median(seconds[False]) / np.median(seconds[True])),
            "max_abs": float(np.abs(a - b).max()), "min_cosine": float(cosine.min())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a sentence-transformers [CLS] model")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--short", type=int, default=3000)
    parser.add_argument("--long", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    model = embedder(args.model, args.dtype)
    texts = load_texts(DATA, args.short, args.long, 0, model.encoder)
    report = {"model": args.model or "MiniLM (cls)", "dtype": model.info.dtype,
              "cpu_flags": cpu_flags(), "layers": model.info.num_layers}
    for kind, sample in texts.items():
        if sample:
            report[kind] = alternate(model, sample, args.rounds)
            r = report[kind]
            print(f"{kind:5} {r['texts']:5} texts: first tokens alone "
                  f"{' '.join(f'{s:.3f}' for s in r['first_s'])} s, whole last layer "
                  f"{' '.join(f'{s:.3f}' for s in r['whole_s'])} s: median "
                  f"{r['median_ratio']:.3f}x; max |diff| {r['max_abs']:.2g}, min cosine "
                  f"{r['min_cosine']:.6f}")
    print(f"{report['model']}, {report['layers']} layers, {report['dtype']}, CPU flags "
          f"{report['cpu_flags']}")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
