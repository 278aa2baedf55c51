"""What every part of the time model reads of one rank's step (``planner/time.py`` builds it)."""

from __future__ import annotations

from dataclasses import dataclass

from autopar.config.sections import JobConfig
from autopar.models.args import ModelArgs
from autopar.parallel.mesh import ParallelDims
from autopar.parallel.pipelining.schedule import SCHEDULE_STYLES, schedule_name
from autopar.planner.block_bytes import Sizes
from autopar.planner.devices import DeviceSpec
from autopar.planner.rates import Rates


@dataclass(frozen=True)
class Step:
    """What every part of ``predict_time`` reads of one rank's step, and the plan it is of."""

    tokens: int  # of the whole step, all ranks
    micro_batches: int  # this rank runs
    layers: float  # blocks of the busiest pipeline rank
    imbalance: float  # that rank's share of the model's FLOPs over an even share (1 unpipelined)
    linear_layers: float  # of them, Gated DeltaNets
    moe_layers: int  # of the whole model
    rate: float  # FLOP/s of the model's FLOPs, blended over its kinds
    rates: Rates
    z: Sizes
    cp_impl: str  # ring or allgather
    args: ModelArgs
    job: JobConfig
    dims: ParallelDims
    device: DeviceSpec
    gpus_per_node: int

    @property
    def recomputes(self) -> int:
        """How many times the step recomputes what checkpointing dropped: twice under a split
        backward (the input- and weight-gradient passes each recompute it), else once."""
        split = SCHEDULE_STYLES[schedule_name(self.job.parallelism)].splits_backward
        return 2 if self.dims.pp > 1 and split else 1
