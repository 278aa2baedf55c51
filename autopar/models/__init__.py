"""Single-device Qwen2.5 / Qwen3 models and their HF interop. No parallel code lives here."""

from autopar.models.args import ModelArgs
from autopar.models.flavors import FLAVORS, get_flavor
from autopar.models.hf import HFCheckpointError, HFTensors, from_hf, read_hf_config, save_hf, to_hf
from autopar.models.qwen import Qwen, initial_value

__all__ = [
    "FLAVORS",
    "HFCheckpointError",
    "HFTensors",
    "ModelArgs",
    "Qwen",
    "from_hf",
    "get_flavor",
    "initial_value",
    "read_hf_config",
    "save_hf",
    "to_hf",
]
