"""The attention pooler beside `mean` through the fused forward, against transformers' own
forward (SDPA with the weights computed beside it, and the eager model it needed before) and
against `mean` alone, in one process.

    python bench/attention_pooler.py [--dtype auto] [--short 1000 --long 100 --rounds 3]

The attention pooler weighs the last layer's states by the attention from the first token.
The fused CPU forward computes those weights itself (one query a row beside its attention,
``FusedEncoder.forward(first_token_attention=)``); beside transformers' model (a GPU's)
``pipeline.first_token_attention`` computes them from the last layer's input, so that model
keeps SDPA; else transformers gives them only through its eager attention, for every layer.
This encodes the same PyPI summaries and long texts (packaged MiniLM) four ways, ``--rounds``
times each after a first encode: ``mean`` + ``attention`` fused, the same through
transformers' SDPA model with the weights beside it and through its eager model (the fused
forward turned off), and ``mean`` alone fused; prints each way's seconds, the ratios of the
medians and how far the attention set's vectors lie apart from the fused ones. Never a timed
test: a script.
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
from pipeline import first_token_attention, fused_bert  # noqa: E402
from pipeline.config import EncoderConfig, PoolerSpec  # noqa: E402
from pipeline.embedder import Embedder  # noqa: E402
from pipeline.vectors import row_cosines  # noqa: E402


def embedders(dtype: str) -> dict[str, Embedder]:
    def build(*names: str) -> Embedder:
        return Embedder(EncoderConfig(device="cpu", dtype=dtype),
                        [PoolerSpec(name=n) for n in names])

    ways = {"fused": build("mean", "attention"), "mean_alone": build("mean")}
    fusable, supported = fused_bert.fusable, first_token_attention.supported
    fused_bert.fusable = lambda config, device: False
    try:
        ways["beside_sdpa"] = build("mean", "attention")
        first_token_attention.supported = lambda config: False
        ways["eager"] = build("mean", "attention")
    finally:
        fused_bert.fusable, first_token_attention.supported = fusable, supported
    assert ways["fused"].encoder.fused and not ways["eager"].encoder.fused
    assert ways["beside_sdpa"].encoder.first_attention is not None
    assert ways["eager"].encoder.model.config._attn_implementation == "eager"
    return ways


def measure(ways: dict[str, Embedder], texts: list[str], rounds: int) -> dict:
    """Each way's seconds over ``texts``, its rounds back to back after a first encode of the
    same texts: the ways share oneDNN's bounded kernel cache, and alternated, each would
    find the others' product shapes there and compile its own again every round."""
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    vectors = {}
    for name, embedder in ways.items():
        set_name = "mean" if name == "mean_alone" else "attention"
        embedder.encode(texts, set_name)
        for _ in range(rounds):
            started = time.perf_counter()
            vectors[name] = embedder.encode(texts, set_name)
            seconds[name].append(time.perf_counter() - started)
    median = {name: float(np.median(s)) for name, s in seconds.items()}
    return {"texts": len(texts), "seconds": {n: sorted(s) for n, s in seconds.items()},
            "eager_over_fused": median["eager"] / median["fused"],
            "eager_over_beside_sdpa": median["eager"] / median["beside_sdpa"],
            "fused_over_mean_alone": median["fused"] / median["mean_alone"],
            "min_cosine_fused_eager": min_cosine(vectors["fused"], vectors["eager"]),
            "min_cosine_fused_beside_sdpa": min_cosine(vectors["fused"],
                                                       vectors["beside_sdpa"])}


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(row_cosines(a, b).min())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--short", type=int, default=1000)
    parser.add_argument("--long", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    ways = embedders(args.dtype)
    texts = load_texts(DATA, args.short, args.long, 0, ways["fused"].encoder)
    report = {"dtype": ways["fused"].info.dtype, "cpu_flags": cpu_flags()}
    for kind, sample in texts.items():
        if sample:
            r = report[kind] = measure(ways, sample, args.rounds)
            print(f"{kind:5} {r['texts']:5} texts: "
                  + "; ".join(f"{n} {' '.join(f'{s:.3f}' for s in v)} s"
                              for n, v in r["seconds"].items())
                  + f": eager / fused {r['eager_over_fused']:.2f}x, eager / beside SDPA "
                  f"{r['eager_over_beside_sdpa']:.2f}x, fused / mean alone "
                  f"{r['fused_over_mean_alone']:.2f}x; min cosine to fused: eager "
                  f"{r['min_cosine_fused_eager']:.6f}, beside SDPA "
                  f"{r['min_cosine_fused_beside_sdpa']:.6f}")
    print(f"MiniLM, {report['dtype']}, CPU flags {report['cpu_flags']}")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
