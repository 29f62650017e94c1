"""Training data: corpus files, tokenizers and deterministic global batches.

The dataset's names (which need torch) are imported when first used, so that reading
the corpus path or checking options does not import torch.
"""

from __future__ import annotations

from typing import Any

from potluck.data.corpus import builtin_corpus_path, data_files, read_documents
from potluck.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    check_tokenizer_fits,
    load_tokenizer,
)

_DATASET_NAMES = ("TokenDataset", "build_dataset", "replica_starts", "tokenize_documents")

__all__ = [
    "ByteTokenizer", "HFTokenizer", "TokenDataset", "Tokenizer", "build_dataset",
    "builtin_corpus_path", "check_tokenizer_fits", "data_files", "load_tokenizer",
    "read_documents", "replica_starts", "tokenize_documents",
]


def __getattr__(name: str) -> Any:
    if name not in _DATASET_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from potluck.data import dataset

    return getattr(dataset, name)
