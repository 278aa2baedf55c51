"""The training loop. It calls builders and runs steps; the logic lives in the builders."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from autopar.config.errors import ConfigError
from autopar.config.sections import JobConfig
from autopar.data.errors import DataError
from autopar.data.tokenizer import build_tokenizer
from autopar.models.args import ModelArgs
from autopar.models.hf import HFTensors
from autopar.parallel.materialize import FullValue, seeded_values, tensor_values
from autopar.parallel.mesh import ParallelDims, build_meshes
from autopar.parallel.parallelize import build_parts
from autopar.parallel.world import CollectiveTimeout, World
from autopar.training.announce import announce
from autopar.training.checkpointing.checkpoint import Checkpointer
from autopar.training.checkpointing.hf_export import export_run
from autopar.training.checkpointing.previous_run import settings_record
from autopar.training.checkpointing.resume_checks import (
    check_resumed_base,
    check_resumed_tokenizer,
    data_identity,
    follow_this_job,
    lora_base,
    warn_changed_data_shape,
)
from autopar.training.faults import (
    StopRequest,
    TrainingStopped,
    nonfinite,
    out_of_memory,
    parameters_finite,
    peer_failure,
    ranks_not_finite,
    skipped_too_often,
)
from autopar.training.metrics.flops import flops_per_token
from autopar.training.metrics.logger import MetricsLogger
from autopar.training.metrics.profiling import Profiler
from autopar.training.metrics.sinks import build_sinks
from autopar.training.objectives.base import StepOutcome
from autopar.training.objectives.build import build_objective
from autopar.training.objectives.dpo.job import runs_reference_forward
from autopar.training.optim import lr_factor
from autopar.training.plan_runner import PlanRunner
from autopar.training.resolve import tokenizer_path
from autopar.training.sample_prompts import PromptSampler
from autopar.training.samples import check_held_out, held_out_samples, job_samples, step_loader, validator
from autopar.training.step import TrainStep

logger = logging.getLogger("autopar")


@dataclass(frozen=True)
class StepRecord:
    step: int
    loss: float
    grad_norm: float
    aux_loss: float | None = None
    """A mixture-of-experts model's load-balancing loss."""


class Trainer:
    """Builds everything a validated job needs on this rank, then trains it."""

    def __init__(self, job: JobConfig, args: ModelArgs, world: World) -> None:
        self.job = job
        self.args = args
        self.world = world
        tokenizer = build_tokenizer(tokenizer_path(job))
        self.dims = ParallelDims.resolve(job.parallelism, world.size)
        samples = job_samples(job, tokenizer)  # first: bad data is refused before any real work
        held_out = held_out_samples(job, tokenizer) if job.validation.enable else None
        if held_out is not None:
            check_held_out(job, held_out, self.dims.dp)
        torch.manual_seed(job.debug.seed)
        if job.debug.deterministic:
            torch.use_deterministic_algorithms(True)
        self.meshes = build_meshes(self.dims, world.device.type, always_fsdp=job.training.enable_cpu_offload)
        initial = self._initial_values()
        runner = PlanRunner(
            job, world, self.meshes, build_parts(args, job, self.meshes, world.device, initial)
        )
        built = build_objective(job, args, runner, initial, samples)
        self.reference = built.reference
        """A frozen reference copy (DPO's ``reference = "copy"``, RL's with beta > 0)."""
        self.train_step = TrainStep(runner, built.objective)
        self.parts, self.optimizers = self.train_step.parts, self.train_step.optimizers
        self.loader = built.loader or step_loader(job, samples, self.meshes, world.device)
        self.validator = (
            validator(job, held_out, self.train_step, self.loader) if held_out is not None else None
        )
        self.sampler = PromptSampler(job, args, tokenizer, world) if job.validation.sample_prompts else None
        self.checkpointer = Checkpointer(
            job.checkpoint,
            job.job.dump_folder,
            world.rank,
            args,
            self.parts,
            self.optimizers,
            job.comm.init_timeout_seconds,
            job.lora,
        )
        self.metrics = self._metrics_logger()
        self.timeout = CollectiveTimeout(job.comm.init_timeout_seconds)  # what init_world made the group with
        self.step = 0
        self.bad: list[str] = []  # what was not finite at the last step
        self.skipped_in_a_row = 0
        self.nothing_learned = False  # the last step's batch had no learned token
        self.steps_with_nothing_learned = 0
        self.window_tokens: torch.Tensor | int = 0
        """Tokens trained since the last log line (preference steps differ in size)."""

        self.weights_from: Path | None = None
        """The checkpoint holding the weights of ``self.step``: the one resumed or last saved."""
        self.data = data_identity(job, samples)
        check_resumed_tokenizer(self.checkpointer, self.data)
        check_resumed_base(self.checkpointer, job)
        announce(job, args, self.dims, world, samples, self.loader.global_batch)

    def _metrics_logger(self) -> MetricsLogger:
        job, world = self.job, self.world
        return MetricsLogger(
            job.job.dump_folder,
            flops_per_token(
                self.args, job.training.seq_len, job.lora.enable, reference=runs_reference_forward(job)
            ),
            self.loader.global_batch * job.training.seq_len,
            job.training.steps,
            world.device,
            world.size,
            world.is_main,
            build_sinks(job, world.is_main, resuming=self.checkpointer.resume_candidate() is not None),
        )

    def _initial_values(self) -> FullValue:
        checkpoint = self.job.checkpoint
        if checkpoint.initial_load_path is not None and checkpoint.initial_load_in_hf:
            logger.info("initial weights from HF folder %s", checkpoint.initial_load_path)
            return tensor_values(HFTensors(checkpoint.initial_load_path, self.args), self.world.device)
        return seeded_values(self.args, self.job.debug.seed, self.world.device)

    def restore(self) -> None:
        """Resume from the latest checkpoint, or load initial weights from a DCP folder."""
        checkpoint = self.job.checkpoint
        step = self.checkpointer.resume_step() if checkpoint.enable else None
        if step is not None:
            self.weights_from = self.checkpointer.folder / f"step-{step}"
        if step is not None and step >= self.job.training.steps and self.checkpointer.model_only(step):
            self.step = step  # a finished run whose last save holds the model only: nothing to do
        elif step is not None:
            if self.job.lora.enable and checkpoint.initial_load_path and not checkpoint.initial_load_in_hf:
                self.checkpointer.load_model_only(checkpoint.initial_load_path)  # the adapters' frozen base
            state = self.checkpointer.load(step)
            self.step = state["step"]
            follow_this_job(self.job, self.args, self.optimizers, self.checkpointer, self.step, state)
            warn_changed_data_shape(self.step, state, self.data, self._batch_shape())
            self.loader.load_state_dict({"consumed_samples": state["consumed_samples"]})
        elif checkpoint.initial_load_path is not None and not checkpoint.initial_load_in_hf:
            logger.info("initial weights from DCP folder %s", checkpoint.initial_load_path)
            self.checkpointer.load_model_only(checkpoint.initial_load_path)
        self._check_loaded_weights(f"checkpoint step-{step}" if step is not None else None)
        self.metrics.forget_after(self.step)  # steps logged after it (by a run that died) run again

    def _check_loaded_weights(self, resumed: str | None) -> None:
        """Weights read from files are finite: a NaN in a download would otherwise surface
        as a NaN loss at step 1, with advice about the learning rate and the data."""
        source = resumed or self.job.checkpoint.initial_load_path
        if source is not None and not parameters_finite(self.parts):
            raise ConfigError(
                f"the weights loaded from {source} are not finite (NaN or inf); re-download or "
                "re-export them, or start from other weights"
            )

    def _batch_shape(self) -> dict[str, int]:
        """How samples are cut and batched."""
        return {"seq_len": self.job.training.seq_len, "global_batch_size": self.loader.global_batch}

    def _data_shape(self) -> dict[str, int | str]:
        """What a checkpoint records of the data: how samples were cut and batched, and from
        which files and tokenizer."""
        return {**self._batch_shape(), **self.data}

    def run_step(self) -> tuple[StepOutcome, torch.Tensor]:
        """The next optimizer step on the loader's next batches; its numbers and grad norm as
        device tensors. A step whose loss or gradient norm is not finite makes no update (see
        ``autopar.training.faults``); reading them is this step's one host sync."""
        lr = self.job.optimizer.lr * lr_factor(self.step + 1, self.job.lr_scheduler, self.job.training.steps)
        outcome = self.train_step.forward_backward(self.loader.next_step())
        loss, norm = outcome.loss, self.train_step.grad_norm()
        self.step += 1
        loss_value, norm_value, targets = torch.stack([loss, norm, outcome.learned]).tolist()
        self._say_if_nothing_learned(targets)
        self.bad = nonfinite(loss_value, norm_value)
        if not self.bad:
            self.train_step.apply(lr, norm)
            self.skipped_in_a_row = 0
            return outcome, norm
        where = ranks_not_finite(outcome.local_loss, self.parts)
        self.train_step.discard()
        self.skipped_in_a_row += 1
        limit = self.job.training.max_skipped_steps
        if self.skipped_in_a_row > limit:
            raise skipped_too_often(self.step, self.bad, where, self.skipped_in_a_row, limit)
        logger.warning(
            "step %d: %s not finite (%s); skipped (no update)", self.step, " and ".join(self.bad), where
        )
        return outcome, norm

    def _say_if_nothing_learned(self, targets: float) -> None:
        """Count a step with no learned token in its whole batch (chat rows whose answers are
        all masked or cut off); the first is explained, each log line and the last line say it."""
        self.nothing_learned = targets == 0
        if not self.nothing_learned:
            return
        self.steps_with_nothing_learned += 1
        if self.steps_with_nothing_learned == 1:
            logger.warning(
                "step %d: no learned token in this step's batch (every label masked: prompts only, or "
                "answers cut off by training.seq_len), so its loss and grad_norm are 0; such steps are "
                "marked in the log and metrics.jsonl (no_learned_tokens) and counted at the end",
                self.step,
            )

    def train(self) -> list[StepRecord]:
        """Train to training.steps; returns the logged steps' records."""
        try:
            return self._train()
        except TrainingStopped:
            raise
        except DataError as err:  # found in a sample only when it is read
            raise TrainingStopped(f"step {self.step + 1}: {err}") from err
        except OSError as err:  # a full disk or a read-only folder under metrics or exports
            raise TrainingStopped(f"could not write after step {self.step}: {err}") from err
        except RuntimeError as err:
            stop = peer_failure(err, self.world.rank, self.job.comm.train_timeout_seconds) or out_of_memory(
                err, self.step + 1, self.world.rank, self.job.training.local_batch_size
            )
            if stop is None:
                raise
            raise stop from err

    def _train(self) -> list[StepRecord]:
        self.restore()
        steps, log_freq = self.job.training.steps, self.job.metrics.log_freq
        if self.step >= steps:
            logger.info(
                "already trained to step %d of training.steps=%d; raise it to continue", self.step, steps
            )
        records: list[StepRecord] = []
        window_start, window_steps = time.perf_counter(), 0
        first_step = self.step + 1
        stopped = False
        profiler = Profiler(self.job.profiling, self.job.job.dump_folder, self.world.rank, first_step)
        started = time.perf_counter()
        with StopRequest(self._what_a_stop_keeps()) as stop, profiler:
            while self.step < steps and not stopped:
                outcome, norm = self.run_step()
                profiler.step(self.step)
                if self.step == first_step:  # compiled and warmed up: from now on steps are quick
                    self.timeout.set(self.job.comm.train_timeout_seconds)
                window_steps += 1
                if outcome.tokens is not None:
                    self.window_tokens += outcome.tokens
                if self.step % log_freq == 0 or self.step in (1, steps):
                    elapsed = time.perf_counter() - window_start
                    records.append(self._log(outcome, norm, window_steps, elapsed))
                    window_start, window_steps = time.perf_counter(), 0
                    self.window_tokens = 0
                if (self.validator is not None or self.sampler is not None) and (
                    self.step % self.job.validation.freq == 0 or self.step == steps
                ):
                    self._validate()
                saved = self.checkpointer.should_save(self.step, steps)
                if saved:
                    self._save(model_only=self.step == steps and self.job.checkpoint.last_save_model_only)
                stopped = self.step < steps and stop.requested(self.world.device)  # the last step ends anyway
                if stopped:
                    self._stop_early(stop.signal_name or "a stop signal (on another rank)", saved)
        self.timeout.set(self.job.comm.init_timeout_seconds)  # a background save may still be writing
        self.checkpointer.close()
        exported = self._export_hf() if self.job.checkpoint.last_save_in_hf else None
        self.metrics.close()
        ended = f"stopped by {stop.signal_name or 'a stop signal'}" if stopped else "finished"
        self._summarize(records, time.perf_counter() - started, first_step, exported, ended)
        return records

    def _what_a_stop_keeps(self) -> str:
        checkpoint = self.job.checkpoint
        if checkpoint.enable:
            return "its checkpoint is saved"
        if checkpoint.last_save_in_hf:
            return "checkpointing is off; its HF export is written"
        return "checkpointing is off: nothing is saved"

    def _summarize(
        self, records: list[StepRecord], seconds: float, first_step: int, exported: Path | None, ended: str
    ) -> None:
        """The run's last line: what was trained, how it ended and where its outputs are."""
        ran = self.step - first_step + 1
        if ran <= 0:
            return
        last = f", last loss {records[-1].loss:.4f}" if records else ""
        if self.steps_with_nothing_learned:
            last += f", {self.steps_with_nothing_learned} with no learned token (loss 0)"
        outputs = [f"metrics {self.metrics.path}"]
        if self.checkpointer.last_saved is not None:  # never an earlier run's, left in the folder
            outputs.append(f"checkpoint {self.checkpointer.last_saved}")
        if exported is not None:
            outputs.append(f"HF export {exported}")
        logger.info(
            "%s at step %d of %d: %d step(s) in %.1fs%s | %s",
            ended,
            self.step,
            self.job.training.steps,
            ran,
            seconds,
            last,
            ", ".join(outputs),
        )

    def _log(self, outcome: StepOutcome, norm: torch.Tensor, steps: int, seconds: float) -> StepRecord:
        """Log this step's numbers (``steps`` trained in ``seconds`` since the last log)."""
        aux = outcome.aux_loss.item() if self.args.moe else None
        record = StepRecord(self.step, outcome.loss.item(), norm.item(), aux)
        lr = self.optimizers[0].param_groups[0]["lr"]
        self.metrics.record(
            self.step,
            record.loss,
            record.grad_norm,
            lr,
            steps,
            seconds,
            skipped=bool(self.bad),
            aux_loss=aux,
            no_learned_tokens=self.nothing_learned,
            tokens=int(self.window_tokens) if outcome.tokens is not None else None,
            extra=dict(zip(self.train_step.objective.metric_names, outcome.metrics.tolist())) or None,
        )
        return record

    def _stop_early(self, why: str, saved: bool) -> None:
        """Save this step (unless just saved) and say how to go on."""
        if not self.job.checkpoint.enable:
            logger.warning("stopped by %s after step %d; %s", why, self.step, self._what_a_stop_keeps())
            return
        if not saved:
            self._save()
        logger.warning(
            "stopped by %s after step %d and saved it; the same command resumes from there", why, self.step
        )

    def _validate(self) -> None:
        """The held-out loss of this step's weights, and its replies to the sample prompts, logged."""
        with self.timeout.longer(self.job.comm.init_timeout_seconds):  # the first pass compiles its forward
            if self.sampler is not None:
                self.sampler.run(self.step, self.parts[0])
            if self.validator is None:
                return
            result = self.validator.run()
        self.metrics.record_validation(self.step, result.loss, result.tokens, result.metrics)

    def _save(self, model_only: bool = False) -> Path:
        """A checkpoint of this step, refused when any weight is not finite."""
        if not parameters_finite(self.parts):
            raise TrainingStopped(
                f"step {self.step}: weights are not finite, so no checkpoint was written (the last "
                "one on disk is kept); lower optimizer.lr or training.max_norm and resume from it"
            )
        train = {
            "step": self.step,
            "consumed_samples": self.loader.consumed_samples,
            **self._data_shape(),
            **({"lora_base": lora_base(self.job)} if self.job.lora.enable else {}),
            "settings": settings_record(self.job, self.args),
        }
        with self.timeout.longer(self.job.comm.init_timeout_seconds):  # writing may keep some ranks long
            self.weights_from = self.checkpointer.save(train, model_only)
        return self.weights_from

    def _export_hf(self) -> Path:
        """Write ``<dump_folder>/hf/step-N`` of this step: the model, or under LoRA its peft
        adapter folder (and, with lora.merge_on_export, the merged model beside it as
        ``step-N-merged``). Returns the first."""
        ckpt = self.weights_from
        if ckpt is None or ckpt.name != f"step-{self.step}":  # not an earlier run's step-N
            ckpt = self._save()
        out = Path(self.job.job.dump_folder) / "hf" / f"step-{self.step}"
        if self.world.is_main:
            export_run(self.job, self.args, ckpt, out, self._initial_values)
        return out
