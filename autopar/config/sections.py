"""The job configuration: nested dataclasses, one per TOML section.

Section and field names follow torchtitan v0.2.2 where the concept is the same, so a
torchtitan TOML ports with few edits. The string under each field is its ``--help`` text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass
class Job:
    config_file: str | None = None
    """TOML file with the job; CLI flags override it (also spelled --job.config)."""
    dump_folder: str = "./outputs"
    """Folder for metrics.jsonl, checkpoints and exports."""
    description: str = "default job"
    """Free text, logged at start."""
    print_config: bool = False
    """Print the resolved config and exit (also spelled --print-config)."""
    overwrite_dump_folder: bool = False
    """Start afresh in a dump_folder holding another run's metrics.jsonl and config.toml (a
    run of other settings, with no checkpoint of this job to resume), replacing them and the
    checkpoints and exports of the steps it trains again (HF Trainer's overwrite_output_dir).
    Unset, such a run is refused naming the settings that differ; the same job run again
    (after a crash, say) needs no flag."""


@dataclass
class Model:
    name: Literal["qwen3", "qwen2.5", "qwen3.5"] = "qwen3"
    """Model family (qwen3.5 also trains Qwen3.6 and Qwen3.8-27B: the same architecture)."""
    flavor: str = "debug"
    """Size within the family: qwen3 debug/0.6B/1.7B/4B/8B/14B/32B (MoE: debug-moe/30B-A3B/235B-A22B), qwen2.5 debug/0.5B/1.5B/3B/7B/14B/32B/72B, qwen3.5 debug/0.8B/2B/4B/9B/27B (MoE: debug-moe/35B-A3B/122B-A10B/397B-A17B)."""
    hf_assets_path: str | None = None
    """HF model folder (torchtitan's name): its config.json gives the model's shape instead of
    the flavor (the [model] overrides still win), its tokenizer.json the tokenizer."""
    tokenizer_path: str | None = None
    """HF tokenizer.json (file or folder holding one); unset: hf_assets_path's, else the built-in
    byte tokenizer."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Model args replacing the flavor's (any other key under [model], e.g. --model.num_hidden_layers 6)."""


@dataclass
class Optimizer:
    name: Literal["AdamW"] = "AdamW"
    """Optimizer; AdamW, with no weight decay on norms and biases."""
    lr: float = 8e-4
    """Peak learning rate."""
    beta1: float = 0.9
    """Adam first-moment decay."""
    beta2: float = 0.95
    """Adam second-moment decay."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices."""
    implementation: Literal["auto", "fused", "foreach", "for-loop"] = "auto"
    """Kernel choice; auto is fused (one kernel per step on CUDA and on CPU, where torch 2.13
    runs it 14x faster than foreach: 1.8G vs 0.13G parameters/s on two cores)."""


@dataclass
class LRScheduler:
    warmup_steps: int = 200
    """Linear warmup steps from near zero to optimizer.lr."""
    decay_ratio: float | None = None
    """Fraction of steps spent decaying at the end (WSD schedule); unset decays right after warmup."""
    decay_type: Literal["linear", "sqrt", "cosine"] = "linear"
    """Shape of the decay."""
    min_lr_factor: float = 0.0
    """Final lr as a fraction of optimizer.lr."""


@dataclass
class Training:
    dataset: str = "autopar_corpus"
    """Built-in dataset name (autopar_corpus: the text shipped with autopar)."""
    dataset_path: str | None = None
    """Text file, .jsonl file, Parquet file, folder of them, a datasets.save_to_disk folder
    (Arrow), or a prepared .bin; overrides training.dataset."""
    dataset_blend: list[str] = field(default_factory=list)
    """Weighted blend of prepared datasets as 'weight:path' items; overrides the two above."""
    dataset_format: Literal["text", "chat", "preference", "prompts"] = "text"
    """text: documents (.txt, .jsonl "text", a table's text column, prepared tokens); chat:
    conversations in .jsonl lines or table rows ({"messages": [...], "tools": [...]} or
    ShareGPT's "conversations") rendered with the chat template; preference: TRL's
    prompt / chosen / rejected records (plain text or conversational) trained by [dpo], the
    batch sizes then counting pairs; prompts: TRL's prompt-only records (text or messages,
    other columns passed to the reward functions) trained on-policy by [rl], the batch sizes
    then counting completions."""
    dataset_text_field: str = "text"
    """With text data: the .jsonl key or the Parquet / Arrow column that holds each document."""
    chat_template: str | None = None
    """A chat template file (or shipped name: qwen2.5, qwen3); default: the chat_template beside
    the tokenizer, else Qwen2.5's."""
    loss_on: Literal["assistant", "all", "last_assistant"] = "assistant"
    """With chat data: which tokens are targets (every assistant turn, the last one, or all)."""
    expert_kernel: Literal["auto", "grouped", "loop"] = "auto"
    """How a mixture of experts runs its experts: one grouped GEMM per projection
    (torch._grouped_mm), a matmul per expert (any device), or auto: grouped where the device
    and shapes allow it (bf16 on Hopper or newer; on CPU, rows of whole 16-byte multiples)."""
    delta_rule_kernel: Literal["auto", "autopar", "triton", "fla"] = "auto"
    """Qwen3.5's Gated DeltaNet kernel: autopar's chunked delta rule (plain torch, any device),
    triton: the same with its two state passes as Triton programs of ours (CUDA; on a CPU
    they run in Triton's interpreter, slowly), fla: flash-linear-attention's Triton kernels
    (CUDA; pip install 'autopar[fla]'), or auto: triton on CUDA where Triton imports, else
    autopar. All compute the same rule, compile whole and pass states under context
    parallelism; compare them with python -m autopar.bench --variants compiled fla triton."""
    document_masking: bool = False
    """Packed documents (conversations, or text up to each end-of-text) do not see each other:
    attention stays within a document, RoPE positions restart at each, and no target is
    predicted across a boundary (Megatron's reset_attention_mask and reset_position_ids)."""
    local_batch_size: int = 8
    """Sequences per data-parallel rank per micro-step."""
    global_batch_size: int = -1
    """Sequences per optimizer step over all ranks; -1 is local_batch_size x data-parallel degree."""
    seq_len: int = 2048
    """Tokens per sequence."""
    loss_chunk_tokens: int = 0
    """Compute the cross-entropy (DPO's and RL's token log-probabilities too) this many tokens
    at a time, its gradient in the same pass: fp32 logits and log-probabilities then exist for
    one chunk, not the whole micro-batch (0: the whole micro-batch at once). Under loss parallel
    each TP rank's chunks hold its columns of the vocabulary; with 'loss' in
    compile.components each chunk of the language-model loss is compiled."""
    max_norm: float = 1.0
    """Gradient clipping norm; 0 disables clipping (the norm is still logged)."""
    max_skipped_steps: int = 0
    """Steps in a row whose loss or gradient norm is not finite that are skipped (no update)
    before the job stops with an error; 0 stops at the first."""
    steps: int = 10000
    """Optimizer steps to train."""
    mixed_precision_param: Literal["auto", "bfloat16", "float32"] = "auto"
    """Compute dtype; auto is bfloat16 on CUDA and float32 on CPU. Master weights stay fp32."""
    mixed_precision_reduce: Literal["float32"] = "float32"
    """Gradient reduction dtype."""
    sdpa_backend: Literal["auto", "flash", "efficient", "cudnn", "math"] = "auto"
    """Attention kernel: auto lets torch choose; the others pin one SDPA backend (flash,
    efficient and cudnn are CUDA kernels; CPU has flash and math). Compare them on one job
    with python -m autopar.bench --variants attn_flash attn_cudnn."""
    enable_cpu_offload: bool = False
    """Keep fp32 master weights, gradients and AdamW state in host memory (FSDP2's CPU offload
    policy; AdamW steps on the CPU): the device holds only the gathered compute-dtype weights
    and activations. FSDP then runs even on one rank, so one GPU trains a model whose
    weights and optimizer state do not fit on it."""

    def global_batch(self, dp: int) -> int:
        """Sequences (completions, pairs) per optimizer step over ``dp`` data-parallel ranks."""
        return self.global_batch_size if self.global_batch_size > 0 else self.local_batch_size * dp


@dataclass
class Parallelism:
    auto: bool = False
    """Let the planner choose every plan setting the job does not pin (python -m autopar.plan explains)."""
    auto_verify: bool = True
    """With auto: build the chosen plan by its dry run before training (one step under fake
    tensors: seconds for small models, minutes at 32B) and take the next best if it fails or
    does not fit as measured."""
    data_parallel_replicate_degree: int = 1
    """Replicas of the weights (DDP-like; with shard degree > 1 this is HSDP)."""
    data_parallel_shard_degree: int = -1
    """Ranks sharing one copy of the weights (FSDP2); -1 takes the ranks left over."""
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """Free gathered block weights after forward (re-gather in backward); default: yes, except under pipelining."""
    tensor_parallel_degree: int = 1
    """Tensor-parallel ranks (DTensor column/row sharding of every block)."""
    context_parallel_degree: int = 1
    """Context-parallel ranks (the sequence split across ranks)."""
    pipeline_parallel_degree: int = 1
    """Pipeline-parallel ranks."""
    expert_parallel_degree: int = 1
    """Ranks the experts of a mixture-of-experts model are split over (tokens reach their
    experts by all-to-all); borrowed from data_parallel_shard_degree x context_parallel_degree,
    so it does not add to the world size. In autopar.generate: every process, or 1."""
    pipeline_parallel_schedule: str = "1F1B"
    """torch schedule: GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV."""
    pipeline_parallel_microbatch_size: int = 1
    """Sequences per pipeline micro-batch; local_batch_size / this = micro-batches per step."""
    pipeline_parallel_layers_per_stage: int | None = None
    """Layers per (virtual) stage; unset: one stage per rank, two for interleaved and V schedules."""
    pipeline_parallel_first_stage_less_layers: int = 1
    """The embedding counts as this many layers when balancing stages."""
    pipeline_parallel_last_stage_less_layers: int = 1
    """The final norm and head count as this many layers when balancing stages."""
    module_fqns_per_model_part: list[list[str]] | None = None
    """Explicit modules per stage, e.g. [["embed_tokens", "layers.0"], ["layers.1", "norm", "lm_head"]]."""
    context_parallel_impl: Literal["auto", "ring", "allgather"] = "auto"
    """auto: torch ring attention on CUDA, all-gathered k/v elsewhere (same results)."""
    context_parallel_load_balancer: Literal["headtail", "none"] = "headtail"
    """headtail: rank r holds chunks r and 2*cp-1-r so causal work is balanced; none: contiguous chunks."""
    context_parallel_rotate_method: Literal["allgather", "alltoall"] = "allgather"
    """How ring attention exchanges k/v shards."""
    gpus_per_node: int = -1
    """The GPUs per node the plan was made for (python -m autopar.plan --gpus-per-node); a
    launch with another number of ranks per node (torchrun --nproc_per_node, LOCAL_WORLD_SIZE)
    is refused in one line. -1: not stated, not checked."""
    enable_sequence_parallel: bool = True
    """With TP, shard norms and residuals along the sequence too (less activation memory)."""
    disable_loss_parallel: bool = False
    """With TP, gather the logits instead of computing cross-entropy on vocab shards."""


@dataclass
class Checkpoint:
    enable: bool = False
    """Save checkpoints and resume from the latest one."""
    folder: str = "checkpoint"
    """Checkpoint folder, under job.dump_folder."""
    interval: int = 500
    """Save every this many steps (and at the last step)."""
    keep_latest_k: int = 10
    """Complete checkpoints to keep; 0 keeps all."""
    load_step: int = -1
    """Resume from this step instead of the latest."""
    allow_rewind: bool = False
    """Let load_step go back past later checkpoints: they and the metrics.jsonl rows after
    load_step are discarded and those steps train again. Unset, such a rewind is refused
    naming what it would discard."""
    initial_load_path: str | None = None
    """Start from these weights when no checkpoint exists yet (DCP folder, or HF with initial_load_in_hf)."""
    initial_load_in_hf: bool = False
    """initial_load_path is an HF folder (config.json + safetensors)."""
    last_save_in_hf: bool = False
    """Also export the final model as an HF folder (job.dump_folder/hf)."""
    export_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the HF export."""
    last_save_model_only: bool = False
    """The save at training.steps holds the model only (no optimizer): for export or
    checkpoint.initial_load_path, not for resuming. torchtitan's default is true."""
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
    """async: training goes on while a save is written (DCP async_save on its own gloo group;
    the save becomes step-N when written). async_with_pinned_mem also stages through pinned
    host memory on CUDA (on CPU it is the same as async)."""


@dataclass
class Metrics:
    log_freq: int = 10
    """Log every this many steps (and the first and last)."""
    enable_tensorboard: bool = False
    """Also write TensorBoard scalars under job.dump_folder/save_tb_folder."""
    save_tb_folder: str = "tb"
    """TensorBoard's folder, under job.dump_folder."""
    enable_wandb: bool = False
    """Also log to Weights & Biases (pip install 'autopar[wandb]'): the metrics.jsonl records
    from rank 0, the resolved job as the run's config; WANDB_MODE=offline needs no account
    and writes the run under job.dump_folder/wandb (under $WANDB_DIR/wandb when set)."""
    wandb_project: str = "autopar"
    """W&B project of the run."""
    wandb_run_name: str | None = None
    """W&B run name; unset: W&B makes one up."""
    wandb_entity: str | None = None
    """W&B team or user the run belongs to; unset: the logged-in user's default."""


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective"] = "none"
    """Recompute block activations in backward: none, every block (full), or selective."""
    selective_ac_option: str = "op"
    """With selective: 'op' saves matmul/attention outputs and recomputes the rest; 'op_regather'
    does so, and under sequence parallelism gathers the projections' inputs again in backward
    instead of keeping them; an integer k checkpoints every k-th block."""


@dataclass
class Compile:
    enable: bool = False
    """torch.compile each transformer block (fullgraph) and, with 'loss' in components, the loss."""
    components: list[Literal["model", "loss"]] = field(default_factory=lambda: ["model", "loss"])
    """What to compile when enabled."""
    backend: str = "inductor"
    """torch.compile backend."""


@dataclass
class Float8:
    enable: bool = False
    """Run eligible nn.Linear layers in FP8."""
    backend: Literal["auto", "te", "torchao"] = "auto"
    """auto: Transformer Engine on CUDA, torchao elsewhere."""
    recipe: Literal["default", "tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed", "current"] = (
        "default"
    )
    """Scaling recipe: torchao tensorwise/rowwise/rowwise_with_gw_hp (default tensorwise); TE
    delayed/current (default delayed). torchtitan's name: recipe_name."""
    filter_fqns: list[str] = field(default_factory=lambda: ["lm_head"])
    """Modules kept in high precision (name substrings); dims not divisible by 16 always are."""
    enable_fsdp_float8_all_gather: bool = False
    """torchao tensorwise: all-gather FSDP weights in FP8 (half the all-gather bytes)."""
    precompute_float8_dynamic_scale_for_fsdp: bool = True
    """With FP8 all-gather: compute every weight's scale in one pass after the optimizer step
    (false: each layer computes its own at its all-gather)."""


@dataclass
class LoRA:
    enable: bool = False
    """Fine-tune low-rank adapters on frozen base weights instead of every weight."""
    rank: int = 8
    """Rank r of each adapter (A: r x in, B: out x r)."""
    alpha: float = 16.0
    """The update is scaled by alpha / rank (peft's lora_alpha)."""
    dropout: float = 0.0
    """Dropout on the adapter's input (peft's lora_dropout)."""
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Linears that get adapters: an entry matches module names ending with it (peft's rule);
    ``experts`` adapts a mixture's experts too (peft's target_parameters on the fused experts)."""
    base_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """Storage dtype of the frozen weights; auto: the compute dtype (bf16 on CUDA: no fp32 copy)."""
    merge_on_export: bool = False
    """With checkpoint.last_save_in_hf, also write the merged full model beside the adapter folder."""


@dataclass
class DPO:
    beta: float = 0.1
    """Strength of the pull towards the reference (TRL's beta; IPO's tau)."""
    loss_type: list[str] = field(default_factory=lambda: ["sigmoid"])
    """TRL's loss types, summed with loss_weights: sigmoid, hinge, ipo (length-normalised),
    robust, sft (the chosen tokens' cross-entropy), nca_pair, bco_pair, sigmoid_norm, exo_pair."""
    loss_weights: list[float] | None = None
    """One weight per loss_type; unset: 1 each."""
    label_smoothing: float = 0.0
    """The assumed share of flipped labels, in [0, 0.5): robust and exo_pair read it."""
    reference: Literal["copy", "adapters_off", "precomputed"] = "copy"
    """copy: a frozen copy of the weights (reference_path's, else the initial ones), sharded
    under the same plan; adapters_off: with LoRA, the same model with its adapters bypassed;
    precomputed: one pass over the data first writes the reference log-probs beside the job,
    then no reference is held."""
    reference_path: str | None = None
    """The reference's weights (an HF folder, or a DCP checkpoint); unset: the policy's initial
    weights."""
    max_length: int = -1
    """Tokens of one prompt + completion sequence (TRL's max_length); longer ones are cut as
    truncation says; -1: half of training.seq_len, so a pair always fits one row."""
    truncation: Literal["keep_start", "refuse"] = "keep_start"
    """keep_start: keep a too-long sequence's first max_length tokens (TRL's), counted and said
    once; refuse: stop with one line naming the record."""
    packing: bool = True
    """Pack several pairs into each row as documents (each pair whole, in one row); false: one
    sequence per row, as TRL batches them (the same losses, more padding)."""


@dataclass
class RL:
    """On-policy RL with verifiable rewards (GRPO and its variants), TRL's GRPOConfig names:
    each step samples num_generations completions per prompt on the job's own weights under
    its plan, scores them, and trains num_iterations steps on them (docs/rl.md)."""

    reward_funcs: list[str] = field(default_factory=list)
    """Reward functions as "package.module:function" or "path/to/file.py:function", each
    f(prompts, completions, completion_ids, **columns) -> list[float | None] (TRL's); the
    shipped ones are in autopar.rewards."""
    reward_weights: list[float] | None = None
    """One weight per reward function; unset: 1 each."""
    num_generations: int = 8
    """Completions sampled per prompt (a group); divides training.global_batch_size."""
    max_completion_length: int = 512
    """Most new tokens per completion (it ends earlier at end of text or the end of the turn)."""
    temperature: float = 1.0
    """Sampling temperature; the log-probabilities the loss reads are at it too (TRL's)."""
    top_p: float = 1.0
    """Sample among the likeliest tokens whose probabilities reach top_p together; 1: all."""
    top_k: int = 0
    """Sample among the top_k likeliest tokens; 0: all."""
    num_iterations: int = 1
    """Optimizer steps on each batch of completions (GRPO's mu) before sampling the next."""
    loss_type: Literal["dapo", "grpo", "dr_grpo", "bnpo", "cispo"] = "dapo"
    """TRL's loss types: dapo (tokens of the whole batch), grpo (per-sequence means), dr_grpo
    (over max_completion_length), bnpo (tokens per micro-batch), cispo (clipped IS weights)."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """token: a ratio per token (GRPO); sequence: one per completion, its tokens' mean log
    ratio (GSPO)."""
    epsilon: float = 0.2
    """Lower clipping bound of the ratio (1 - epsilon)."""
    epsilon_high: float | None = None
    """Upper clipping bound (1 + epsilon_high; cispo: the ratio's cap); unset: epsilon."""
    delta: float | None = None
    """Upper clamp of the unclipped ratio (two-sided clipping); unset: none."""
    beta: float = 0.0
    """Weight of the k3 KL to a reference (needs reference); 0: no reference is held."""
    use_bias_correction_kl: bool = True
    """With beta > 0: the KL term times the importance ratio (TRL's default, DeepSeek-V3.2's
    unbiased reverse-KL gradient)."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Advantages divided by the group's reward std (group), the batch's (batch), or not at all."""
    mask_truncated_completions: bool = False
    """Completions cut at max_completion_length take no part in the loss."""
    old_logps: Literal["sampler", "trainer"] = "sampler"
    """pi_old: the sampler's log-probabilities (equal to the trainer's in fp32: no second
    pass), or recomputed by a forward of the trainer before the step's passes (TRL's)."""
    importance_correction: Literal[
        "none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"
    ] = "none"
    """TRL's correction for a sampler whose log-probabilities differ from the trainer's
    (vllm_importance_sampling_mode; it recomputes pi_old as old_logps = "trainer" does): each
    token's loss times exp(trainer - sampler log-probability), per token or summed per
    completion, truncated to [importance_cap_min, importance_cap_max] or zero outside it."""
    importance_cap_max: float | None = 3.0
    """The correction's upper bound (TRL's vllm_importance_sampling_clip_max); unset: none."""
    importance_cap_min: float | None = None
    """The correction's lower bound (vllm_importance_sampling_clip_min); unset: none."""
    reference: Literal["copy", "adapters_off"] = "copy"
    """With beta > 0: a frozen copy of the weights (reference_path's, else the initial ones), or
    with LoRA the policy with its adapters bypassed."""
    reference_path: str | None = None
    """The reference's weights (an HF folder or a DCP checkpoint); unset: the initial weights."""
    replay: str | None = None
    """A rollouts file (<dump_folder>/rollouts/step-N.jsonl) or a folder of them: sample
    nothing, train step N on the records of step N (training.dataset may be unset)."""


@dataclass
class MTP:
    """Qwen3.5's multi-token-prediction head trained with the model (docs/qwen3_5.md)."""

    enable: bool = False
    """Train the head (``mtp.*``, loaded from the HF folder that carries it) beside the model:
    the loss is the main one plus loss_scale times the head's, logged as mtp_loss and
    mtp_acceptance (how often its argmax is the token two ahead)."""
    loss_scale: float = 0.1
    """Weight of the head's loss in the trained loss (Megatron's mtp_loss_scaling_factor);
    0: the head is frozen, its loss and acceptance logged without training it."""
    detach: bool = False
    """The head's loss trains only the head: no gradient into the trunk, the shared embedding
    or the output head through it (Megatron's mtp_detach_heads)."""
    only: bool = False
    """Freeze every weight outside mtp.* and train just the head (re-align the head of a model
    fine-tuned elsewhere)."""


@dataclass
class Validation:
    enable: bool = False
    """Compute a held-out loss (val_loss) under the training plan every freq steps and at the end."""
    dataset: str | None = None
    """A built-in dataset to validate on (as training.dataset); or give dataset_path."""
    dataset_path: str | None = None
    """Held-out text, tables or prepared tokens, read as training.dataset_path is (its
    dataset_format and dataset_text_field too); an RL job's held-out prompts, sampled and
    scored every pass (docs/rl.md)."""
    local_batch_size: int = 8
    """Sequences (RL: completions) per data-parallel rank per validation step (under PP:
    training.local_batch_size)."""
    seq_len: int = -1
    """Tokens per sequence; -1: training.seq_len (under PP it must be training.seq_len)."""
    freq: int = 10
    """Validate every this many steps (and after the last)."""
    steps: int = -1
    """Batches per validation; -1: every whole batch the held-out data holds."""
    sample_prompts: str | None = None
    """A JSONL file of prompts (as generate.prompts) answered greedily every freq steps, with
    up to generate.max_new_tokens tokens each: logged and appended to
    <job.dump_folder>/samples.jsonl with the step (validation.enable not needed)."""


@dataclass
class Profiling:
    enable_profiling: bool = False
    """Record torch.profiler traces (CPU and CUDA activity), one step in every profile_freq."""
    save_traces_folder: str = "profile_traces"
    """Trace folder under job.dump_folder: iteration_N/rankR_trace.json (open in Perfetto)."""
    profile_freq: int = 10
    """Trace one step in this many (the steps before it warm the profiler up)."""
    enable_memory_snapshot: bool = False
    """CUDA only: record allocator history and dump a snapshot every profile_freq steps and on
    out-of-memory (view at pytorch.org/memory_viz)."""
    save_memory_snapshot_folder: str = "memory_snapshot"
    """Snapshot folder under job.dump_folder: iteration_N/rankR_memory_snapshot.pickle."""


@dataclass
class Comm:
    init_timeout_seconds: int = 300
    """Seconds for every rank to join and finish the first step (compilation included), and for
    each checkpoint save or load; a rank missing that long ends the job with an error."""
    train_timeout_seconds: int = 100
    """Seconds any collective waits after the first step; a rank that died or hangs ends the job
    with an error in this time instead of stalling it."""


@dataclass
class Debug:
    seed: int = 0
    """Seed for weights and data order."""
    deterministic: bool = False
    """Use deterministic kernels (torch.use_deterministic_algorithms)."""


@dataclass
class Generate:
    """``python -m autopar.generate``: sampling from the job's model (docs/generate.md)."""

    prompts: str | None = None
    """A JSONL file: one {"prompt": text} or {"messages": [...]} per line (chat ones rendered
    with the model's chat template and its generation prompt)."""
    max_new_tokens: int = 128
    """New tokens per prompt at most; generation also stops at the tokenizer's end of turn."""
    temperature: float = 0.0
    """0: greedy; above 0 tokens are sampled from the logits divided by it."""
    top_p: float = 1.0
    """Sample among the likeliest tokens whose probabilities reach top_p; 1: all."""
    top_k: int = 0
    """Sample among the top_k likeliest tokens; 0: all."""
    seed: int = 0
    """Seeds the sampling: the same seed, prompts and weights give the same tokens."""
    output: str | None = None
    """A JSONL file written with one record per prompt: prompt_ids, new_ids, text; unset:
    <job.dump_folder>/generations.jsonl. A file already there is never replaced (refused
    before any work) unless overwrite says so."""
    overwrite: bool = False
    """Replace an existing output when it holds an earlier generation's records (any other
    file, a training run's metrics.jsonl say, is never replaced)."""
    compile: bool = False
    """Run the decode step through torch.compile: about 2-3x faster a token on CPU's debug
    models, after a compilation of 10-30 s; worth it for long generations."""
    speculative: Literal["off", "mtp"] = "off"
    """mtp: draft tokens with Qwen3.5's multi-token-prediction head and verify them in one
    forward (the same greedy tokens; sampled ones by the standard acceptance rule); the output
    records each prompt's acceptance. Needs a model with the head (an HF folder with mtp.*)."""
    draft_tokens: int = 2
    """With speculative=mtp: tokens the head drafts per verification forward (at least 1)."""
    adapters: str | None = None
    """A LoRA run's adapters, merged into the base the checkpoint settings load (the run's
    [lora] job: its HF or DCP base, else the flavor's initial weights): its checkpoint step
    folder (rank and alpha from the job's [lora] section) or its exported peft adapter folder."""
    chat: bool = False
    """An interactive conversation in the terminal instead of a prompts file: each line you
    type is a user turn, rendered with the chat template and the turns before it, and the
    reply streams as it is decoded (/reset starts over, /exit or end of input ends)."""


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
    lora: LoRA = field(default_factory=LoRA)
    dpo: DPO = field(default_factory=DPO)
    rl: RL = field(default_factory=RL)
    mtp: MTP = field(default_factory=MTP)
    validation: Validation = field(default_factory=Validation)
    profiling: Profiling = field(default_factory=Profiling)
    comm: Comm = field(default_factory=Comm)
    debug: Debug = field(default_factory=Debug)
    generate: Generate = field(default_factory=Generate)
