"""Reading a model folder as sentence-transformers saved it, one module per file.

``folder``: where a model lives; ``modules``: ``modules.json``; ``transformer``,
``pooling``, ``dense``, ``normalize``: each module's saved config (and weights);
``prompts`` and ``similarity``: ``config_sentence_transformers.json``; ``hashing``: the
cached model hash;
``loader``: the one place a model (tokenizer, transformer, head) is loaded.
Importing this package loads nothing.
"""
