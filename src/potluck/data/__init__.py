"""Training data: corpus files, tokenizers and deterministic global batches."""

from potluck.data.corpus import builtin_corpus_path, data_files, read_documents
from potluck.data.dataset import TokenDataset, build_dataset, replica_starts, tokenize_documents
from potluck.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    check_tokenizer_fits,
    load_tokenizer,
)

__all__ = [
    "ByteTokenizer", "HFTokenizer", "TokenDataset", "Tokenizer", "build_dataset",
    "builtin_corpus_path", "check_tokenizer_fits", "data_files", "load_tokenizer",
    "read_documents", "replica_starts", "tokenize_documents",
]
