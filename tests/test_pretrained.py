"""Pretrained HF directories: names, tied weights, shapes and unsafe formats are checked before any process group
exists (the multi-rank loads into every layout are in test_checkpoint.py)."""
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from models import make_config, make_model
from ultrascale_plugins.checkpoints.errors import CheckpointError
from ultrascale_plugins.checkpoints.load import prepare, weights_for
from ultrascale_plugins.core.meta_build import empty_model


@pytest.fixture
def hf_dir(tmp_path):
    make_model("llama_tied", seed=1).save_pretrained(tmp_path / "m")
    return tmp_path / "m"


def test_tied_head_reads_the_embedding_and_nothing_is_allocated(hf_dir):
    weights, model = prepare(hf_dir)
    assert "lm_head.weight" not in load_file(hf_dir / "model.safetensors")  # transformers stores it once
    assert weights.sources["lm_head.weight"] == "model.embed_tokens.weight"
    assert weights.unexpected == []
    assert all(p.is_meta for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not model.model.rotary_emb.inv_freq.is_meta  # buffers are computed, not loaded
    assert not dist.is_initialized()


def test_bare_decoder_checkpoint_matches_without_the_prefix(tmp_path, hf_dir):
    state = load_file(hf_dir / "model.safetensors")
    save_file({k.removeprefix("model."): v for k, v in state.items()}, str(hf_dir / "model.safetensors"))
    weights, _ = prepare(hf_dir)
    assert weights.sources["model.layers.0.mlp.up_proj.weight"] == "layers.0.mlp.up_proj.weight"


def test_missing_and_unexpected_keys(hf_dir):
    state = load_file(hf_dir / "model.safetensors")
    state["extra.weight"] = torch.zeros(2)
    del state["model.norm.weight"]
    save_file(state, str(hf_dir / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing keys: model\.norm\.weight"):
        prepare(hf_dir)
    state["model.norm.weight"] = torch.ones(64)
    save_file(state, str(hf_dir / "model.safetensors"))
    assert prepare(hf_dir)[0].unexpected == ["extra.weight"]


def test_shape_mismatch_names_key_and_file(hf_dir):
    model = empty_model(make_config("llama_tied"))
    state = load_file(hf_dir / "model.safetensors")
    state["model.norm.weight"] = torch.ones(32)
    save_file(state, str(hf_dir / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight: model \(64,\), file \(32,\) in model\.safet"):
        weights_for(model, hf_dir)


def test_pickled_weights_are_refused_not_unpickled(tmp_path, hf_dir):
    (hf_dir / "model.safetensors").rename(hf_dir / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pytorch_model.bin would need unpickling"):
        prepare(hf_dir)
    with pytest.raises(CheckpointError, match="no config.json"):
        prepare(tmp_path)


def test_parallelize_reads_init_from_and_warns_of_unused_keys(hf_dir):
    """``parallelize(model, init_from=DIR)``, the one way every front end builds its model: a meta-device model
    takes the directory's weights, and rank 0 warns of keys in the files the model does not read."""
    import ultrascale_plugins as us

    state = load_file(hf_dir / "model.safetensors")
    state["extra.weight"] = torch.zeros(2)
    save_file(state, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    model = empty_model(make_config("llama_tied"))
    try:
        with pytest.warns(UserWarning, match=r"1 key\(s\) in the files are not used by the model: extra\.weight"):
            pmodel = us.parallelize(model, us.ParallelConfig(dp_shard=1), device=torch.device("cpu"),
                                    init_from=str(hf_dir))
        got = pmodel.full_state_dict()
        assert torch.equal(got["model.norm.weight"], state["model.norm.weight"])
        assert torch.equal(got["model.layers.0.mlp.up_proj.weight"], state["model.layers.0.mlp.up_proj.weight"])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
