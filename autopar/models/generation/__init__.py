"""Incremental decoding for every model family: the state a layer carries between calls
(``state``), the sampler (``sampling``) and the generation loop (``generate``)."""

from autopar.models.generation.generate import generate
from autopar.models.generation.sampling import Sampling
from autopar.models.generation.state import Decoder

__all__ = ["Decoder", "Sampling", "generate"]
