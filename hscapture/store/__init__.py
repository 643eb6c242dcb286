"""The store on disk: safetensors shards plus an append-only JSONL index (FORMAT.md).

Writing (:mod:`~hscapture.store.writer`, with :mod:`~hscapture.store.shards`,
:mod:`~hscapture.store.index`, :mod:`~hscapture.store.records`) and reading
(:mod:`~hscapture.store.reader`, :mod:`~hscapture.store.verify`) share only the format
(:mod:`~hscapture.store.format`, :mod:`~hscapture.store.checksum`, :mod:`~hscapture.store.files`):
a reader never loads the writer. The store knows no ring and no wire; it speaks rows.
"""
