"""ParallelConfig: round trips and every validation error, raised before any process group exists."""
import pytest
import torch.distributed as dist

from models import make_config
from ultrascale_plugins import ConfigError, ParallelConfig, validate


def test_round_trip_dict_and_yaml(tmp_path):
    cfg = ParallelConfig(dp_replicate=2, dp_shard=2, tp=2, sequence_parallel=True, zero_stage=2,
                         activation_checkpointing="selective", mixed_precision="bf16")
    assert ParallelConfig.from_dict(cfg.to_dict()) == cfg
    path = tmp_path / "layout.yaml"
    import yaml

    path.write_text(yaml.safe_dump({"parallel": cfg.to_dict()}))
    assert ParallelConfig.from_yaml(path) == cfg
    path.write_text(yaml.safe_dump(cfg.to_dict()))  # a bare mapping works too
    assert ParallelConfig.from_yaml(path) == cfg


def test_every_documented_field_exists():
    assert set(ParallelConfig.field_names()) >= {
        "dp_replicate", "dp_shard", "tp", "sequence_parallel", "loss_parallel", "pp", "pp_schedule", "pp_split",
        "pp_microbatches", "pp_virtual_stages", "zero_stage", "activation_checkpointing", "mixed_precision"}


def test_fields_come_from_the_plugins_that_declare_them():
    from ultrascale_plugins.plugins import layout_fields

    owners = {f.name: f.plugin for f in layout_fields()}
    assert owners["tp"] == "ultrascale_plugins.dims.tensor"
    assert owners["pp_schedule"] == "ultrascale_plugins.dims.pipeline"
    assert owners["zero_stage"] == "ultrascale_plugins.dims.data_parallel"
    assert owners["activation_checkpointing"] == "ultrascale_plugins.dims.checkpointing"


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize("fields, words", [
    ({"tp": 0}, ["tp=0", "at least 1"]),
    ({"dp_shard": 0}, ["dp_shard=0", "-1"]),
    ({"pp": -2}, ["pp=-2", "at least 1"]),
    ({"tp": "two"}, ["tp='two'", "integer"]),
    ({"sequence_parallel": "yes"}, ["sequence_parallel='yes'", "true or false"]),
    ({"pp_schedule": "1f2b"}, ["pp_schedule='1f2b'", "did you mean '1f1b'"]),
    ({"cp_method": "rings"}, ["cp_method='rings'", "did you mean 'ring'"]),
    ({"zero_stage": 4}, ["zero_stage=4", "0, 1, 2, 3"]),
    ({"activation_checkpointing": "all"}, ["activation_checkpointing='all'", "full"]),
    ({"mixed_precision": "bf32"}, ["mixed_precision='bf32'", "bf16"]),
    ({"compile": "full"}, ["compile='full'", "regional"]),
    ({"fsdp_backward_prefetch": -1}, ["fsdp_backward_prefetch=-1", "at least 0"]),
])
def test_bad_fields(fields, words):
    with pytest.raises(ConfigError) as err:
        ParallelConfig(**fields)
    for word in words:
        assert word in str(err.value)
    assert "Fix:" in str(err.value)


def test_unknown_key_suggests_closest():
    with pytest.raises(ConfigError, match="did you mean 'dp_shard'"):
        ParallelConfig.from_dict({"dp_shards": 2})


def test_product_must_equal_world_size():
    with pytest.raises(ConfigError) as err:
        ParallelConfig(dp_shard=2, tp=2).resolve(3)
    assert "world size is 3" in str(err.value) and "dp_shard: -1" in str(err.value)
    with pytest.raises(ConfigError, match="does not divide the world size 6"):
        ParallelConfig(tp=4).resolve(6)
    assert ParallelConfig(tp=2).resolve(8).dp_shard == 4


def test_tp_must_divide_heads_and_kv_heads():
    mc = make_config("llama")  # 4 heads, 2 kv heads
    with pytest.raises(ConfigError, match="num_attention_heads=4"):
        validate(ParallelConfig(tp=3), mc, world_size=3)
    with pytest.raises(ConfigError, match="num_key_value_heads=2"):
        validate(ParallelConfig(tp=4), mc, world_size=4)


@pytest.mark.parametrize("fields, words", [
    ({"pp": 2, "pp_schedule": "1f1b", "pp_virtual_stages": 2}, ["pp_virtual_stages=2", "one stage per rank"]),
    ({"pp": 2, "pp_schedule": "interleaved_1f1b"}, ["needs pp_virtual_stages >= 2"]),
    ({"pp": 2, "pp_schedule": "zbv", "pp_virtual_stages": 3}, ["exactly 2 stages per rank"]),
    ({"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2, "pp_microbatches": 3},
     ["pp_microbatches=3", "multiple of pp=2"]),
    ({"pp": 2, "pp_schedule": "1f1b", "pp_microbatches": 1}, ["pp_microbatches=1", "at least pp=2"]),
    ({"pp": 2, "pp_schedule": "dualpipev", "pp_microbatches": 2}, ["at least 2*pp=4"]),
    ({"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 8}, ["16 stages", "num_hidden_layers=8"]),
    ({"pp": 2, "pp_split": [2, 1]}, ["pp_split=[2, 1]", "summing to num_hidden_layers=8"]),
    ({"pp": 2, "pp_split": "1,1"}, ["pp_split='1,1'", "a list"]),
    ({"pp": 2, "pp_split": [1, "x"]}, ["pp_split=[1, 'x']", "list of layer counts"]),
])
def test_pipeline_combinations_a_schedule_cannot_run(fields, words):
    with pytest.raises(ConfigError) as err:
        validate(ParallelConfig(**fields), make_config("llama8"),
                 world_size=fields["pp"] * fields.get("tp", 1) * fields.get("dp_shard", 1))
    for word in words:
        assert word in str(err.value)


def test_balanced_stage_split_counts_embedding_and_head():
    from ultrascale_plugins.dims.pipeline import split_layers

    assert split_layers(8, 2) == [4, 4]
    assert split_layers(6, 4) == [1, 2, 2, 1]  # first and last stage also carry the embedding and the head
    assert split_layers(8, 2, embed_cost=0, head_cost=4) == [6, 2]
    assert sum(split_layers(30, 7)) == 30


def test_pp_larger_than_layers():
    with pytest.raises(ConfigError, match="num_hidden_layers=2"):
        validate(ParallelConfig(pp=3), make_config("llama"), world_size=3)


@pytest.mark.parametrize("fields, words", [
    ({"mixed_precision": "fp16"}, ["fp16", "bf16"]),
    ({"tp": 2, "zero_stage": 1}, ["zero_stage=1", "tp=2", "zero_stage: 2 or 3"]),
    ({"tp": 2, "dp_replicate": 2, "dp_shard": 1}, ["dp_shard=1", "tp=2", "dp_shard >= 2"]),
    ({"tp": 4}, ["num_key_value_heads=2"]),
    ({"sequence_parallel": True}, ["sequence_parallel", "tp > 1"]),
    ({"loss_parallel": True}, ["loss_parallel", "tp > 1"]),
    ({"tp": 2, "dp_shard": 2, "activation_checkpointing": "full", "compile": "regional"},
     ["compile='regional'", "activation_checkpointing=full, tp=2", "activation_checkpointing: selective"]),
    ({"zero_stage": 1, "fsdp_forward_prefetch": 2}, ["fsdp_forward_prefetch=2", "zero_stage=1", "zero_stage: 2 or 3"]),
])
def test_validate_before_any_process_group(fields, words):
    with pytest.raises(ConfigError) as err:
        validate(ParallelConfig(**fields), make_config("llama"), world_size=4)
    for word in words:
        assert word in str(err.value)
    assert not dist.is_initialized()


def test_parallelize_rejects_bad_layout_before_creating_a_group(monkeypatch):
    from models import make_model
    from ultrascale_plugins import parallelize

    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="world size is 4"):
        parallelize(make_model("llama"), ParallelConfig(dp_shard=2, tp=1))
    assert not dist.is_initialized()


def test_the_names_people_know_the_dimensions_by_are_suggested():
    for wrong, right in (("tensor_parallel", "tp"), ("pipeline_parallel_size", "pp"), ("zero", "zero_stage")):
        with pytest.raises(ConfigError, match=f"did you mean '{right}'"):
            ParallelConfig(**{wrong: 2})


def test_a_bare_yaml_no_reads_as_the_choice_no():
    """`--set mixed_precision=no` (YAML reads a bare no as false) means the choice "no", not a type error."""
    from ultrascale_plugins.recipe import load_recipe

    assert load_recipe(None, ["mixed_precision=no"]).parallel.mixed_precision == "no"
    assert ParallelConfig.from_dict({"mixed_precision": False}).mixed_precision == "no"


def test_accelerate_and_trainer_compile_settings_map_onto_regional_compilation():
    """Accelerate's dynamo settings (the Trainer's torch_compile arrives through them) become compile: regional,
    or are refused naming the setting; "no" leaves compilation off."""
    from accelerate.utils import TorchDynamoPlugin

    from ultrascale_plugins.integrations.layout import compile_from_dynamo

    assert compile_from_dynamo(None, None, {"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR"}) == "regional"
    assert compile_from_dynamo(None, "inductor", {}) == "regional"
    assert compile_from_dynamo(TorchDynamoPlugin(backend="inductor", mode="default"), None, {}) == "regional"
    assert compile_from_dynamo(None, None, {"ACCELERATE_DYNAMO_BACKEND": "NO"}) is None
    assert compile_from_dynamo(None, None, {}) is None
    with pytest.raises(ConfigError, match="dynamo_backend='aot_eager'.*inductor"):
        compile_from_dynamo(None, "aot_eager", {})
    with pytest.raises(ConfigError, match="dynamo_mode='reduce-overhead'.*default"):
        compile_from_dynamo(None, None, {"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR",
                                         "ACCELERATE_DYNAMO_MODE": "reduce-overhead"})
