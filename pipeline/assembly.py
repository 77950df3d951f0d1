"""Job assembly: a TOML file and options into one validated EmbedJob, the same for every caller.

The CLI, the Python API (``embedpipe.embed`` / ``backfill``) and the Prefect deployments all
build jobs here, so a flag, a keyword argument and a deployment parameter mean the same.

Options are flat, named like the CLI flags (``model``, ``device``, ``dtype``, ``int8_kernel``,
``max_length``, ``compile``, ``window``, ``stride``, ``window_agg``, ``id_column``,
``text_column``, ``runner``, ``dask_address``, ``workers``, ``rows_per_shard``, ``quarantine``,
``dedupe``); ``None`` means
"not chosen", so the config file, then the installation's ``EMBEDPIPE_*`` settings apply.

Config file (all keys optional; options win)::

    rows_per_shard = 20000
    runner = "threads"
    [encoder]
    model = "/models/minilm"
    max_length = 256
    window = { size = 128, stride = 96, agg = "mean" }
    [[poolers]]
    name = "cls_last4"
    strategy = "cls"
    layers = [-1, -2, -3, -4]

``poolers`` picks sets: a name defined under ``[[poolers]]`` keeps its options, any other
name is the built-in pooler of that name with defaults; none picked, a run works on the sets
already in OUT (``keep_sets_current``), or makes the model's default set in an OUT without.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pipeline.config import EmbedJob, EncoderConfig, PoolerSpec, load_toml, parse
from pipeline.errors import ConfigError

if TYPE_CHECKING:
    from pipeline.models.loader import ModelFiles
    from pipeline.sets import SetMeta

ENCODER_OPTIONS = ("model", "device", "dtype", "int8_kernel", "max_length", "compile")
WINDOW_OPTIONS = {"window": "size", "stride": "stride", "window_agg": "agg"}
JOB_OPTIONS = ("id_column", "text_column", "runner", "dask_address", "workers",
               "rows_per_shard", "quarantine", "dedupe", "lease_wait")
OPTIONS = (*ENCODER_OPTIONS, *WINDOW_OPTIONS, *JOB_OPTIONS)


def build_job(corpus: str, out: str, *, config: str | None = None,
              poolers: Sequence[str] | None = None, **options: Any) -> EmbedJob:
    """Config file first, options over it, validated into one EmbedJob."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ConfigError(f"unknown job option(s) {', '.join(unknown)}; "
                          f"known: {', '.join(OPTIONS)}")
    chosen = {k: v for k, v in options.items() if v is not None}
    file = load_toml(config) if config else {}
    given = [k for k in ("corpus", "out") if k in file]
    if given:
        raise ConfigError(f"{config}: {' and '.join(given)} come(s) from the command line "
                          "(CORPUS OUT), not the config file")
    encoder, defined = _file_encoder(file, config), _file_poolers(file, config)
    encoder |= {k: chosen[k] for k in ENCODER_OPTIONS if k in chosen}
    window = {field: chosen[k] for k, field in WINDOW_OPTIONS.items() if k in chosen}
    if window:
        encoder["window"] = dict(encoder.get("window") or {}) | window
        if "size" not in encoder["window"]:
            given = ", ".join(f"--{k.replace('_', '-')}" for k in WINDOW_OPTIONS if k in chosen)
            raise ConfigError(f"{given} without a window size: give --window N (or the "
                              "config's window.size); a backfill takes its sets' windows whole "
                              "when none of --window, --stride, --window-agg is given")
    if isinstance(encoder.get("model"), str):
        encoder["model"] = _absolute(encoder["model"], folder_only=True)
    # absolute: a Dask worker elsewhere, or a served deployment, resolves no relative path
    # against the folder it was typed in (its lease was not found there: every run failed)
    job = {**file, "corpus": _absolute(str(corpus)), "out": _absolute(str(out)),
           "encoder": encoder}
    job |= {k: chosen[k] for k in JOB_OPTIONS if k in chosen}
    names = list(poolers or []) or list(defined)
    bad = next((n for n in names if not isinstance(n, str)), None)
    if bad is not None:
        raise ConfigError(f"poolers are named by str (options go in the config file's "
                          f"[[poolers]]), not {type(bad).__name__}: {bad!r}")
    if names:  # none: EmbedJob picks the model's default set (`model` or `mean`)
        job["poolers"] = [_absolute_head(defined.get(n, {"name": n})) for n in names]
    return parse(EmbedJob, job, f"embedding job{f' ({config})' if config else ''}")


def _file_encoder(file: dict, config: str | None) -> dict:
    """The config file's ``[encoder]`` table with the encoder keys given at its top level
    (taken out of ``file``); a key given in both places is refused."""
    encoder = file.pop("encoder", {})
    if not isinstance(encoder, dict):
        raise ConfigError(f"{config}: encoder must be a table ([encoder]), not {encoder!r}")
    encoder = dict(encoder)
    for key in EncoderConfig.model_fields:
        if key in file:
            if key in encoder:
                raise ConfigError(f"{config}: {key} is given both at the top level and in "
                                  "[encoder]; keep one")
            encoder[key] = file.pop(key)
    return encoder


def _file_poolers(file: dict, config: str | None) -> dict[str, dict]:
    """The config file's ``[[poolers]]`` by name (taken out of ``file``), each checked."""
    poolers = file.pop("poolers", [])
    if not isinstance(poolers, list) or not all(isinstance(p, dict) for p in poolers):
        raise ConfigError(f"{config}: poolers must be [[poolers]] tables, each with a name, "
                          f"not {poolers!r}")
    defined: dict[str, dict] = {}
    for pooler in poolers:
        name = pooler.get("name")
        if name in defined:
            raise ConfigError(f"{config}: [[poolers]] name {name!r} is defined twice")
        defined[name] = _read_options(pooler)
    return defined


LAYER_OPTIONS = ("layers", "layer_combine", "layer_weights")


def _read_options(pooler: dict) -> dict:
    """``pooler`` as written in a config file, refused where it gives an option its strategy
    never reads (the set would carry it in its fingerprint, and its key a head's files, for
    nothing): a learned head reads the layers it was trained on, only it reads a head."""
    name, strategy = pooler.get("name"), pooler.get("strategy") or pooler.get("name")
    unread = ([k for k in LAYER_OPTIONS if k in pooler] if strategy == "learned"
              else ["head"] if "head" in pooler else [])
    if unread:
        why = ("reads the layers its head was trained on (head.json)" if strategy == "learned"
               else "does not read a head: only strategy 'learned' does")
        raise ConfigError(f"pooler {name!r}: strategy {strategy!r} {why}; remove "
                          f"{', '.join(unread)}")
    return pooler


def _absolute_head(pooler: dict) -> dict:
    """A learned pooler's local head folder as an absolute path, as the corpus and model are:
    the set's fingerprint takes the path it records, and `query`, `serve` and later runs read
    the head from other folders."""
    head = pooler.get("head")
    return {**pooler, "head": _absolute(head)} if isinstance(head, str) else pooler


def _absolute(path: str, folder_only: bool = False) -> str:
    """A local path as an absolute one (``_SET.json`` records the corpus and model it names,
    and later runs, ``query`` and ``serve`` read them from other folders); URLs as given, and
    with ``folder_only`` anything but an existing folder (a Hugging Face model name)."""
    from pipeline import storage  # fsspec and Arrow: not at import (the CLI's start)

    if storage.is_remote(path) or not path.strip():  # "" is no path: the job refuses it
        return path
    local = storage.local_path(path)
    if folder_only and not os.path.isdir(local):
        return path
    return os.path.abspath(os.path.expanduser(local))


def job_params(job: EmbedJob) -> dict:
    """The job as flow parameters: only the fields chosen, so EMBEDPIPE_* settings still apply."""
    return job.model_dump(mode="json", exclude_unset=True)


def resolve_job(params: dict, keep_current: bool = True) -> EmbedJob:
    """Flow parameters as a run sees them: this installation's ``EMBEDPIPE_*`` settings (and
    ``EMBEDPIPE_CONFIG``) fill what the job leaves out, and file-given values that other modules
    read from the environment are exported. ``keep_current`` (every run but a backfill, which
    names the sets it adds): a job naming no pooler works on OUT's sets
    (``keep_sets_current``), decided on the job as given, before the settings fill it, so the
    options that made a set's vectors win over an installation's default model; its device and
    dtype apply."""
    from pipeline.settings import load_settings

    settings = load_settings()
    settings.export_env()
    given = parse(EmbedJob, params, "embedding job")
    metas = _stored_sets(given.out)  # read once for both
    if keep_current:
        given = keep_sets_current(given, settings.heads, metas)
    params = job_params(keep_layout(given, metas))
    return parse(EmbedJob, settings.apply_to_job(params), "embedding job")


def keep_layout(job: EmbedJob, metas: list[SetMeta] | None = None) -> EmbedJob:
    """A job that gives no ``rows_per_shard`` plans OUT's shards as its sets' last finished
    run did (``SetMeta.rows_per_shard``; the latest where sets differ): planned with another
    count, every shard of the corpus is another, and a rerun rewrote every part (vectors
    reused, a new generation for the indexes to catch up with), a backfill laid its set out
    apart from the others. ``metas``: OUT's sets, where the caller read them."""
    if "rows_per_shard" in job.model_fields_set:
        return job
    metas = _stored_sets(job.out) if metas is None else metas
    recorded = [(m.generation, m.rows_per_shard) for m in metas if m.rows_per_shard is not None]
    if not recorded:
        return job
    return job.model_copy(update={"rows_per_shard": max(recorded)[1]})


def keep_sets_current(job: EmbedJob, heads: str | None = None,
                      metas: list[SetMeta] | None = None) -> EmbedJob:
    """A job that names no pooler works on every set already in OUT: each with the pooler it
    was made with and, naming no model, with the encoder options that made their vectors
    (``_one_encoder``; options it does give stay as given). So the nightly run keeps a set
    backfilled after it was scheduled current too, a rerun resumes the sets it finds, and
    neither starts the model's default set beside them; an OUT without sets gets that default
    set.

    Sets are taken only where ``_SET.json`` alone says how to make them again: a learned set's
    head path is taken from a file in OUT only inside ``heads``, the operator's folder of heads
    (``EMBEDPIPE_HEADS``), and sets of different encoders cannot share one run; either fails
    in one line asking for the sets by name."""
    if "poolers" in job.model_fields_set:
        return job
    metas = _stored_sets(job.out) if metas is None else metas  # or as the caller read them
    if not metas:
        return job
    params = job.model_dump(mode="json", exclude_unset=True)
    params["poolers"] = [_stored_pooler(job.out, meta, heads) for meta in metas]
    encoder = _one_encoder(job.out, metas, "name the sets to run (--pooler, [[poolers]])")
    if "model" not in job.encoder.model_fields_set:
        params["encoder"] = encoder | params.get("encoder", {})
    return parse(EmbedJob, params, f"job keeping the sets of {job.out} current")


def _stored_sets(out: str) -> list[SetMeta]:
    """Every set's ``_SET.json`` in ``out``, by name."""
    from pipeline.sets import SetFolder, list_sets

    return [SetFolder(out, name).meta() for name in list_sets(out)]


def _stored_pooler(out: str, meta: SetMeta, heads: str | None) -> dict:
    """The pooler spec a set's ``_SET.json`` records, checked as a job's would be; a learned
    head's path only inside ``heads`` (links resolved)."""
    from pipeline import storage

    where = f"set {meta.name!r} in {out}"
    spec = parse(PoolerSpec, meta.pooler | {"name": meta.name}, f"pooler recorded by {where}")
    if spec.head is not None and not (heads and storage.is_under(spec.head, heads)):
        outside = f"outside EMBEDPIPE_HEADS ({heads})" if heads else "and EMBEDPIPE_HEADS is unset"
        raise ConfigError(f"{where} pools with the learned head {spec.head}, {outside}: a run "
                          "takes a head's path from OUT's files only inside the folder "
                          "EMBEDPIPE_HEADS names; keep the head there, or name the sets to run "
                          "(--pooler, [[poolers]] with its head)")
    return spec.model_dump(mode="json")


# the encoder options that make a set's vectors (its fingerprint covers them); the others
# (device, a float dtype, batch limits, compile) are the machine's: the job's or the settings'
VECTOR_OPTIONS = ("model", "max_length", "window", "prompt_name", "query_prompt_name")


def _one_encoder(out: str, metas: Sequence[SetMeta], ask: str) -> dict:
    """The encoder options that made the vectors of every set of ``metas``
    (``VECTOR_OPTIONS``, and dtype int8 with its kernel: other weights); sets whose vectors
    come from other model files, lengths or windows have none: the error ends by asking for
    what picks one (``ask``). The device, a float dtype and the batch limits a set was made
    with are left to this run (its flags, the installation's ``EMBEDPIPE_*``): a nightly run
    on a GPU pool runs there though the first run was on a CPU. ``trust_remote_code`` is never
    taken from a file, only from the job."""
    made = {}
    for meta in metas:
        prompts = [meta.encoder.get(k) for k in ("prompt_name", "query_prompt_name")]
        made.setdefault((meta.model_hash, meta.max_length, str(meta.window), str(prompts)),
                        []).append(meta)
    if len(made) > 1:
        groups = "; ".join(f"{', '.join(m.name for m in group)}: {_encoder_words(group[0])}"
                           for group in made.values())
        raise ConfigError(f"the sets in {out} were made by different encoders ({groups}); "
                          f"{ask}")
    made_by = metas[0].encoder
    kept = {k: made_by[k] for k in VECTOR_OPTIONS if k in made_by}
    if made_by.get("dtype") == "int8":
        kept |= {"dtype": "int8", "int8_kernel": made_by.get("int8_kernel", "auto")}
    return kept


def _encoder_words(meta: SetMeta) -> str:
    """What made a set's vectors, in a few words: model, max length, windows."""
    window = meta.window or {}
    windows = f", windows of {window.get('size')} every {window.get('stride')}" if window else ""
    prompts = "".join(f", {k.replace('_', ' ')} {meta.encoder[k]!r}"
                      for k in ("prompt_name", "query_prompt_name") if meta.encoder.get(k))
    return f"{meta.model}, max length {meta.max_length}{windows}{prompts}"


def inherit_encoder(job: dict) -> dict:
    """A backfill job takes the encoder options that made the vectors of the sets already in
    OUT (``_one_encoder``); options it gives must be theirs. One that differs (another model,
    max length, window, prompt, or int8 against floats) would make its sets with another
    encoder: every later run that names no pooler (the nightly) would then fail asking for the
    sets by name, so it is refused; ``embed --pooler`` adds such a set deliberately. Where the
    sets in OUT already differ, the job must name its whole encoder (``--model`` and its
    options)."""
    spec = parse(EmbedJob, job, "backfill job")
    metas = _stored_sets(spec.out)
    if not metas:
        raise ConfigError(f"{spec.out} has no sets to backfill next to; use `embedpipe embed`")
    given = dict(job.get("encoder") or {})
    try:
        encoder = _one_encoder(spec.out, metas, "name the encoder to backfill with (--model "
                                                 "and its options)")
    except ConfigError:
        if given.get("model") is not None:
            return job
        raise
    differs = _other_encoder(encoder, given)
    if differs:
        raise ConfigError(
            f"backfill: {differs} would make the new sets with another encoder than the sets "
            f"in {spec.out}, and runs that name no pooler (the nightly) would then have to name "
            "their sets; leave the option out (the backfill takes theirs), or add the sets with "
            "`embedpipe embed CORPUS OUT --pooler NAME ...`"
        )
    return job | {"encoder": encoder | given}


def _other_encoder(kept: dict, given: dict) -> str:
    """What of ``given`` changes the vectors the encoder options ``kept`` make ('' where
    nothing does): the ``VECTOR_OPTIONS``, and int8 (with its kernel) against floats."""
    made = parse(EncoderConfig, kept, "the sets' encoder")
    asked = parse(EncoderConfig, kept | given, "the backfill's encoder")
    changed = [f"{name.replace('_', ' ')} {getattr(made, name)} -> {getattr(asked, name)}"
               for name in VECTOR_OPTIONS if getattr(made, name) != getattr(asked, name)]
    if (made.dtype == "int8") != (asked.dtype == "int8") or (
            made.dtype == "int8" and made.int8_kernel != asked.int8_kernel):
        changed.append(f"dtype {_weights(made)} -> {_weights(asked)}")
    return "; ".join(changed)


def _weights(config: EncoderConfig) -> str:
    """The weights an encoder runs: int8 (a kernel's) or float (fp32, bf16, fp16 alike)."""
    return f"int8 ({config.int8_kernel})" if config.dtype == "int8" else "float"


def check_input(job: EmbedJob) -> None:
    """The checks that need no model, no orchestration and no torch (a rerun with nothing to
    do imports none): the corpus exists, is Parquet and has the id and text columns; a model
    the job names is a model folder here, or in the local Hugging Face cache (not checked for
    a Dask cluster, whose machines hold their own). Run before a flow starts, so bad input
    fails in seconds. The poolers it names, the dtype and max_length, whose checks import
    torch, are checked here where the run will load the model anyway (a set is new, or was
    made by another job), before the run takes OUT's writer lease; else at the model's load,
    or by ``check_runs`` for a schedule."""
    from pipeline.corpus import describe
    from pipeline.models.folder import resolve_model_dir
    from pipeline.run import needs_model

    describe(job.corpus, job.id_column, job.text_column, job.out)
    if job.encoder.model is not None and job.runner != "dask":
        resolve_model_dir(job.encoder.model)
    if job.dask_address is not None:
        check_scheduler(job.dask_address)
    if job.poolers and needs_model(job):
        check_model_choices(job)


def check_scheduler(address: str, timeout_s: float = 10.0) -> None:
    """The Dask scheduler at ``address`` (``tcp://host:port``, ``tls://…``) takes a
    connection: one at a closed port failed after Prefect's 30 s with a traceback of
    distributed's, once the run had created OUT's sets."""
    import socket
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(address if "://" in address else f"tcp://{address}")
        host, port = parts.hostname, parts.port
    except ValueError as exc:
        raise ConfigError(f"--dask-address {address!r} is not a scheduler address: {exc}") from None
    if parts.scheme not in ("tcp", "tls") or not host or port is None:
        raise ConfigError(f"--dask-address {address!r} is not a scheduler address "
                          "(tcp://HOST:PORT or tls://HOST:PORT)")
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        raise ConfigError(f"cannot reach the Dask scheduler at {address}: "
                          f"{exc.strerror or type(exc).__name__}") from None


def check_model_choices(job: EmbedJob) -> None:
    """Each set's pooler is a known one; where this machine runs the job (not a Dask
    cluster's, whose machines may differ and hold their own models), the device, the dtype
    on it, and a ``max_length`` the model reads in a row (from its config: no weights
    load). Imports torch."""
    from pipeline.poolers.base import pooler_class

    for spec in job.poolers:
        pooler_class(spec)
    if job.runner == "dask":
        return
    from pipeline.precision import check_dtype, choose_device

    check_dtype(job.encoder.dtype, choose_device(job.encoder.device))
    if job.encoder.max_length or job.encoder.window:
        from pipeline.models.loader import read_model_files

        row_tokens(job, read_model_files(job.encoder.model))


def row_tokens(job: EmbedJob, files: ModelFiles) -> tuple[int, str]:
    """The tokens of a run's longest row (a window's size, else ``max_length`` or what the
    model reads) and what sets it, as the run's load makes them, after checking
    ``max_length`` and the window's size against the model's config (a window wider than the
    rows the model reads failed at its load, inside the run): the recorded config where a run
    recorded it (transformers not imported), else read and recorded for the run's own load."""
    from pipeline.models import loader, recorded

    trusted = job.encoder.trust_remote_code
    loader.refuse_remote_code(files, trusted)
    try:
        config, _ = recorded.load(files, files.model_hash(), trusted)
    except (OSError, ValueError, KeyError) as exc:  # as the encoder's load says it
        raise loader.load_failed(files.folder, exc) from None
    encoder = job.encoder
    if encoder.max_length:
        loader.check_max_length(encoder.max_length, config, files.folder)
    # the rows a run reads, as its load makes them (Encoder.check_window refuses wider ones)
    usable = encoder.max_length or loader.max_length(files, config)
    if encoder.window is None:
        return usable, f"max_length {usable}"
    if encoder.window.size > usable:
        where = "max_length" if encoder.max_length else f"the tokens model {files.folder} reads"
        raise ConfigError(f"window size {encoder.window.size} is above {where} ({usable})")
    return encoder.window.size, f"window size {encoder.window.size}"


def check_runs(job: EmbedJob) -> None:
    """What the model load of every run of ``job`` would refuse, checked without loading
    the model (a schedule's, before it is served): the job resolved as a run resolves it
    (``EMBEDPIPE_*`` settings, OUT's sets), its model's files, then its poolers and dtype."""
    from pipeline.models.loader import read_model_files, refuse_remote_code

    spec = resolve_job(job_params(job))
    files = read_model_files(spec.encoder.model)
    refuse_remote_code(files, spec.encoder.trust_remote_code)
    check_model_choices(spec)
    _check_heads_fit(spec, files)


def _check_heads_fit(job: EmbedJob, files: ModelFiles) -> None:
    """Each learned head was trained for the job's model and, positional, covers the rows'
    tokens, as ``Learned`` checks at every run's model load, from ``head.json`` alone; under
    dtype int8 with the kernel chosen at load, for any kernel (each has its own hash)."""
    from pipeline.head_files import check_positions, check_trained_for, read_head_config
    from pipeline.models.hashing import INT8_SUFFIXES, quantized_hash

    encoder = job.encoder
    kernels = ([None] if encoder.dtype != "int8" else
               list(INT8_SUFFIXES) if encoder.int8_kernel == "auto" else [encoder.int8_kernel])
    fits = {quantized_hash(files.model_hash(), kernel) for kernel in kernels}
    heads = {spec.name: spec.head for spec in job.poolers if spec.head is not None}
    tokens = row_tokens(job, files) if heads else None
    for name, folder in heads.items():
        cfg = read_head_config(folder)
        check_trained_for(folder, cfg, fits, str(files.folder))
        check_positions(name, folder, cfg, *tokens)
