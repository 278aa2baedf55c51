"""Job config: CLI > TOML > defaults, and one clear error per kind of bad input."""

from __future__ import annotations

import pytest

from autopar.config import ConfigError, JobConfig, to_toml
from autopar.config.checks import inert_float8
from autopar.config.parse import PRESETS, help_text
from autopar.training.preflight import check_job
from autopar.training.resolve import parse_job

from jobs import VALID_FLAGS


@pytest.fixture
def toml_file(tmp_path):
    def write(text: str):
        path = tmp_path / "job.toml"
        path.write_text(text)
        return str(path)

    return write


def test_defaults_apply_without_a_file():
    assert parse_job([]) == JobConfig()


def test_toml_overrides_defaults_and_cli_overrides_toml(toml_file):
    path = toml_file("[training]\nsteps = 7\nseq_len = 64\n[optimizer]\nlr = 0.5\n")
    job = parse_job(["--job.config", path, "--training.steps", "9"])
    assert job.training.steps == 9  # CLI beats TOML
    assert job.training.seq_len == 64  # TOML beats default
    assert job.optimizer.lr == 0.5
    assert job.training.local_batch_size == JobConfig().training.local_batch_size


def test_config_file_alias_and_equals_form(toml_file):
    path = toml_file("[training]\nsteps = 3\n")
    for flag in ("--job.config_file", "--job.config-file", "--job.config"):
        assert parse_job([f"{flag}={path}"]).training.steps == 3


def test_booleans_lists_and_bare_flags_parse():
    job = parse_job(
        [
            "--checkpoint.enable",
            "true",
            "--parallelism.disable_loss_parallel",
            "--training.dataset_blend",
            "0.3:a.bin,0.7:b.bin",
            "--checkpoint.initial_load_path",
            "none",
        ]
    )
    assert job.checkpoint.enable is True
    assert job.parallelism.disable_loss_parallel is True
    assert job.training.dataset_blend == ["0.3:a.bin", "0.7:b.bin"]
    assert job.checkpoint.initial_load_path is None


def test_model_args_under_model_become_overrides(toml_file):
    path = toml_file('[model]\nname = "qwen2.5"\nflavor = "debug"\nnum_hidden_layers = 2\n')
    job = parse_job(["--job.config", path, "--model.hidden_size", "64"])
    assert job.model.overrides == {"num_hidden_layers": 2, "hidden_size": 64}


def test_print_config_round_trips_to_a_job_that_runs(toml_file, tmp_path):
    job = parse_job(["--training.steps", "11", "--model.num_hidden_layers", "3", "--print-config"])
    assert job.job.print_config
    path = toml_file(to_toml(job))
    again = parse_job(["--job.config", path])
    assert not again.job.print_config  # the dump trains when given back
    again.job.config_file = None
    again.job.print_config = True
    assert again == job


def test_a_preset_is_named_without_its_path():
    by_name = parse_job(["--job.config", "qwen3_8b"])
    assert by_name == parse_job(["--job.config", str(PRESETS / "qwen3_8b.toml")])
    assert by_name.model.flavor == "8B"


def test_an_unknown_config_lists_the_presets():
    with pytest.raises(ConfigError, match=r"'qwen9': no such file, nor a preset \(debug_model, .*qwen3_8b"):
        parse_job(["--job.config", "qwen9"])


def test_a_second_job_config_is_refused(toml_file):
    path = toml_file("[training]\nsteps = 3\n")
    with pytest.raises(ConfigError, match=r"--job.config is given 2 times"):
        parse_job(["--job.config", path, "--job.config", path])


def test_torchtitans_float8_section_is_our_float8_section(toml_file):
    path = toml_file(
        "[quantize.linear.float8]\nfilter_fqns = ['output']\nrecipe_name = 'rowwise'\n"
        "enable_fsdp_float8_all_gather = false\nprecompute_float8_dynamic_scale_for_fsdp = false\n"
    )
    float8 = parse_job(["--job.config", path]).float8
    assert (float8.filter_fqns, float8.recipe) == (["output"], "rowwise")
    assert not float8.precompute_float8_dynamic_scale_for_fsdp
    assert parse_job(["--quantize.linear.float8.recipe_name", "tensorwise"]).float8.recipe == "tensorwise"


def test_torchtitans_float8_converter_turns_float8_on():
    assert parse_job(["--model.converters", "float8"]).float8.enable
    assert parse_job(["--model.converters", "quantize.linear.float8"]).float8.enable
    assert not parse_job(["--model.converters", ""]).float8.enable


def test_an_unknown_converter_is_refused_naming_the_known_ones():
    with pytest.raises(ConfigError, match=r"model.converters\[1\]='mx' is not supported; known: \['float8'"):
        parse_job(["--model.converters", "float8,mx"])


def test_explicit_keys_speak_our_names_for_torchtitans(toml_file):
    from autopar.config.parse import explicit_keys

    path = toml_file("[quantize.linear.float8]\nfilter_fqns = ['output']\n[model]\nconverters = ['float8']\n")
    cli, toml = explicit_keys(["--job.config", path, "--quantize.linear.float8.recipe_name", "rowwise"])
    assert cli == {"float8.recipe"} and toml == {"float8.filter_fqns", "float8.enable"}


def test_help_lists_every_field_with_its_doc():
    text = help_text()
    assert "--training.seq_len int (default 2048)" in text
    assert "Tokens per sequence." in text
    assert "--model.<arg>" in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--training.stepz", "3"], "unknown config field 'training.stepz'; did you mean 'training.steps'"),
        (["--trainin.steps", "3"], "unknown config section 'trainin'; did you mean 'training'"),
        (
            ["--model.num_layers", "3"],
            "unknown model field 'model.num_layers'; did you mean 'model.num_hidden_layers'",
        ),
        (["--training.steps", "ten"], "training.steps='ten' is not an int"),
        (["--training.steps"], "--training.steps needs a value"),
        (["--checkpoint.enable", "maybe"], "checkpoint.enable='maybe' is not a bool; use true or false"),
        (
            ["--lr_scheduler.decay_type", "exp"],
            r"lr_scheduler.decay_type='exp' is not one of \['linear', 'sqrt', 'cosine'\]",
        ),
        (["--model.name", "llama3"], r"model.name='llama3' is not one of"),
        (["--job.config", "missing.toml"], "job.config_file='missing.toml': no such file"),
        (["training.steps"], "unexpected argument 'training.steps'"),
    ],
)
def test_bad_flags_are_rejected_with_the_field(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_job(argv)


def test_toml_type_errors_name_the_file(toml_file):
    path = toml_file('[training]\nsteps = "many"\n')
    with pytest.raises(ConfigError, match=r"job.toml: training.steps='many' is not an int"):
        parse_job(["--job.config", path])


def test_toml_float_for_int_field_is_rejected(toml_file):
    path = toml_file("[training]\nsteps = 2.5\n")
    with pytest.raises(ConfigError, match=r"training\.steps=2\.5 is not an int"):
        parse_job(["--job.config", path])


def test_invalid_toml_syntax_is_reported(toml_file):
    path = toml_file("[training\nsteps = 3\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        parse_job(["--job.config", path])


def valid(*argv: str) -> list[str]:
    """A small job that validates, plus the flags under test."""
    return [*VALID_FLAGS, *argv]


@pytest.mark.parametrize(
    "argv, message",
    [
        (valid("--training.steps", "0"), "training.steps=0 must be >= 1"),
        (valid("--training.local_batch_size", "0"), "training.local_batch_size=0 must be >= 1"),
        (valid("--training.seq_len", "1"), "training.seq_len=1 must be >= 2"),
        (valid("--training.max_norm", "-1"), "training.max_norm=-1.0 must be >= 0"),
        (valid("--training.global_batch_size", "0"), "training.global_batch_size=0 must be -1 or >= 1"),
        (
            valid("--training.global_batch_size", "12"),
            "global_batch_size=12 is not a multiple of local_batch_size x data-parallel degree = 8 x 1",
        ),
        (valid("--optimizer.lr", "-0.1"), "optimizer.lr=-0.1 must be a finite number >= 0"),
        (valid("--optimizer.beta2", "1.0"), r"optimizer.beta2=1.0 must be in \[0, 1\)"),
        (valid("--optimizer.eps", "0"), "optimizer.eps=0.0 must be > 0"),
        (valid("--optimizer.weight_decay", "-1"), "optimizer.weight_decay=-1.0 must be >= 0"),
        (valid("--lr_scheduler.warmup_steps", "-1"), "warmup_steps=-1 must be >= 0"),
        (valid("--lr_scheduler.decay_ratio", "1.5"), r"decay_ratio=1.5 must be in \(0, 1\]"),
        (valid("--lr_scheduler.min_lr_factor", "2"), r"min_lr_factor=2.0 must be in \[0, 1\]"),
        (valid("--metrics.log_freq", "0"), "metrics.log_freq=0 must be >= 1"),
        (valid("--checkpoint.interval", "0"), "checkpoint.interval=0 must be >= 1"),
        (valid("--checkpoint.keep_latest_k", "-2"), "keep_latest_k=-2 must be >= 0"),
        (valid("--model.flavor", "9B"), "model.flavor='9B' is unknown for qwen3"),
        (valid("--model.num_key_value_heads", "3"), "num_attention_heads=8 is not a multiple of"),
        (
            valid("--model.vocab_size", "100"),
            r"model.vocab_size=100 is smaller than the tokenizer's vocabulary \(257\)",
        ),
        (
            valid("--training.seq_len", "8192"),
            "training.seq_len=8192 exceeds model.max_position_embeddings=4096",
        ),
        (valid("--training.dataset", "c4"), "training.dataset='c4' is not built in"),
        (
            valid("--training.dataset_path", "/no/such/data"),
            "training.dataset_path='/no/such/data': no such file",
        ),
        (
            valid("--training.dataset_blend", "half:a.bin"),
            "dataset_blend item 'half:a.bin' is not 'weight:path'",
        ),
        (
            valid("--training.dataset_blend", "1:/no/such.bin"),
            "dataset_blend: /no/such.bin is not a prepared dataset",
        ),
        (
            valid("--model.tokenizer_path", "/no/tok"),
            "model.tokenizer_path='/no/tok': no tokenizer.json there",
        ),
        (
            valid("--checkpoint.initial_load_in_hf", "true"),
            "initial_load_in_hf=true needs checkpoint.initial_load_path",
        ),
        (valid("--checkpoint.initial_load_path", "/no/ckpt"), "initial_load_path='/no/ckpt': no such folder"),
        (valid("--model.rope_theta", "-1"), r"model.rope_theta=-1.0 must be a finite number > 0"),
        (valid("--model.rms_norm_eps", "-1"), r"model.rms_norm_eps=-1.0 must be a finite number > 0"),
        (valid("--model.rope_theta", "nan"), r"model.rope_theta=nan must be a finite number"),
        (valid("--model.initializer_range", "-0.02"), "model.initializer_range=-0.02 must be"),
        (valid("--debug.seed", "-1"), "debug.seed=-1 must be >= 0"),
        (
            valid("--training.dataset_blend", "nan:a.bin"),
            "item 'nan:a.bin' is not 'weight:path' with a finite",
        ),
        (
            valid("--training.dataset_blend", "inf:a.bin"),
            "item 'inf:a.bin' is not 'weight:path' with a finite",
        ),
        (
            valid("--compile.enable", "true", "--compile.backend", "inductr"),
            "compile.backend='inductr' is not a torch.compile backend; did you mean 'inductor'",
        ),
        (valid("--training.max_skipped_steps", "-1"), "training.max_skipped_steps=-1 must be >= 0"),
    ],
)
def test_validation_rejects_with_field_value_and_fix(argv, message):
    with pytest.raises(ConfigError, match=message):
        check_job(parse_job(argv), world_size=1)


def test_transformer_engine_fp8_with_compile_is_refused_on_cuda():
    job = parse_job(valid("--float8.enable", "true", "--float8.backend", "te", "--compile.enable", "true"))
    with pytest.raises(ConfigError, match=r"float8.backend='te' does not compose with compile.enable=true"):
        check_job(job, world_size=1, device_type="cuda")


def test_compiled_allgather_context_parallel_with_recompute_is_refused():
    job = parse_job(
        valid(
            "--parallelism.context_parallel_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "1",
            "--compile.enable",
            "true",
            "--activation_checkpoint.mode",
            "full",
        )
    )
    with pytest.raises(ConfigError, match=r"compile.enable=true and activation_checkpoint.mode='full'"):
        check_job(job, world_size=2)


def test_hf_initial_load_must_match_the_flavor(tmp_path):
    from autopar.models import Qwen, get_flavor, to_hf

    model = Qwen(get_flavor("qwen3", "debug", num_hidden_layers=2))
    model.init_weights()
    to_hf(model, tmp_path)
    job = parse_job(
        valid("--checkpoint.initial_load_path", str(tmp_path), "--checkpoint.initial_load_in_hf", "true")
    )
    with pytest.raises(
        ConfigError,
        match=r"has num_hidden_layers=4, but .*config.json has num_hidden_layers=2; .*--model.num_hidden_layers 2",
    ):
        check_job(job, world_size=1)
    job.model.overrides["num_hidden_layers"] = 2
    check_job(job, world_size=1)


def test_dcp_initial_load_needs_dcp_metadata(tmp_path):
    job = parse_job(valid("--checkpoint.initial_load_path", str(tmp_path)))
    with pytest.raises(ConfigError, match="is not a DCP checkpoint"):
        check_job(job, world_size=1)


def test_valid_job_returns_the_model_args():
    args = check_job(parse_job(valid("--model.num_hidden_layers", "2")), world_size=1)
    assert args.num_hidden_layers == 2 and args.qk_norm


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--float8.backend", "torchao"], "float8.backend='torchao'"),
        (["--float8.recipe", "rowwise"], "float8.recipe='rowwise'"),
        (["--float8.backend", "torchao", "--float8.enable", "true"], None),
        ([], None),
    ],
)
def test_fp8_settings_with_fp8_off_are_named_with_the_flag_that_turns_it_on(flags, named):
    note = inert_float8(parse_job([*VALID_FLAGS, *flags]))
    if named is None:
        assert note is None
    else:
        assert note.startswith(named) and "--float8.enable true" in note
