"""Incremental decoding for every model family: the state a layer carries between calls
(``state``), the sampler (``sampling``), the generation loop (``generate``) and speculative
decoding with Qwen3.5's MTP head (``speculative``)."""

from autopar.models.generation.generate import generate
from autopar.models.generation.sampling import Sampling
from autopar.models.generation.speculative import speculative_generate
from autopar.models.generation.state import Decoder

__all__ = ["Decoder", "Sampling", "generate", "speculative_generate"]
