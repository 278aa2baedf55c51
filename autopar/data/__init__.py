"""Tokenizers, token streams, samples and per-rank step batches."""

from autopar.data.dataset import Blend, PackedWindows, SampleSource
from autopar.data.errors import DataError
from autopar.data.loader import IGNORE_INDEX, Batch, StepLoader, build_samples, check_data
from autopar.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, build_tokenizer

__all__ = [
    "IGNORE_INDEX",
    "Batch",
    "Blend",
    "ByteTokenizer",
    "DataError",
    "HFTokenizer",
    "PackedWindows",
    "SampleSource",
    "StepLoader",
    "Tokenizer",
    "build_samples",
    "build_tokenizer",
    "check_data",
]
