"""ParallelConfig: round trips and every validation error, raised before any process group exists."""
import pytest
import torch.distributed as dist

from models import make_config
import ultrascale_plugins as us
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
    owners = {f.name: f.plugin for f in us.get_plugin_manager().fields}
    assert owners["tp"] == "ultrascale_plugins.dims.tensor.plugin"
    assert owners["pp_schedule"] == "ultrascale_plugins.dims.pipeline.plugin"
    assert owners["zero_stage"] == "ultrascale_plugins.dims.data_parallel.plugin"
    assert owners["activation_checkpointing"] == "ultrascale_plugins.features.activation_checkpointing.plugin"


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
    ({"pp": 2, "dp_shard": 2, "zero_stage": 2, "pp_schedule": "zbv", "grad_sync": "micro_batch"},
     ["grad_sync='micro_batch'", "pp_schedule='zbv'", "grad_sync: step"]),
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
    from ultrascale_plugins.dims.pipeline.plugin import split_layers

    assert split_layers(8, 2) == [4, 4]
    assert split_layers(6, 4) == [1, 2, 2, 1]  # first and last stage also carry the embedding and the head
    assert split_layers(8, 2, embed_cost=0, head_cost=4) == [6, 2]
    assert sum(split_layers(30, 7)) == 30


def test_pp_larger_than_layers():
    with pytest.raises(ConfigError, match="num_hidden_layers=2"):
        validate(ParallelConfig(pp=3), make_config("llama"), world_size=3)


@pytest.mark.parametrize("fields, words", [
    ({"mixed_precision": "fp16"}, ["fp16", "bf16"]),
    ({"tp": 2, "zero_stage": 1, "grad_sync": "micro_batch"}, ["grad_sync='micro_batch'", "zero_stage=1",
                                                               "grad_sync: step"]),
    ({"zero_stage": 0, "grad_sync": "micro_batch"}, ["grad_sync='micro_batch'", "zero_stage=0", "zero_stage: 2 or 3"]),
    ({"grad_sync": "sometimes"}, ["grad_sync", "sometimes", "micro_batch"]),
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


@pytest.mark.parametrize("fields", [{"tp": 2, "zero_stage": 1}, {"tp": 2, "zero_stage": 0},
                                    {"tp": 2, "dp_replicate": 2, "dp_shard": 1}])
def test_replicated_data_parallel_over_tensor_parallel_is_a_layout(fields):
    """DDP and ZeRO-1 with TP (the Ultra-Scale Playbook's and Frontier's layouts) validate: ZeRO-1 runs on FSDP2, DDP
    on the engine's all-reduce (tests/parity_cases.py: ddp_dp2_tp2, zero1_dp2_tp2_sp, pp2_tp2_dp2_zero1)."""
    validate(ParallelConfig(**fields), make_config("llama"), world_size=4)


@pytest.mark.parametrize("fields, resolved", [({}, "micro_batch"), ({"zero_stage": 2}, "micro_batch"),
                                              ({"zero_stage": 1}, "step"), ({"zero_stage": 0}, "step"),
                                              ({"pp": 2, "dp_shard": 2}, "step"),
                                              ({"grad_sync": "step"}, "step")])
def test_grad_sync_auto(fields, resolved):
    """auto: ZeRO-2/3 reduce every micro-batch (sharded accumulation), ZeRO-0/1 and pipelines once per step."""
    assert ParallelConfig(**fields).resolve(4).grad_sync == resolved


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
    from ultrascale_plugins.data.recipe import load_recipe

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


# ---- the recipe's model section against its model type's config class (issue 32, silent failure 4) -----------
def test_every_model_type_accepts_the_keys_of_its_own_default_config():
    """No false refusals: for every model type transformers ships (CONFIG_MAPPING), the keys its default config
    writes (``to_dict``, what a config.json holds; sub-configs as nested mappings) are all accepted."""
    from transformers import CONFIG_MAPPING
    from transformers.utils import logging as hf_logging

    from ultrascale_plugins.data.model_section import check_model_section

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # several default configs warn about their own token ids
    refused, checked, unbuildable = {}, 0, []
    try:
        for model_type, cls in CONFIG_MAPPING.items():
            try:
                section = {**cls().to_dict(), "model_type": model_type}
            except Exception:  # noqa: BLE001 - a class transformers itself cannot build with its defaults
                unbuildable.append(model_type)
                continue
            try:
                check_model_section(section)
                checked += 1
            except ConfigError as exc:
                refused[model_type] = str(exc)
    finally:
        hf_logging.set_verbosity(verbosity)
    assert not refused, refused
    assert checked > 500 and len(unbuildable) < 30, (checked, unbuildable)  # 5.25: 2 of 831; 5.17: 14


@pytest.mark.parametrize("section,words", [
    ({"hiden_size": 128}, ["unknown key 'model.hiden_size'", "did you mean 'hidden_size'?", "LlamaConfig",
                           "Fix: hidden_size: 128"]),
    ({"num_hidden_layer": 2}, ["model.num_hidden_layer", "did you mean 'num_hidden_layers'?"]),
    ({"temperature": 0.7}, ["model.temperature=0.7", "generation setting", "Fix: remove it"]),
    ({"use_return_dict": False}, ["model.use_return_dict", "did you mean 'return_dict'?"]),
    ({"model_type": "lama"}, ["model.model_type='lama'", "did you mean 'llama'?", "Fix:"]),
    ({"xyzzy": 1}, ["unknown key 'model.xyzzy': valid keys: ", "hidden_size", "Fix: remove it"]),
])
def test_a_model_section_typo_is_refused_with_the_likely_key(section, words):
    from ultrascale_plugins.data.recipe import model_config_of

    with pytest.raises(ConfigError) as info:
        model_config_of({"model_type": "llama", **section})
    for word in words:
        assert word in str(info.value), str(info.value)


def test_names_transformers_takes_without_declaring_them_are_accepted():
    """Legacy names transformers turns into fields (rope_scaling, rope_theta, torch_dtype), aliases
    (attribute_map: gpt2's hidden_size, qwen3_moe's num_experts), class-level settings (base_model_tp_plan), an
    attribute only the model code reads (Qwen3-MoE's head_dim: its real config.json has it) and sub-configs."""
    import torch

    from ultrascale_plugins.data.recipe import model_config_of

    config = model_config_of({"model_type": "llama", "rope_scaling": {"rope_type": "linear", "factor": 4.0},
                              "rope_theta": 50000.0, "torch_dtype": "bfloat16"})
    assert config.rope_parameters["factor"] == 4.0 and config.rope_parameters["rope_theta"] == 50000.0
    assert config.dtype == torch.bfloat16
    assert model_config_of({"model_type": "gpt2", "hidden_size": 64, "n_head": 4}).n_embd == 64
    assert model_config_of({"model_type": "qwen3_moe", "num_experts": 4}).num_local_experts == 4
    assert model_config_of({"model_type": "qwen3_moe", "head_dim": 16}).head_dim == 16
    assert model_config_of({"model_type": "llama", "base_model_tp_plan": {}}).base_model_tp_plan == {}
    llava = model_config_of({"model_type": "llava", "text_config": {"model_type": "llama", "hidden_size": 32,
                                                                      "num_attention_heads": 4}})
    assert llava.text_config.hidden_size == 32
    with pytest.raises(ConfigError, match=r"unknown key 'model\.vision_config\.hiden_size': did you mean "
                                          r"'hidden_size'\?.*CLIPVisionConfig"):
        model_config_of({"model_type": "llava", "vision_config": {"hiden_size": 32}})


def test_the_layout_line_says_every_field_a_run_sets_away_from_its_default():
    """``ParallelDims.describe`` (every front end's ``layout ...`` line): the mesh, then each field whose value
    differs from its plugin's default -- the memory features a run turned on included -- each said once; a
    layout of defaults says nothing more than its mesh."""
    from ultrascale_plugins.interface.parallel_dims import ParallelDims

    def line(world, **fields):
        return ParallelDims(ParallelConfig(**fields).resolve(world), world).describe()

    assert line(2) == "dp_shard=2 (ZeRO-3)"
    assert line(2, cpu_offload=True, optimizer_in_backward=True) == \
        "dp_shard=2 (ZeRO-3) x cpu_offload x optimizer_in_backward"
    assert line(2, activation_offload=True, chunked_loss=512, param_dtype="bf16") == \
        "dp_shard=2 (ZeRO-3) x param_dtype=bf16 x chunked_loss=512 x activation_offload"
    # ZeRO-1 over replicas: the stage is said even where no dp_shard axis says it
    assert line(2, dp_replicate=2, dp_shard=1, zero_stage=1) == "dp_replicate=2 x zero_stage=1"
    # what the mesh part says already is not said twice; a field resolved from "auto" is not a setting
    assert line(2, tp=2, sequence_parallel="auto", mixed_precision="bf16") == "tp=2 + sequence parallel x bf16"
    assert line(4, pp=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=2, activation_checkpointing="full") == \
        "pp=2 (interleaved_1f1b, 2 stages/rank) x dp_shard=2 (ZeRO-3) x activation checkpointing=full"


def test_the_layout_line_is_worded_by_the_plugins_that_declare_axes_and_fields():
    """Each part of the layout line comes from a declaration: an axis words itself after ``name=degree``
    (``MeshAxis.words``; the fields it says, ``says``, are not said again), in mesh order, and a field worded by
    its plugin (``fields.add(..., words=)``) is said so when set away from its default. The line's module names
    no family's field: the built-in ones word themselves the same way."""
    import inspect

    from ultrascale_plugins.core.registry import make_registry
    from ultrascale_plugins.interface import parallel_dims
    from ultrascale_plugins.interface.parallel_dims import ParallelDims

    class Acme:
        @us.hookimpl
        def ultrascale_declare_fields(self, fields):
            fields.add("acme_dp", int, 1, "acme replica groups", minimum=1)
            fields.add("acme_mode", str, "fast", "how acme replicas talk", choices=("fast", "slow"))
            fields.add("acme_dtype", str, "fp32", "acme's dtype", choices=("fp32", "fp8"), words=lambda v: f"acme {v}")

        @us.hookimpl
        def ultrascale_declare_mesh_axes(self, config):
            return [us.MeshAxis("acme_dp", config.acme_dp, after="dp_replicate", before="dp_shard", reduces_grads=True,
                                words=f"({config.acme_mode} replicas)", says="acme_mode")]

    registry = make_registry(load_entry_points=False)
    registry.register(Acme(), name="acme")

    def line(world, **fields):
        return ParallelDims(registry.config(**fields).resolve(world), world).describe()

    assert line(16, acme_dp=2, acme_mode="slow", acme_dtype="fp8", tp=2, cp=2, zero_stage=2) == \
        "acme_dp=2 (slow replicas) x dp_shard=2 (ZeRO-2) x cp=2 (ring) x tp=2 x acme fp8"
    # an axis of degree 1 is no part of the line, so the fields its words would say are said by name
    assert line(2, acme_mode="slow") == "dp_shard=2 (ZeRO-3) x acme_mode=slow"
    source = inspect.getsource(parallel_dims)
    for name in ("zero_stage", "sequence_parallel", "pp_schedule", "activation_checkpointing", "mixed_precision",
                 "_method", "ZeRO", "dp_shard\"", "\"tp\""):
        assert name not in source, name
