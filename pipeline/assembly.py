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
name is the built-in pooler of that name with defaults.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipeline.config import EmbedJob, EncoderConfig, load_toml, parse
from pipeline.errors import ConfigError

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
    encoder = dict(file.pop("encoder", {}))
    for key in EncoderConfig.model_fields:  # [encoder] keys may stand at the top level too
        if key in file:
            encoder[key] = file.pop(key)
    defined = {p.get("name"): p for p in file.pop("poolers", [])}
    encoder |= {k: chosen[k] for k in ENCODER_OPTIONS if k in chosen}
    window = {field: chosen[k] for k, field in WINDOW_OPTIONS.items() if k in chosen}
    if window:
        encoder["window"] = dict(encoder.get("window") or {}) | window
    job = {**file, "corpus": str(corpus), "out": str(out), "encoder": encoder}
    job |= {k: chosen[k] for k in JOB_OPTIONS if k in chosen}
    names = list(poolers or []) or list(defined)
    if names:  # none: EmbedJob picks the model's default set (`model` or `mean`)
        job["poolers"] = [defined.get(n, {"name": n}) for n in names]
    return parse(EmbedJob, job, f"embedding job{' (' + config + ')' if config else ''}")


def job_params(job: EmbedJob) -> dict:
    """The job as flow parameters: only the fields chosen, so EMBEDPIPE_* settings still apply."""
    return job.model_dump(mode="json", exclude_unset=True)


def resolve_job(params: dict) -> EmbedJob:
    """Flow parameters as a run sees them: this installation's ``EMBEDPIPE_*`` settings (and
    ``EMBEDPIPE_CONFIG``) fill what the job leaves out, and file-given values that other modules
    read from the environment are exported."""
    from pipeline.settings import load_settings

    settings = load_settings()
    settings.export_env()
    return parse(EmbedJob, settings.apply_to_job(params), "embedding job")


def inherit_encoder(job: dict) -> dict:
    """A backfill job that names no model takes the encoder that made the sets already in OUT.

    Encoder fields the job does set (device, dtype, ...) stay as given.
    """
    from pipeline.sets import SetFolder, list_sets

    spec = parse(EmbedJob, job, "backfill job")
    existing = list_sets(spec.out)
    if not existing:
        raise ConfigError(f"{spec.out} has no sets to backfill next to; use `embedpipe embed`")
    given = dict(job.get("encoder") or {})
    if given.get("model") is not None:
        return job
    encoder = SetFolder(spec.out, existing[0]).meta().encoder
    encoder.pop("trust_remote_code", None)  # never taken from a file, only from the job's config
    return job | {"encoder": encoder | given}


def check_input(job: EmbedJob) -> None:
    """The checks that need no model and no orchestration: the corpus exists, is Parquet and
    has the id and text columns. Run before a flow starts, so bad input fails in seconds."""
    from pipeline.corpus import describe

    describe(job.corpus, job.id_column, job.text_column)
