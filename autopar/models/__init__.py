"""Single-device Qwen2.5 / Qwen3 / Qwen3.5 models and their HF interop. No parallel code lives here."""

from autopar.models.args import ModelArgs
from autopar.models.family import FAMILIES, build_model, family_of
from autopar.models.flavors import FLAVORS, get_flavor
from autopar.models.hf import HFTensors, from_hf, save_hf, to_hf
from autopar.models.hf_config import HFCheckpointError, read_hf_config
from autopar.models.qwen import Qwen

__all__ = [
    "FAMILIES",
    "FLAVORS",
    "HFCheckpointError",
    "HFTensors",
    "ModelArgs",
    "Qwen",
    "build_model",
    "family_of",
    "from_hf",
    "get_flavor",
    "read_hf_config",
    "save_hf",
    "to_hf",
]
