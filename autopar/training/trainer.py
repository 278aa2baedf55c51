"""The training loop. It calls builders and runs steps; the logic lives in the builders."""

from __future__ import annotations

import functools
import hashlib
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from autopar.config.errors import ConfigError
from autopar.config.sections import JobConfig
from autopar.data.dataset import SampleSource
from autopar.data.errors import DataError
from autopar.data.loader import StepLoader, build_samples
from autopar.data.tokenizer import Tokenizer, build_tokenizer, tokenizer_file
from autopar.models.args import ModelArgs
from autopar.models.dtypes import DTYPES
from autopar.models.family import build_model
from autopar.models.hf import HFTensors, copy_assets
from autopar.models.hf_config import CONFIG_FILE
from autopar.parallel.lora import apply_lora
from autopar.parallel.materialize import FullValue, seeded_values, tensor_values
from autopar.parallel.mesh import ParallelDims, build_meshes
from autopar.parallel.parallelize import build_parts
from autopar.parallel.world import CollectiveTimeout, World
from autopar.training.adapters import BaseTensors, export_merged, save_adapter, saved_adapters
from autopar.training.checkpoint import (
    Checkpointer,
    export_hf,
    finish_interrupted_swap,
    read_model_tensors,
    swap_into_place,
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
from autopar.training.metrics import MetricsLogger, flops_per_token, matmul_params
from autopar.training.optim import follow_config, lr_factor
from autopar.training.previous_run import changed_settings, listed, settings_record
from autopar.training.profiling import Profiler
from autopar.training.resolve import chat_format, flavor_mismatch, model_source, tokenizer_path
from autopar.training.sinks import build_sinks
from autopar.training.step import TrainStep
from autopar.training.validation import Validator, validation_samples

logger = logging.getLogger("autopar")


@dataclass(frozen=True)
class StepRecord:
    step: int
    loss: float
    grad_norm: float
    aux_loss: float | None = None
    """A mixture-of-experts model's load-balancing loss."""


def data_identity(job: JobConfig, samples: SampleSource) -> dict[str, str]:
    """What the job trains on, as a checkpoint records it: the tokenizer (its file and a digest
    of it) and the dataset with its format."""
    path = tokenizer_path(job)
    if path is None:
        tokenizer, digest = "the built-in byte tokenizer", "byte"
    else:
        file = tokenizer_file(path)
        tokenizer, digest = str(file), hashlib.sha256(file.read_bytes()).hexdigest()
    return {
        "tokenizer": tokenizer,
        "tokenizer_sha256": digest,
        "dataset": f"{samples.describe()} as {job.training.dataset_format}",
    }


class Trainer:
    """Builds everything a validated job needs on this rank, then trains it."""

    def __init__(self, job: JobConfig, args: ModelArgs, world: World) -> None:
        self.job = job
        self.args = args
        self.world = world
        tokenizer = build_tokenizer(tokenizer_path(job))
        samples = self._samples(tokenizer)  # first: bad data is refused before any real work
        held_out = validation_samples(job, tokenizer) if job.validation.enable else None
        torch.manual_seed(job.debug.seed)
        if job.debug.deterministic:
            torch.use_deterministic_algorithms(True)
        self.dims = ParallelDims.resolve(job.parallelism, world.size)
        self.meshes = build_meshes(self.dims, world.device.type, always_fsdp=job.training.enable_cpu_offload)
        built = build_parts(args, job, self.meshes, world.device, self._initial_values())
        self.train_step = TrainStep(job, world, self.meshes, built)
        self.parts, self.optimizers = self.train_step.parts, self.train_step.optimizers
        self.loader = self._build_loader(samples)
        self.validator = (
            Validator(job, held_out, self.train_step, self.loader.dp_rank, world.device)
            if held_out is not None
            else None
        )
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
        self.metrics = MetricsLogger(
            job.job.dump_folder,
            flops_per_token(args, job.training.seq_len, job.lora.enable),
            self.loader.global_batch * job.training.seq_len,
            job.training.steps,
            world.device,
            world.size,
            world.is_main,
            build_sinks(job, world.is_main, resuming=self.checkpointer.resume_candidate() is not None),
        )
        self.timeout = CollectiveTimeout(job.comm.init_timeout_seconds)  # what init_world made the group with
        self.step = 0
        self.bad: list[str] = []  # what was not finite at the last step
        self.skipped_in_a_row = 0
        self.weights_from: Path | None = None
        """The checkpoint holding the weights of ``self.step``: the one resumed or last saved."""
        self.data = data_identity(job, samples)
        self._check_resumed_tokenizer()
        self._check_resumed_base()
        self._announce(samples)

    def _check_resumed_tokenizer(self) -> None:
        """Refuse, before any step, to resume a checkpoint trained with another tokenizer: its
        embeddings were learned for other token ids."""
        step = self.checkpointer.resume_candidate()
        if step is None:
            return
        try:
            saved = self.checkpointer.train_state(step)
        except Exception:  # a broken checkpoint: resume verifies it and falls back (or says why)
            return
        if saved.get("tokenizer_sha256", self.data["tokenizer_sha256"]) == self.data["tokenizer_sha256"]:
            return
        path = self.checkpointer.folder / f"step-{step}"
        raise DataError(
            f"{path} was trained with tokenizer {saved['tokenizer']}, this job uses {self.data['tokenizer']}: "
            f"resuming would continue on other token ids. Give this job its own --job.dump_folder "
            f"(to start from those weights anyway: --checkpoint.initial_load_path {path})"
        )

    def _lora_base(self) -> str:
        """The frozen weights a LoRA run's adapters were trained on, as its checkpoints record it."""
        checkpoint = self.job.checkpoint
        return checkpoint.initial_load_path or f"seeded initialization (debug.seed {self.job.debug.seed})"

    def _check_resumed_base(self) -> None:
        """Refuse, before any step, to resume LoRA adapters on another base than they were
        trained on: a LoRA checkpoint holds the adapters only."""
        step = self.checkpointer.resume_candidate()
        if step is None or not self.job.lora.enable:
            return
        try:
            saved = self.checkpointer.train_state(step).get("lora_base")
        except Exception:  # a broken checkpoint: resume verifies it and falls back (or says why)
            return
        if saved is None or saved == self._lora_base():
            return
        path = self.checkpointer.folder / f"step-{step}"
        raise TrainingStopped(
            f"{path} holds LoRA adapters trained on {saved}, but this job's base is {self._lora_base()}: "
            f"resume with the base they were trained on (--checkpoint.initial_load_path {saved}), or give "
            "this job its own --job.dump_folder"
        )

    def _announce(self, samples: SampleSource) -> None:
        """The start-up summary: model, plan, data and tokenizer, and what was adjusted."""
        job, dims = self.job, self.dims
        with torch.device("meta"):
            params = sum(p.numel() for p in build_model(self.args).parameters())
        active = f" ({matmul_params(self.args) / 1e6:.3g}M active in matmuls)" if self.args.moe else ""
        if job.lora.enable:
            with torch.device("meta"):
                adapted = build_model(self.args)
                apply_lora(adapted, job.lora, torch.float32)
            trained = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
            active += f" ({trained / 1e6:.3g}M trained: LoRA rank {job.lora.rank})"
        tokenizer = tokenizer_path(job) or "the built-in byte tokenizer (no tokenizer.json given)"
        shape = model_source(job)
        mismatch = flavor_mismatch(job)
        if mismatch:
            logger.warning(mismatch)
        if job.model.overrides:
            shape += f" with {job.model.overrides}"
        logger.info(
            "%s %s: %.3gM parameters%s, %d layers | dp_replicate=%d dp_shard=%d tp=%d cp=%d pp=%d%s on %d %s "
            "rank(s) | data: %s; tokenizer: %s | %d steps of %d x %d tokens",
            job.model.name,
            shape,
            params / 1e6,
            active,
            self.args.num_hidden_layers,
            dims.dp_replicate,
            dims.dp_shard,
            dims.tp,
            dims.cp,
            dims.pp,
            f" ep={dims.ep}" if dims.ep > 1 else "",
            self.world.size,
            self.world.device.type,
            samples.describe(),
            tokenizer,
            job.training.steps,
            self.loader.global_batch,
            job.training.seq_len,
        )
        if job.lr_scheduler.warmup_steps > job.training.steps:
            logger.warning(
                "lr_scheduler.warmup_steps=%d exceeds training.steps=%d: warming up over all %d steps",
                job.lr_scheduler.warmup_steps,
                job.training.steps,
                job.training.steps,
            )

    def _initial_values(self) -> FullValue:
        checkpoint = self.job.checkpoint
        if checkpoint.initial_load_path is not None and checkpoint.initial_load_in_hf:
            logger.info("initial weights from HF folder %s", checkpoint.initial_load_path)
            return tensor_values(HFTensors(checkpoint.initial_load_path, self.args), self.world.device)
        return seeded_values(self.args, self.job.debug.seed, self.world.device)

    def _samples(self, tokenizer: Tokenizer) -> SampleSource:
        training = self.job.training
        return build_samples(
            training.dataset,
            training.dataset_path,
            training.dataset_blend,
            tokenizer,
            training.seq_len,
            self.job.debug.seed,
            chat=chat_format(self.job),
            document_masking=training.document_masking,
            text_field=training.dataset_text_field,
        )

    def _build_loader(self, samples: SampleSource) -> StepLoader:
        training = self.job.training
        dp_mesh = self.meshes.get("dp")
        dp_rank = dp_mesh.get_local_rank() if dp_mesh is not None else 0
        global_batch = (
            training.global_batch_size
            if training.global_batch_size > 0
            else training.local_batch_size * self.dims.dp
        )
        return StepLoader(
            samples, global_batch, training.local_batch_size, dp_rank, self.dims.dp, self.world.device
        )

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
            self._follow_this_job(state)
            self._warn_changed_data_shape(state)
            self.loader.load_state_dict({"consumed_samples": state["consumed_samples"]})
        elif checkpoint.initial_load_path is not None and not checkpoint.initial_load_in_hf:
            logger.info("initial weights from DCP folder %s", checkpoint.initial_load_path)
            self.checkpointer.load_model_only(checkpoint.initial_load_path)
        self._check_loaded_weights(f"checkpoint step-{step}" if step is not None else None)
        self.metrics.forget_after(self.step)  # steps logged after it (by a run that died) run again

    def _follow_this_job(self, saved: dict[str, Any]) -> None:
        """After a resume: AdamW's hyperparameters are this job's (loading the checkpoint put
        back the saved ones), the settings changed since the checkpoint are said in one line,
        and a rewind to an explicit checkpoint.load_step discards the later checkpoints."""
        follow_config(self.optimizers, self.job.optimizer)
        changes = changed_settings(saved, self.job, self.args)
        if changes and self.step < self.job.training.steps:  # else nothing runs with them
            logger.info(
                "resuming step %d with settings changed since its checkpoint, applied from here on: %s",
                self.step,
                listed(changes, most=len(changes)),
            )
        if self.job.checkpoint.load_step >= 0:
            discarded = self.checkpointer.discard_after(self.step)
            if discarded:
                logger.warning(
                    "rewound to step %d (checkpoint.allow_rewind): discarded checkpoints %s and the "
                    "metrics of the steps after it",
                    self.step,
                    ", ".join(f"step-{s}" for s in discarded),
                )

    def _check_loaded_weights(self, resumed: str | None) -> None:
        """Weights read from files are finite: a NaN in a download would otherwise surface
        as a NaN loss at step 1, with advice about the learning rate and the data."""
        source = resumed or self.job.checkpoint.initial_load_path
        if source is not None and not parameters_finite(self.parts):
            raise ConfigError(
                f"the weights loaded from {source} are not finite (NaN or inf); re-download or "
                "re-export them, or start from other weights"
            )

    def _data_shape(self) -> dict[str, int | str]:
        """What a checkpoint records of the data: how samples were cut and batched, and from
        which files and tokenizer."""
        return {
            "seq_len": self.job.training.seq_len,
            "global_batch_size": self.loader.global_batch,
            **self.data,
        }

    def _warn_changed_data_shape(self, saved: dict[str, int | str]) -> None:
        """Resuming with other data, seq_len or batch works, but is not the run that was saved
        (another tokenizer is refused at start)."""
        if saved.get("dataset", self.data["dataset"]) != self.data["dataset"]:
            logger.warning(
                "resuming step %d on other data: the checkpoint was trained on %s, this job reads %s; "
                "the data position (%d samples) is carried over to it. For a new run on this data use "
                "another --job.dump_folder",
                self.step,
                saved["dataset"],
                self.data["dataset"],
                saved["consumed_samples"],
            )
        now = {"seq_len": self.job.training.seq_len, "global_batch_size": self.loader.global_batch}
        changed = [f"{k} {saved[k]} -> {v}" for k, v in now.items() if k in saved and saved[k] != v]
        if not changed:
            return
        logger.warning(
            "resuming step %d with %s since the checkpoint: the data position is kept in samples "
            "(%d so far), so with another seq_len the next text is not where the saved run stopped "
            "(some is skipped or seen twice), and with another batch each later step takes another "
            "number of tokens under the same learning-rate schedule; the losses will not match an "
            "uninterrupted run",
            self.step,
            ", ".join(changed),
            saved["consumed_samples"],
        )

    def run_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next optimizer step on the loader's next batches; (loss, grad norm) as device
        tensors. A step whose loss or gradient norm is not finite makes no update (see
        ``autopar.training.faults``); reading them is this step's one host sync."""
        lr = self.job.optimizer.lr * lr_factor(self.step + 1, self.job.lr_scheduler, self.job.training.steps)
        loss = self.train_step.forward_backward(self.loader.next_step())
        norm = self.train_step.grad_norm()
        self.step += 1
        self.bad = nonfinite(*torch.stack([loss, norm]).tolist())
        if not self.bad:
            self.train_step.apply(lr, norm)
            self.skipped_in_a_row = 0
            return loss, norm
        where = ranks_not_finite(self.train_step.local_loss, self.parts)
        self.train_step.discard()
        self.skipped_in_a_row += 1
        limit = self.job.training.max_skipped_steps
        if self.skipped_in_a_row > limit:
            raise skipped_too_often(self.step, self.bad, where, self.skipped_in_a_row, limit)
        logger.warning(
            "step %d: %s not finite (%s); skipped (no update)", self.step, " and ".join(self.bad), where
        )
        return loss, norm

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
                loss, norm = self.run_step()
                profiler.step(self.step)
                if self.step == first_step:  # compiled and warmed up: from now on steps are quick
                    self.timeout.set(self.job.comm.train_timeout_seconds)
                window_steps += 1
                if self.step % log_freq == 0 or self.step in (1, steps):
                    elapsed = time.perf_counter() - window_start
                    records.append(self._log(loss, norm, window_steps, elapsed))
                    window_start, window_steps = time.perf_counter(), 0
                if self.validator is not None and (
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

    def _log(self, loss: torch.Tensor, norm: torch.Tensor, steps: int, seconds: float) -> StepRecord:
        """Log this step's numbers (``steps`` trained in ``seconds`` since the last log)."""
        aux = self.train_step.aux_loss.item() if self.args.moe else None
        record = StepRecord(self.step, loss.item(), norm.item(), aux)
        lr = self.optimizers[0].param_groups[0]["lr"]
        self.metrics.record(
            self.step, record.loss, record.grad_norm, lr, steps, seconds, skipped=bool(self.bad), aux_loss=aux
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
        """The held-out loss of this step's weights, logged."""
        assert self.validator is not None
        with self.timeout.longer(self.job.comm.init_timeout_seconds):  # the first pass compiles its forward
            result = self.validator.run()
        self.metrics.record_validation(self.step, result.loss, result.tokens)

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
            **({"lora_base": self._lora_base()} if self.job.lora.enable else {}),
            "settings": settings_record(self.job, self.args),
        }
        with self.timeout.longer(self.job.comm.init_timeout_seconds):  # writing may keep some ranks long
            self.weights_from = self.checkpointer.save(train, model_only)
        return self.weights_from

    def _export_hf(self) -> Path:
        """Write ``<dump_folder>/hf/step-N`` of this step: the model, or under LoRA its peft
        adapter folder (and, with lora.merge_on_export, the merged model beside it as
        ``step-N-merged``). Returns the first."""
        checkpoint, lora = self.job.checkpoint, self.job.lora
        ckpt = self.weights_from
        if ckpt is None or ckpt.name != f"step-{self.step}":  # not an earlier run's step-N
            ckpt = self._save()
        out = Path(self.job.job.dump_folder) / "hf" / f"step-{self.step}"
        if not self.world.is_main:
            return out
        dtype = DTYPES[checkpoint.export_dtype]
        source = checkpoint.initial_load_path if checkpoint.initial_load_in_hf else None
        if not lora.enable:
            self._write_export(ckpt, out, lambda folder: export_hf(ckpt, self.args, folder, dtype, source))
            return out
        adapters = saved_adapters(ckpt)
        base_model = self.job.model.hf_assets_path or checkpoint.initial_load_path
        cast = {n: t.to(dtype) for n, t in adapters.items()}
        self._write_export(ckpt, out, lambda folder: save_adapter(cast, lora, folder, self.args, base_model))
        if lora.merge_on_export:
            merged = out.with_name(f"{out.name}-merged")
            base = self._base_tensors()
            self._write_export(
                ckpt,
                merged,
                lambda folder: export_merged(adapters, base, self.args, lora, folder, dtype, source),
            )
        return out

    def _base_tensors(self) -> BaseTensors:
        """The weights this run started from (a LoRA run's frozen base), by name."""
        checkpoint = self.job.checkpoint
        if checkpoint.initial_load_path is not None and not checkpoint.initial_load_in_hf:
            return functools.partial(read_model_tensors, checkpoint.initial_load_path)
        value = self._initial_values()
        return lambda shapes: {n: value(n, shape) for n, shape in shapes.items()}

    def _write_export(self, ckpt: Path, out: Path, write: Callable[[Path], None]) -> None:
        """``write`` into a ``.partial`` folder renamed to ``out`` when complete, so a full disk
        leaves no half export (and says so); the tokenizer files go with a model folder."""
        partial = out.with_name(out.name + ".partial")
        finish_interrupted_swap(out, out.with_name(out.name + ".old"))
        shutil.rmtree(partial, ignore_errors=True)
        try:
            write(partial)
            assets: list[str] = []
            source = self.job.model.hf_assets_path or tokenizer_path(self.job)
            if source is not None and (partial / CONFIG_FILE).is_file():
                assets = copy_assets(source, partial)
            swap_into_place(partial, out, out.with_name(out.name + ".old"))
        except (OSError, SafetensorError) as err:  # safetensors reports a full disk as its own error
            shutil.rmtree(partial, ignore_errors=True)
            raise TrainingStopped(
                f"could not write the HF export {out}: {err}; nothing was left there, and checkpoint "
                f"{ckpt} is kept: free space and run the same command again to export it"
            ) from err
        logger.info("exported HF folder %s (with %s)", out, ", ".join(assets) or "no tokenizer files")
