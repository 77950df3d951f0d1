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
