"""Reading training text: ``.txt`` and ``.jsonl`` files, or a directory of them.

A ``.txt`` file is one document. A ``.jsonl`` file holds one JSON object per
line, each a document in its ``text`` field (other fields are ignored, blank
lines skipped). A directory is searched recursively for both kinds, in sorted
path order, so the document order never depends on the file system. Every
mistake (missing path, no text, a line without ``text``, a file over
:data:`MAX_DATA_FILE_BYTES`) is a one-line ConfigError that names the file and line.

A small English corpus ships with potluck (:func:`builtin_corpus_path`), so the
demo and the tests need nothing from the network.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

from potluck.errors import ConfigError
from potluck.yamlio import read_bounded

SUFFIXES = (".txt", ".jsonl")
MAX_DATA_FILE_BYTES = 4 << 30  # one file is read whole: split a larger corpus into files


def builtin_corpus_path() -> Path:
    """The directory of the corpus that ships with potluck."""
    return Path(str(resources.files("potluck.data") / "corpus"))


def data_files(path: str | Path) -> list[Path]:
    """The ``.txt``/``.jsonl`` files at ``path`` (a file or a directory), in sorted order."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"data path {str(path)!r} not found; give a .txt or .jsonl file "
                          "or a directory of them")
    if path.is_file():
        if path.suffix not in SUFFIXES:
            raise ConfigError(f"data file {str(path)!r}: expected a .txt or .jsonl file")
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
    if not files:
        raise ConfigError(f"data directory {str(path)!r} holds no .txt or .jsonl files")
    return files


def read_documents(path: str | Path) -> list[str]:
    """Every non-empty document at ``path``, in a fixed order."""
    documents = list(iter_documents(path))
    if not documents:
        raise no_text_error(path)
    return documents


def iter_documents(path: str | Path) -> Iterator[str]:
    """The non-empty documents at ``path`` in a fixed order, one file read at a time."""
    for file in data_files(path):
        found = _read_jsonl(file) if file.suffix == ".jsonl" else [_read_text(file)]
        yield from (doc for doc in found if doc.strip())


def no_text_error(path: str | Path) -> ConfigError:
    return ConfigError(f"data path {str(path)!r} holds no text (all documents are empty)")


def _read_text(file: Path) -> str:
    data = read_bounded(file, "data file", MAX_DATA_FILE_BYTES)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{file}: not UTF-8 text (byte {err.start})") from None


def _read_jsonl(file: Path) -> list[str]:
    documents = []
    for number, line in enumerate(_read_text(file).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{file}:{number}: malformed JSON: {err.msg}") from None
        text = record.get("text") if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise ConfigError(f"{file}:{number}: each line needs a string 'text' field")
        documents.append(text)
    return documents
