"""How close the encoder can come to this CPU's matmul peak: its products alone, in one run.

    python bench/encoder_ceiling.py [--short 3000 --long 300 --rounds 3]

Encodes the texts of bench/encode_bench.py (the same sample for the same options) with the
Embedder (packaged MiniLM or ``--model``, ``dtype auto``, the fused CPU forward), timing each
of the forward's products as it runs, and prints per text set, against the matmul peak measured
in the same run:

* ``encoder``: the model's FLOPs over the real tokens / the encode's time (encode_bench's
  "% of peak");
* ``products in context``: the products' FLOPs over the padded rows / their time inside it;
* ``products alone``: the same products (same shapes and weights) replayed back to back;
* ``each product``: a layer's products apart (query/key/value, the attention's output, the
  feed-forward's two), each one's share of the encode and of the peak, GELU and epilogue in;
* ``ceiling``: the model's FLOPs / the products' time in context: the encoder's share of the
  peak if everything else (attention, softmax, LayerNorm, adds, copies, tokenizing, pooling)
  took no time at all, and the padding's share of the products' FLOPs;
* ``attention``: its share of the encode, its own FLOPs (over the keys it ran) against the
  peak, and a softmax alone over the same scores (fp32, in place, torch's kernel) as a share of
  the attention's time: the part no product kernel can take;
* ``ceiling with attention``: the model's FLOPs / the products' and the attention's time in
  context: the share left if only LayerNorm, adds, copies and pooling took no time.

The best of ``--rounds`` encodes counts (the machine is shared). CPU flags printed beside.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import pipeline  # noqa: E402,F401  (caps oneDNN before torch runs)
from bench.encode_bench import (  # noqa: E402
    add_model_arg,
    add_text_args,
    encoder_flops,
    ffn_shape,
    load_texts,
    real_lengths,
)
from bench.peak import matmul_peak  # noqa: E402
from bench.speed import cpu_flags  # noqa: E402
from pipeline import attention as attention_kernels  # noqa: E402
from pipeline.config import EncoderConfig, PoolerSpec  # noqa: E402
from pipeline.embedder import Embedder  # noqa: E402
from pipeline.fused_bert import ProductLayer  # noqa: E402
from pipeline.torch_thread import on_torch_thread  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class CallTimer:
    """Wraps the function ``name`` of ``owner`` while entered: each call as ``describe`` tells
    it from its arguments, then its seconds."""

    def __init__(self, owner: object, name: str) -> None:
        self.owner, self.name = owner, name
        self.calls: list[tuple] = []
        self._original = getattr(owner, name)

    def describe(self, *args, **kwargs) -> tuple:
        raise NotImplementedError

    def __enter__(self) -> CallTimer:
        original = self._original

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = original(*args, **kwargs)
            self.calls.append((*self.describe(*args, **kwargs), time.perf_counter() - start))
            return out

        setattr(self.owner, self.name, timed)
        return self

    def __exit__(self, *exc: object) -> None:
        setattr(self.owner, self.name, self._original)

    def seconds(self) -> float:
        return sum(call[-1] for call in self.calls)


class ProductTimer(CallTimer):
    """Wraps ``ProductLayer._product``: the seconds each product took (a residual add or a
    gate's multiply in its epilogue included) and what it multiplied: (input shape, layer,
    dtype, activation, the epilogue's (dtype, binary) or None, seconds)."""

    def __init__(self) -> None:
        super().__init__(ProductLayer, "_product")

    def describe(self, layer_self, x, layer, dtype, activation, other, binary="add") -> tuple:
        return x.shape, layer, dtype, activation, None if other is None else (other.dtype, binary)

    def flops(self) -> float:
        return sum(2.0 * shape.numel() * layer.out_features
                   for shape, layer, *_ in self.calls)

    def by_product(self, encode_s: float, peak: float) -> dict[str, dict]:
        """Each product of a layer (by its [in x out] shape, "+gelu" where it applies GELU,
        "+add"/"+mul" where its epilogue took a second tensor): its share of the encode and
        its FLOPs over its time against the peak (GELU and epilogue included)."""
        groups: dict[str, list[float]] = {}
        for shape, layer, _, activation, other, seconds in self.calls:
            key = (f"{layer.in_features}x{layer.out_features}" + ("+gelu" if activation else "")
                   + ("" if other is None else f"+{other[1]}"))
            flops_seconds = groups.setdefault(key, [0.0, 0.0])
            flops_seconds[0] += 2.0 * shape.numel() * layer.out_features
            flops_seconds[1] += seconds
        return {key: {"share_of_encode": round(seconds / encode_s, 3),
                      "of_peak": round(flops / seconds / 1e9 / peak, 3)}
                for key, (flops, seconds) in groups.items()}


class AttentionTimer(CallTimer):
    """Wraps ``pipeline.attention.attend`` (every fused forward's attention, any kernel): the
    seconds each call took and its shape (rows, heads, queries, keys, head width), the keys
    those it ran over (the bias's: masked keys appended, ``pipeline.attention.key_width``)."""

    def __init__(self) -> None:
        super().__init__(attention_kernels, "attend")

    def describe(self, q, k, v, bias, out=None, kernel=None) -> tuple:
        keys = k.shape[2] if bias is None else bias.shape[-1]
        return ((*q.shape[:3], keys, q.shape[3]),)

    def flops(self) -> float:
        """The products' FLOPs over the keys each call ran (q k^T and the weights times v)."""
        return sum(4.0 * rows * heads * queries * keys * dim
                   for (rows, heads, queries, keys, dim), _ in self.calls)


def softmax_alone(calls: list) -> float:
    """Seconds a softmax over each call's scores ([rows x heads, queries, keys], fp32, in
    place) takes, back to back: the exponentials and sums every kernel computes in fp32."""
    scores = [torch.randn(rows * heads, queries, keys)
              for (rows, heads, queries, keys, _), _ in calls]
    with torch.inference_mode():
        start = time.perf_counter()
        for s in scores:
            torch.softmax(s, -1, out=s)
        return time.perf_counter() - start


def replay(calls: list, layer_of_model: ProductLayer) -> float:
    """Seconds the products of ``calls`` take back to back, on random inputs of their shapes."""
    inputs = [(torch.randn(shape).to(dtype), None if other is None else
               torch.randn(*shape[:-1], layer.out_features).to(other[0]))
              for shape, layer, dtype, _, other, _ in calls]
    with torch.inference_mode():
        start = time.perf_counter()
        for (x, tensor), (_, layer, dtype, activation, other, _) in zip(inputs, calls,
                                                                        strict=True):
            binary = "add" if other is None else other[1]
            ProductLayer._product(layer_of_model, x, layer, dtype, activation, tensor, binary)
        return time.perf_counter() - start


def measure(embedder: Embedder, texts: list[str], rounds: int, peak: float) -> dict:
    model, lengths = embedder.encoder.model, real_lengths(embedder, texts)
    flops = encoder_flops(lengths, model.config)
    best: tuple[float, ProductTimer, AttentionTimer] | None = None
    for _ in range(rounds):
        with ProductTimer() as timer, AttentionTimer() as attention:
            start = time.perf_counter()
            embedder.encode(texts)
            seconds = time.perf_counter() - start
        if best is None or seconds < best[0]:
            best = (seconds, timer, attention)
    seconds, timer, attention = best
    layer = next(m for m in model.modules() if isinstance(m, ProductLayer))
    alone = min(on_torch_thread(replay, timer.calls, layer) for _ in range(rounds))
    softmax = min(on_torch_thread(softmax_alone, attention.calls) for _ in range(rounds))
    products, padded = timer.seconds(), timer.flops()
    attending = attention.seconds()
    model_products = encoder_flops(lengths, model.config, attention=False)
    return {
        "docs": len(texts), "encode_s": round(seconds, 3),
        "encoder_of_peak": round(flops / seconds / 1e9 / peak, 3),
        "products_share_of_encode": round(products / seconds, 3),
        "products_in_context_of_peak": round(padded / products / 1e9 / peak, 3),
        "products_alone_of_peak": round(padded / alone / 1e9 / peak, 3),
        "each_product": timer.by_product(seconds, peak),
        "padding_share_of_product_flops": round(1 - model_products / padded, 3),
        "ceiling_of_peak": round(flops / products / 1e9 / peak, 3),
        "attention_share_of_encode": round(attending / seconds, 3),
        "attention_in_context_of_peak": round(attention.flops() / attending / 1e9 / peak, 3),
        "softmax_alone_share_of_attention": round(softmax / attending, 3),
        "ceiling_with_attention_of_peak": round(flops / (products + attending) / 1e9 / peak, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_text_args(parser, short=3000, long=300)
    add_model_arg(parser)  # of an architecture the fused forward runs
    args = parser.parse_args(argv)
    embedder = Embedder(EncoderConfig(model=args.model, device="cpu"), [PoolerSpec(name="mean")])
    if not embedder.encoder.fused:
        raise SystemExit("the fused CPU forward does not run here: nothing to time")
    config = embedder.encoder.model.config
    dtype = DTYPES[embedder.info.dtype]
    peak = on_torch_thread(matmul_peak, dtype, *ffn_shape(config))
    texts = load_texts(args.data, args.short, args.long, args.seed, embedder.encoder)
    embedder.encode((texts["short"] or texts["long"])[:64])  # warm
    report = {"cpu_flags": cpu_flags(), "dtype": embedder.info.dtype,
              "matmul_peak_gflops": round(peak, 1)}
    for name, sample in texts.items():
        if sample:  # --short 0 or --long 0: that set is left out
            report[name] = measure(embedder, sample, args.rounds, peak)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
