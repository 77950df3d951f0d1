"""Training a pooling head over cached encoder states with in-batch negatives (InfoNCE).

One forward pass of the frozen encoder fills the cache; every epoch then only runs the
small head. Each epoch ends with exact retrieval over the held-out split (its queries
against its distinct texts); the best epoch by MRR@k is kept, and training stops after
``patience`` epochs without a better one. The held-out states are cached in fp32 whatever
``cache_dtype`` says, so the recorded metrics are those the ``learned`` pooler serves.
"""

from __future__ import annotations

import copy
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import ValidationError

from pipeline import storage
from pipeline.config import HEAD_JSON
from pipeline.encoder import Encoder, EncoderInfo
from pipeline.errors import ConfigError, CorpusError
from pipeline.head_files import HeadConfig
from pipeline.poolers.heads import PoolingHead, save_head
from pipeline.training.cache import StateCache, build_cache, row_bytes, row_lengths
from pipeline.training.config import TrainConfig
from pipeline.training.metrics import retrieval_metrics
from pipeline.training.pairs import Pairs, read_pairs, split_groups

TRAINING_JSON = "training.json"
Log = Callable[[str], None]


@dataclass
class Split:
    """Pairs of one side of the split as rows of its own ``cache``; ``text_key`` tells equal
    texts apart."""

    query: torch.Tensor
    text: torch.Tensor
    query_key: torch.Tensor
    text_key: torch.Tensor
    cache: StateCache

    def __len__(self) -> int:
        return len(self.query)


@dataclass
class TrainResult:
    head: PoolingHead
    metrics: dict[str, float]
    history: list[dict[str, float]] = field(default_factory=list)


def train(cfg: TrainConfig, log: Log | None = None) -> TrainResult:
    """Train, pick the best epoch on the held-out split, save the head under ``cfg.out``."""
    log = log or (lambda _msg: None)
    _check_head_out(cfg)
    pairs = read_pairs(cfg.pairs, cfg.query_column, cfg.text_column, cfg.group_column)
    train_rows, val_rows = _choose_rows(pairs, cfg)
    encoder = Encoder(cfg.encoder)
    info = encoder.info()
    head_cfg = head_config(cfg, info)  # layers checked against this model before encoding
    layers = head_cfg.resolved_layers
    started = time.perf_counter()
    train_split, val_split = _cache_states(encoder, pairs, train_rows, val_rows, layers, cfg,
                                           log)
    encode_s = time.perf_counter() - started
    del encoder
    head = PoolingHead(head_cfg)
    history, best_epoch, best_state = _fit(head, train_split, val_split, cfg, log)
    if best_epoch == 0:
        log(_untrained_note(history[0], cfg.k, len(val_split)))
    head.load_state_dict(best_state)
    metrics = _summary(history, best_epoch, cfg, len(train_split), len(val_split), pairs.skipped)
    head.cfg = head.cfg.model_copy(update={"metrics": metrics})
    save_head(head, cfg.out)
    storage.write_json(storage.join(cfg.out, TRAINING_JSON), {
        "config": cfg.model_dump(mode="json"),
        "encoder": {"model": info.model, "model_hash": info.model_hash, "dtype": info.dtype,
                    "max_length": info.max_length},
        "cache": _cache_record(train_split.cache, val_split.cache, encode_s),
        "history": history,
        "metrics": metrics,
    })
    return TrainResult(head.eval(), metrics, history)


def _check_head_out(cfg: TrainConfig) -> None:
    """HEAD_OUT can take the head, before any work: a folder (or a place for one; on S3 its
    bucket), not the model's own folder or one inside it (the model's hash covers the files
    there: the model, and every set made with it, would change), and, unless ``overwrite``,
    no head already (the sets made with it would no longer match it)."""
    storage.check_folder(cfg.out, "the head (HEAD_OUT)")
    model = cfg.encoder.model
    if (model and not storage.is_remote(model) and os.path.isdir(storage.local_path(model))
            and not storage.is_remote(cfg.out) and storage.is_under(cfg.out, model)):
        raise ConfigError(f"HEAD_OUT {cfg.out} is inside the model folder {model}: the model's "
                          "hash covers the files there (the model, and every set made with it, "
                          "would change); train into another folder")
    if not cfg.overwrite and storage.exists(storage.join(cfg.out, HEAD_JSON)):
        raise ConfigError(f"HEAD_OUT {cfg.out} already holds a pooling head, and the sets made "
                          "with it would no longer match it: pass --overwrite to replace it, or "
                          "train into another folder")


def _cache_record(train_cache: StateCache, val_cache: StateCache, encode_s: float) -> dict:
    def dtype(cache: StateCache) -> str:
        return str(cache.flat.dtype).removeprefix("torch.")

    return {"bytes": train_cache.nbytes + val_cache.nbytes, "dtype": dtype(train_cache),
            "held_out_dtype": dtype(val_cache), "rows": len(train_cache) + len(val_cache),
            "encode_seconds": round(encode_s, 2)}


def head_config(cfg: TrainConfig, info: EncoderInfo) -> HeadConfig:
    """The head ``cfg`` trains on this encoder; one line where its layers do not fit it
    (out of range, or one layer named twice: ``-1`` and ``L`` alike)."""
    try:
        return HeadConfig(
            kind=cfg.kind, hidden_size=info.hidden_size, num_layers=info.num_layers,
            model_hash=info.model_hash, layers=cfg.head_layers(info.num_layers),
            max_positions=info.max_length, adapter=cfg.adapter, out_dim=cfg.out_dim,
        )
    except ValidationError as exc:
        problem = exc.errors()[0]["msg"].removeprefix("Value error, ")
        raise ConfigError(f"--layers for {info.model}: {problem}") from None


def _choose_rows(pairs: Pairs, cfg: TrainConfig) -> tuple[np.ndarray, np.ndarray]:
    """Split by group, shuffle each side with the seed, cap to max_pairs / max_val_pairs."""
    train_rows, val_rows = split_groups(pairs.group, cfg.val_fraction)
    rng = np.random.default_rng(cfg.seed)
    train_rows = rng.permutation(train_rows)[: cfg.max_pairs]
    val_rows = rng.permutation(val_rows)[: cfg.max_val_pairs]
    if len(train_rows) < 2 or len(val_rows) < 2:
        raise CorpusError(
            f"{cfg.pairs}: the split left {len(train_rows)} training and {len(val_rows)} "
            "held-out pairs; each side needs at least 2 (add pairs or groups, or change "
            "val_fraction)"
        )
    return train_rows, val_rows


def _cache_states(encoder: Encoder, pairs: Pairs, train_rows: np.ndarray, val_rows: np.ndarray,
                  layers: tuple[int, ...], cfg: TrainConfig, log: Log) -> tuple[Split, Split]:
    """Fit the pairs into the memory budget, then encode each distinct string of each side
    once: the training side in ``cache_dtype``, the held-out side in fp32 (as served)."""
    dtype = cache_dtype(cfg)
    used = np.unique(np.concatenate([*pairs.subset(train_rows), *pairs.subset(val_rows)]))
    tokens = encoder.tokenize_for([pairs.strings[i] for i in used], pairs.is_query[used])
    lengths = row_lengths(encoder, tokens)

    def cost(side_dtype: torch.dtype) -> np.ndarray:
        out = np.zeros(len(pairs.strings), np.int64)
        out[used] = row_bytes(lengths, len(layers), encoder.hidden_size, cfg.token_level,
                              torch.empty(0, dtype=side_dtype).element_size())
        return out

    train_rows = _fit_budget(pairs, train_rows, val_rows, cost(dtype), cost(torch.float32),
                             cfg, log)
    token_of = dict(zip(used.tolist(), tokens, strict=True))
    sides = [(np.unique(np.concatenate(pairs.subset(r))), r, d)
             for r, d in ((train_rows, dtype), (val_rows, torch.float32))]
    total = sum(len(kept) for kept, _, _ in sides)
    log(f"encoding {total} distinct queries and texts once per side "
        f"({len(train_rows)} training, {len(val_rows)} held-out pairs)")
    from tqdm import tqdm

    with tqdm(total=total, desc="encoding", unit="text", leave=False,
              disable=not sys.stderr.isatty()) as bar:
        train_split, val_split = (
            _encode_side(encoder, pairs, rows, [token_of[i] for i in kept.tolist()], kept,
                         layers, cfg.token_level, side_dtype, bar.update)
            for kept, rows, side_dtype in sides)
    return train_split, val_split


def _encode_side(encoder: Encoder, pairs: Pairs, rows: np.ndarray, tokens: list[list[int]],
                 kept: np.ndarray, layers: tuple[int, ...], token_level: bool,
                 dtype: torch.dtype, progress: Callable[[int], None]) -> Split:
    """The pairs ``rows`` over a cache of their strings ``kept`` (content ids ``tokens``)."""
    cache = build_cache(encoder, tokens, layers, token_level, dtype, progress)
    row_of = np.full(len(pairs.strings), -1, np.int64)
    row_of[kept] = np.arange(len(kept))
    q, t = pairs.subset(rows)
    return Split(*(torch.from_numpy(a) for a in (row_of[q], row_of[t], q, t)), cache)


def cache_dtype(cfg: TrainConfig) -> torch.dtype:
    """The training side's cache: bf16 halves token-level caches (``auto``); per-text means
    are small, so fp32. The held-out side is always fp32."""
    if cfg.cache_dtype == "auto":
        return torch.bfloat16 if cfg.token_level else torch.float32
    return torch.bfloat16 if cfg.cache_dtype == "bf16" else torch.float32


def _fit_budget(pairs: Pairs, train_rows: np.ndarray, val_rows: np.ndarray,
                train_cost: np.ndarray, val_cost: np.ndarray, cfg: TrainConfig,
                log: Log) -> np.ndarray:
    """The longest prefix of the (shuffled) training pairs whose states fit the budget once
    the held-out ones (``val_cost``: fp32 bytes per string) are cached."""
    q, t = pairs.subset(val_rows)
    val_bytes = int(val_cost[np.unique(np.concatenate([q, t]))].sum())
    q, t = pairs.subset(train_rows)
    room = cfg.memory_budget - val_bytes
    n_fit = int(np.searchsorted(np.cumsum(train_cost[q] + train_cost[t]), room, side="right"))
    if n_fit < 2:
        raise ConfigError(
            f"memory_budget {cfg.memory_budget} bytes is too small: the held-out pairs alone "
            f"need {val_bytes} bytes of cached states (raise --memory-budget or lower "
            "--max-pairs / the number of layers)"
        )
    if n_fit < len(train_rows):
        log(f"caching {n_fit} of {len(train_rows)} training pairs to stay within the "
            f"memory budget of {cfg.memory_budget} bytes")
    return train_rows[:n_fit]


def _fit(head: PoolingHead, train_split: Split, val_split: Split, cfg: TrainConfig,
         log: Log) -> tuple[list[dict], int, dict]:
    """Epochs of InfoNCE with early stopping: the history, the best epoch and its weights."""
    k = cfg.k
    first = evaluate(head, val_split, k)
    history = [{"epoch": 0, "train_loss": None, **first}]
    log(f"epoch 0 (untrained head): held-out MRR@{k} {first[f'mrr@{k}']:.4f}")
    best, best_state, best_epoch, stale = first[f"mrr@{k}"], _copy(head), 0, 0
    optimizer = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    generator = torch.Generator().manual_seed(cfg.seed)
    for epoch in range(1, cfg.epochs + 1):
        loss = _epoch(head, optimizer, train_split, cfg, generator)
        if not np.isfinite(loss):
            raise ConfigError(f"training diverged in epoch {epoch} (train loss {loss}): no "
                              "head saved; lower --lr or raise --temperature")
        scores = evaluate(head, val_split, k)
        history.append({"epoch": epoch, "train_loss": loss, **scores})
        log(f"epoch {epoch}: train loss {loss:.4f}, held-out MRR@{k} {scores[f'mrr@{k}']:.4f}, "
            f"recall@{k} {scores[f'recall@{k}']:.4f}")
        if scores[f"mrr@{k}"] > best + 1e-6:
            best, best_state, best_epoch, stale = scores[f"mrr@{k}"], _copy(head), epoch, 0
        else:
            stale += 1
            if stale >= cfg.patience:
                log(f"early stop: no better held-out MRR@{k} for {stale} epochs")
                break
    return history, best_epoch, best_state


def _untrained_note(first: dict, k: int, n_val: int) -> str:
    """Why the saved head is the untrained one: no epoch beat it on the held-out pairs (too
    few of them to tell heads apart, or it already ranks every query's text first)."""
    why = (f"it already ranks every held-out query's text first (MRR@{k} 1.0)"
           if first[f"mrr@{k}"] >= 1.0 - 1e-9 else "training did not improve on it")
    return (f"note: no epoch beat the untrained head on the {n_val} held-out pairs, so the "
            f"head saved is the untrained one: {why}; add pairs, or raise --val-fraction, so "
            "that the held-out split can tell heads apart")


def _copy(head: PoolingHead) -> dict:
    return copy.deepcopy(head.state_dict())


def _epoch(head: PoolingHead, optimizer: torch.optim.Optimizer, split: Split, cfg: TrainConfig,
           generator: torch.Generator) -> float:
    head.train()
    order = torch.randperm(len(split), generator=generator)
    losses = []
    with torch.enable_grad():
        for start in range(0, len(order), cfg.batch_size):
            batch = order[start : start + cfg.batch_size]
            if len(batch) < 2:  # one pair has no in-batch negative
                continue
            loss = info_nce(head, split, batch, cfg.temperature)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    head.eval()
    return float(np.mean(losses))


def info_nce(head: PoolingHead, split: Split, batch: torch.Tensor,
             temperature: float) -> torch.Tensor:
    """Symmetric InfoNCE over the batch; equal texts or queries are not counted as negatives."""
    q = F.normalize(head(*split.cache.batch(split.query[batch])), dim=-1)
    t = F.normalize(head(*split.cache.batch(split.text[batch])), dim=-1)
    logits = q @ t.T / temperature
    tk, qk = split.text_key[batch], split.query_key[batch]
    same = (tk[:, None] == tk[None, :]) | (qk[:, None] == qk[None, :])
    same.fill_diagonal_(False)
    logits = logits.masked_fill(same, float("-inf"))
    target = torch.arange(len(batch))
    return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2


@torch.no_grad()
def head_vectors(head: PoolingHead, cache: StateCache, rows: torch.Tensor,
                 batch_size: int = 512) -> np.ndarray:
    """Unit-length head outputs for cache ``rows``."""
    out = [F.normalize(head(*cache.batch(rows[s : s + batch_size])), dim=-1)
           for s in range(0, len(rows), batch_size)]
    return torch.cat(out).numpy()


def evaluate(head: PoolingHead, split: Split, k: int) -> dict[str, float]:
    """Exact search of each held-out query over the distinct held-out texts."""
    head.eval()
    texts, gold = torch.unique(split.text, return_inverse=True)
    return retrieval_metrics(head_vectors(head, split.cache, split.query),
                             head_vectors(head, split.cache, texts), gold.numpy(), k)


def _summary(history: list[dict], best_epoch: int, cfg: TrainConfig, n_train: int, n_val: int,
             skipped: int) -> dict[str, float]:
    k = cfg.k
    best = history[best_epoch]
    first = history[0]
    return {
        f"val_mrr@{k}": best[f"mrr@{k}"],
        f"val_recall@{k}": best[f"recall@{k}"],
        f"val_mrr@{k}_untrained": first[f"mrr@{k}"],
        f"val_recall@{k}_untrained": first[f"recall@{k}"],
        "best_epoch": float(best["epoch"]),
        "epochs_run": float(len(history) - 1),
        "train_pairs": float(n_train),
        "val_pairs": float(n_val),
        "skipped_pairs": float(skipped),
    }
