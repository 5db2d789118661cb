"""Pretrained MoE directories in transformers' own checkpoint format: transformers >= 5 fuses a layer's experts into
3-D parameters (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``) but ``save_pretrained`` (and the hub's
checkpoints) store them per expert (``mlp.experts.<e>.gate_proj.weight``, mixtral's ``block_sparse_moe.experts.<e>.w1``
...). ``--init-from`` assembles them with transformers' conversion mapping; the weights must equal transformers' own
``from_pretrained`` exactly, on one process and sharded over two (each rank reading only its experts).

Run as a script under torchrun, this file is the 2-rank worker."""
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import torchrun

EXPERTS = 12  # more than 10: transformers stacks expert 10 after 9 (natural order), not after 1
LAYOUTS = {"zero3": {"dp_shard": 2, "zero_stage": 3}, "tp2": {"tp": 2, "dp_shard": 1}}


def moe_config(model_type: str):
    from transformers import AutoConfig

    sizes = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, max_position_embeddings=64, num_experts_per_tok=2)
    if model_type == "qwen3_moe":
        sizes.update(num_experts=EXPERTS, moe_intermediate_size=16)
    else:
        sizes.update(num_local_experts=EXPERTS)
    return AutoConfig.for_model(model_type, **sizes)


def save_moe(model_type: str, out: Path, **save) -> Path:
    """A random tiny MoE model written by plain ``save_pretrained`` (per-expert tensors)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(moe_config(model_type)).save_pretrained(out, **save)
    return out


def reference_state(path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).state_dict()


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_per_expert_checkpoint_loads_like_transformers(model_type, tmp_path):
    import ultrascale_plugins as us
    from safetensors import safe_open
    from ultrascale_plugins.checkpoints.load import from_pretrained
    from ultrascale_plugins.checkpoints.load import prepare

    path = save_moe(model_type, tmp_path / "m")
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert not any(k.endswith("experts.gate_up_proj") for k in keys)  # the per-expert format, as on the hub
    weights, model = prepare(path)
    assert weights.unexpected == [] and all(p.is_meta for p in model.parameters())
    assert set(weights.fused) == {f"model.layers.{i}.mlp.experts.{p}" for i in range(2)
                                  for p in ("gate_up_proj", "down_proj")}
    ref = reference_state(path)
    try:
        full = from_pretrained(path, us.ParallelConfig()).full_state_dict()
    finally:
        if dist.is_initialized():  # the 1-process group parallelize made: later tests expect none
            dist.destroy_process_group()
    assert set(full) == set(ref)
    for key, value in ref.items():
        assert torch.equal(full[key], value), key


def test_already_fused_checkpoint_and_shape_errors(tmp_path):
    from safetensors.torch import load_file, save_file
    from ultrascale_plugins.checkpoints.errors import CheckpointError
    from ultrascale_plugins.checkpoints.load import prepare

    path = save_moe("qwen3_moe", tmp_path / "m")
    ref = reference_state(path)
    # the model's own (fused) names still load as they are
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text((path / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in ref.items()}, str(fused / "model.safetensors"), metadata={"format": "pt"})
    weights, _ = prepare(fused)
    assert weights.fused == {} and weights.sources["model.layers.0.mlp.experts.down_proj"] == \
        "model.layers.0.mlp.experts.down_proj"
    # a missing expert is a shape mismatch of the fused parameter, named
    state = load_file(path / "model.safetensors")
    del state["model.layers.1.mlp.experts.11.down_proj.weight"]
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.down_proj: model \(12, 32, 16\), "
                                              r"files \(11, 32, 16\)"):
        prepare(path)


@pytest.mark.slow
def test_two_ranks_read_only_their_experts_and_equal_transformers(tmp_path):
    proc = torchrun(2, __file__, str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    r = json.loads((tmp_path / "moe.json").read_text())
    for name in LAYOUTS:
        assert r[name]["keys_equal"] and r[name]["weight_diff"] == 0.0, (name, r[name])
    # ZeRO-3 shards the experts dim: each rank reads the per-expert tensors of its 6 experts only, once each
    per_rank = [set(keys) for keys in r["zero3"]["expert_keys_read"]]
    assert all(len(keys) == len(r["zero3"]["expert_keys_read"][0]) for keys in r["zero3"]["expert_keys_read"])
    assert not per_rank[0] & per_rank[1] and len(per_rank[0] | per_rank[1]) == r["expert_keys"]
    assert {k.split(".experts.")[1].split(".")[0] for k in per_rank[0]} == {str(e) for e in range(6)}


def worker(out: Path) -> None:
    import ultrascale_plugins as us
    from ultrascale_plugins.checkpoints import fused_source, read_plan
    from ultrascale_plugins.checkpoints.load import from_pretrained

    us.init_distributed(timeout=120)
    path = out / "hf"
    if dist.get_rank() == 0:  # several safetensors files: experts of one parameter spread over files
        save_moe("qwen3_moe", path, max_shard_size="20KB")
    dist.barrier()
    ref = reference_state(path)
    result = {"expert_keys": sum(".experts." in k for k in read_plan.file_tensors(path))}
    read_keys: list[str] = []
    assemble = fused_source.FusedSource.assemble

    def recording(self, read, rows=None):  # the keys read from the files (not the meta shape check's)
        def reading(item):
            tensor = read(item)
            if not tensor.is_meta:
                read_keys.append(item[0])
            return tensor

        return assemble(self, reading, rows)

    fused_source.FusedSource.assemble = recording
    for name, layout in LAYOUTS.items():
        read_keys.clear()
        full = from_pretrained(path, us.ParallelConfig(**layout)).full_state_dict()
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, list(read_keys))
        result[name] = {"keys_equal": set(full) == set(ref), "expert_keys_read": gathered,
                        "weight_diff": max((full[k] - ref[k]).abs().max().item() for k in ref)}
    if dist.get_rank() == 0:
        (out / "moe.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
