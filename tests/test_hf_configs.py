"""Released config.json files, as users download them, load: each fixture under
``tests/fixtures/hf_configs`` keeps every key and null of a released file (sizes shrunk, see the
README there). Each reads into our args, and a folder of it with random weights written by
transformers 5.x gives transformers' logits; so does the folder transformers writes itself."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from autopar.models import HFCheckpointError, from_hf, read_hf_config, to_hf

transformers = pytest.importorskip("transformers")

FIXTURES = Path(__file__).parent / "fixtures" / "hf_configs"
RELEASED = sorted(p.stem for p in FIXTURES.glob("*.json"))


def released(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def config_folder(tmp_path: Path, config: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def hf_model(config: dict, text_only: bool = False):
    """The transformers model of a config.json dict (its text model's causal LM when
    ``text_only``), every weight randomized: HF starts norms, biases and routers at constants."""
    hf_config = transformers.AutoConfig.for_model(**copy.deepcopy(config))  # it fills nested dicts in
    if text_only:
        hf_config = hf_config.get_text_config()
        hf_config.architectures = None
    vision = hasattr(hf_config, "vision_config")
    factory = transformers.AutoModelForImageTextToText if vision else transformers.AutoModelForCausalLM
    torch.manual_seed(0)
    model = factory.from_config(hf_config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" not in name and "A_log" not in name:
                p.copy_(torch.randn_like(p) * 0.2)
    return model.eval()


def assert_same_logits(ours: torch.nn.Module, hf, seqlen: int) -> None:
    x = torch.randint(0, 128, (2, seqlen), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = hf(input_ids=x).logits
        mine = ours(x)
    mine = mine[0] if isinstance(mine, tuple) else mine
    # fp32, the same math in another summation order: the logits reach about 10, and differ by
    # at most ~1e-5 of that (the Qwen3.5 cases the most); a wrong rotary, norm or split is O(1).
    assert (mine - theirs).abs().max().item() <= 2e-4 * theirs.abs().max().item()


@pytest.mark.parametrize("name", RELEASED)
def test_a_released_config_reads_as_transformers_reads_it(tmp_path, name):
    config = released(name)
    args = read_hf_config(config_folder(tmp_path, config))
    theirs = transformers.AutoConfig.for_model(**copy.deepcopy(config)).get_text_config()
    heads = theirs.num_attention_heads
    assert args.head_dim == getattr(theirs, "head_dim", None) or theirs.hidden_size // heads
    assert args.num_key_value_heads == theirs.num_key_value_heads
    assert args.rope_theta == theirs.rope_parameters["rope_theta"]
    assert args.rope_type == theirs.rope_parameters["rope_type"]
    assert args.num_experts == (getattr(theirs, "num_experts", None) or 0)
    assert args.rotary_dim == int(args.head_dim * theirs.rope_parameters.get("partial_rotary_factor", 1.0))


def test_a_partial_rotary_factor_beside_the_rope_parameters_is_read(tmp_path):
    """transformers moves a text config's own ``partial_rotary_factor`` into its RoPE parameters."""
    config = released("qwen3_5_27b")
    del config["text_config"]["rope_parameters"]["partial_rotary_factor"]
    config["text_config"]["partial_rotary_factor"] = 0.5
    assert read_hf_config(config_folder(tmp_path, config)).partial_rotary_factor == 0.5


@pytest.mark.parametrize("written_by", ["released", "transformers"])
@pytest.mark.parametrize("name", RELEASED)
def test_a_released_folder_gives_transformers_logits(tmp_path, name, written_by):
    """Weights as transformers writes them under the released config.json, and under the
    config.json transformers writes itself for the same model (its own class's keys)."""
    config = released(name)
    hf = hf_model(config)
    hf.save_pretrained(tmp_path)
    if written_by == "released":
        config_folder(tmp_path, config)
    ours = from_hf(tmp_path, dtype=torch.float32)
    # longer than a YaRN fixture's original context (16 positions), so both YaRN ranges run
    assert_same_logits(ours, hf, seqlen=40)


@pytest.mark.parametrize("name", [n for n in RELEASED if "vision_config" in released(n)])
def test_the_text_model_class_transformers_writes_loads(tmp_path, name):
    """Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM: the text model of a VL release, saved alone."""
    hf = hf_model(released(name), text_only=True)
    hf.save_pretrained(tmp_path)
    assert_same_logits(from_hf(tmp_path, dtype=torch.float32), hf, seqlen=40)


@pytest.mark.parametrize("name", ["qwen3_8b_yarn", "qwen3_6_35b_a3b_yarn"])
def test_a_yarn_export_round_trips_and_loads_in_transformers(tmp_path, name):
    """Qwen3.6's as its text model (the vision-language export is tests/test_qwen3_5.py's)."""
    config = released(name)
    hf = hf_model(config, text_only="vision_config" in config)
    hf.save_pretrained(tmp_path / "source")
    ours = from_hf(tmp_path / "source", dtype=torch.float32)
    to_hf(ours, tmp_path / "export")
    assert read_hf_config(tmp_path / "export") == ours.args
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32)
    assert_same_logits(ours, exported.eval(), seqlen=40)


YARN_SETTINGS = {
    "qwen-docs": {"factor": 4.0, "original_max_position_embeddings": 16},
    "no-truncate-betas": {
        "factor": 8.0,
        "original_max_position_embeddings": 2048,
        "truncate": False,
        "beta_fast": 16,
        "beta_slow": 2,
    },
    "mscale-pair": {
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
    },
    "attention-factor": {"factor": 2.0, "original_max_position_embeddings": 16, "attention_factor": 0.9},
    "factor-null": {"factor": None, "original_max_position_embeddings": 16},
}


@pytest.mark.parametrize("settings", list(YARN_SETTINGS), ids=list(YARN_SETTINGS))
def test_yarn_tables_are_transformers(tmp_path, settings):
    """Our cos / sin tables beside transformers' rotary embedding for each YaRN parameter."""
    from autopar.models.qwen import rotary_cos_sin

    config = {**released("qwen3_8b"), "max_position_embeddings": 64}
    config["rope_scaling"] = {"rope_type": "yarn", **YARN_SETTINGS[settings]}
    args = read_hf_config(config_folder(tmp_path, config))
    rotary = transformers.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding(transformers.Qwen3Config(**config))
    positions = torch.arange(100)
    theirs = rotary(torch.zeros(1, dtype=torch.float32), positions[None])
    ours = rotary_cos_sin(positions, args.head_dim, args.rope_theta, args)
    for mine, hf in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine, hf[0], rtol=0, atol=1e-6)  # fp32: the same formula


@pytest.mark.parametrize("rope_type", ["linear", "dynamic", "llama3", "longrope"])
def test_a_rope_type_autopar_does_not_compute_is_one_line(tmp_path, rope_type):
    config = {**released("qwen2_5_7b_instruct"), "rope_scaling": {"type": rope_type, "factor": 2.0}}
    with pytest.raises(HFCheckpointError) as err:
        read_hf_config(config_folder(tmp_path, config))
    message = str(err.value)
    assert "\n" not in message
    assert f"rope_scaling rope type {rope_type!r} is not supported" in message
    assert "'yarn'" in message


OPTIONAL = (
    "head_dim",
    "rope_theta",
    "hidden_act",
    "rms_norm_eps",
    "tie_word_embeddings",
    "max_position_embeddings",
)


@pytest.mark.parametrize("absent", [False, True], ids=["null", "absent"])
@pytest.mark.parametrize("name", ["qwen2_5_7b_instruct", "qwen3_8b", "qwen3_30b_a3b"])
def test_optional_fields_null_or_absent_take_transformers_defaults(tmp_path, name, absent):
    config = {**released(name), **dict.fromkeys(OPTIONAL), "rope_scaling": None}
    if absent:
        config = {k: v for k, v in config.items() if k not in OPTIONAL}
    args = read_hf_config(config_folder(tmp_path, config))
    # transformers 5 refuses some nulls (hidden_act, head_dim): compare with its defaults for absent keys
    theirs = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if v is not None})
    assert args.head_dim == getattr(theirs, "head_dim", theirs.hidden_size // theirs.num_attention_heads)
    assert (args.rope_theta, args.rms_norm_eps) == (theirs.rope_parameters["rope_theta"], theirs.rms_norm_eps)
    assert args.max_position_embeddings == theirs.max_position_embeddings
    assert args.tie_word_embeddings == theirs.tie_word_embeddings


def test_null_key_value_heads_are_the_attention_heads(tmp_path):
    config = {**released("qwen2_5_7b_instruct"), "num_key_value_heads": None}
    theirs = transformers.AutoConfig.for_model(**config)
    assert (
        read_hf_config(config_folder(tmp_path, config)).num_key_value_heads == theirs.num_key_value_heads == 4
    )


@pytest.mark.parametrize(
    "field,value",
    [
        ("intermediate_size", 2**40),
        ("num_hidden_layers", 1_000_000),
        ("vocab_size", 10**9),
        ("hidden_size", 2**20),
    ],
)
def test_an_absurd_size_is_refused_before_anything_is_built(tmp_path, field, value):
    """A 256 TB allocation or a million-layer loop used to start; now one line names the field."""
    config = {**released("qwen3_30b_a3b"), field: value}
    with pytest.raises(HFCheckpointError, match=rf"config.json: model.{field}={value} is beyond any Qwen"):
        from_hf(config_folder(tmp_path, config))


def test_every_real_size_is_under_the_bounds():
    """The bounds sit far above every released Qwen (Qwen2.5-72B, Qwen3-235B-A22B, Qwen3.5-397B)."""
    from autopar.models import FLAVORS

    for flavors in FLAVORS.values():
        for args in flavors.values():
            args.check()


def test_a_vision_language_config_without_text_config_names_it(tmp_path):
    config = {k: v for k, v in released("qwen3_5_27b").items() if k != "text_config"}
    with pytest.raises(HFCheckpointError, match="'text_config', which is missing"):
        read_hf_config(config_folder(tmp_path, config))


def test_plan_names_a_config_json_model_by_the_size_that_config_gives(tmp_path, capsys):
    """Not the flavor's ("qwen2.5 8B" for any config.json): Qwen2.5-7B-Instruct's real sizes."""
    from autopar.cli.plan import main as plan_main

    sizes = {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28}
    heads = {"num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064}
    folder = config_folder(tmp_path, {**released("qwen2_5_7b_instruct"), **sizes, **heads})
    flags = [
        "--model.name",
        "qwen2.5",
        "--model.hf_assets_path",
        str(folder),
        "--world-size",
        "8",
        "--top",
        "1",
    ]
    assert plan_main(flags) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"qwen2.5 7.62B ({folder}/config.json), seq_len")


def test_a_million_entry_layer_list_is_refused_before_any_per_layer_loop(tmp_path):
    config = {**released("qwen3_30b_a3b"), "mlp_only_layers": [0] * 1_000_000}
    with pytest.raises(HFCheckpointError, match="mlp_only_layers lists 1000000 layers, beyond any Qwen"):
        from_hf(config_folder(tmp_path, config))


def test_a_zero_sparse_step_is_one_line_not_a_division_by_zero():
    from autopar.models import get_flavor
    from autopar.models.flavors import with_overrides

    with pytest.raises(ValueError, match=r"model\.decoder_sparse_step=0 must be positive"):
        with_overrides(get_flavor("qwen3", "30B-A3B"), {"decoder_sparse_step": 0})


def test_sliding_window_layers_are_refused_in_one_line(tmp_path):
    """transformers 5 runs a window where layer_types names one and sliding_window is set."""
    config = {**released("qwen2_5_7b_instruct"), "layer_types": ["sliding_attention", "full_attention"]}
    with pytest.raises(
        HFCheckpointError, match="layer_types has 'sliding_attention' layers with sliding_window"
    ):
        read_hf_config(config_folder(tmp_path, config))
    config["sliding_window"] = None  # no window: every layer attends fully, as in transformers
    assert read_hf_config(config_folder(tmp_path, config)).num_hidden_layers == 2


def test_a_checkpoint_from_before_the_yarn_fields_resumes_without_a_change():
    """Its recorded settings lack model.rope_type and the rest: it ran their defaults."""
    from autopar.training.checkpointing.previous_run import changed_settings, settings_record
    from autopar.training.resolve import model_args, parse_job

    job = parse_job(["--model.name", "qwen3", "--model.flavor", "debug"])
    args = model_args(job)
    settings = {k: v for k, v in json.loads(settings_record(job, args)).items() if "rope_" not in k}
    assert "model.rope_theta" not in settings
    saved = {"settings": json.dumps({**settings, "model.rope_theta": args.rope_theta})}
    assert changed_settings(saved, job, args) == {}
    yarn = parse_job(["--model.name", "qwen3", "--model.flavor", "debug", "--model.rope_type", "yarn"])
    yarn_args = dataclasses.replace(args, rope_type="yarn", rope_original_max_position_embeddings=16)
    assert set(changed_settings(saved, yarn, yarn_args)) == {
        "model.rope_type",
        "model.rope_original_max_position_embeddings",
    }
