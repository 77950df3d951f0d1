"""One exception type for everything a user can get wrong; its message is the one-line reason."""


class EmbedpipeError(Exception):
    """A failure caused by input, configuration or stored state, explained in one line."""


class ConfigError(EmbedpipeError, ValueError):
    """Invalid configuration: unknown pooler, bad option, out-of-range layer, ..."""


class ModelError(EmbedpipeError):
    """A model folder or name that cannot be loaded as an encoder."""


class CorpusError(EmbedpipeError):
    """A corpus that cannot be read: missing columns, corrupt files, duplicate ids, empty."""


class StorageError(EmbedpipeError):
    """A path or URL that cannot be read or written (missing bucket, no credentials, ...)."""


class FingerprintError(EmbedpipeError):
    """Stored output made with another model or pooler than the one asked for."""


class TokenLimitError(EmbedpipeError):
    """A text longer than the model's rows where the caller asked not to truncate."""


class NonFiniteVectors(ModelError):
    """A pooler gave vectors holding a NaN or an infinity (no search would find them): the
    model's (or a pooling head's) weights hold one, or its activations overflow the dtype."""

    def __init__(self, pooler: str, count: int, row: int, example: str, dtype: str,
                 head: str | None = None) -> None:
        self.pooler, self.count, self.row, self.dtype, self.head = pooler, count, row, dtype, head
        super().__init__(self.explain(example))

    def explain(self, example: str) -> str:
        """The one line, with ``example`` naming a row whose vector is not finite
        (``row``: its position in the batch)."""
        weights = "the model's weights hold NaN or infinity"
        if self.head is not None:  # its weights are finite (load_head checks): its outputs
            weights = f"the pooling head {self.head}'s outputs overflow, or {weights}"
        cause = {"fp32": weights,
                 # dynamic int8 scales each batch's activations: they cannot overflow it
                 "int8": f"{weights}, or its int8 kernels gave them: try --dtype fp32",
                 }.get(self.dtype, f"its activations overflow {self.dtype}, or {weights}: "
                                   "try --dtype fp32")
        return (f"pooler {self.pooler!r} gave {self.count:,} vectors that are not finite "
                f"(NaN or infinity), one for {example}: {cause}")


class EmbedpipeWarning(UserWarning):
    """Something a caller of the Python API should know of an answer it got (an index older
    than its set, hits without snippets): what the CLI prints as a ``note:`` line."""
