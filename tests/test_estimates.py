"""Each dimension contributes its memory and communication terms through ``ultrascale_estimate``."""
import pytest

import ultrascale_plugins as us
from models import make_config
from ultrascale_plugins.estimates import parameter_count


def test_parameter_count_matches_the_model():
    from models import make_model

    for arch in ("llama", "llama_tied", "qwen2"):
        model = make_model(arch)
        exact = sum(p.numel() for p in model.parameters())
        assert abs(parameter_count(make_config(arch)) - exact) / exact < 0.01, arch


def test_zero_stages_shrink_model_states_as_the_formulas_say():
    mc = make_config("llama")
    psi = parameter_count(mc)
    def states(z):
        memory = us.estimate(us.ParallelConfig(zero_stage=z), mc, world_size=4).memory
        return memory["params"] + memory["grads"] + memory["optimizer"]

    states = {z: states(z) for z in (0, 1, 2, 3)}
    assert states[0] == pytest.approx(16 * psi)  # fp32 Adam: 4 + 4 + 8 bytes per parameter
    assert states[1] == pytest.approx(8 * psi + 8 * psi / 4)
    assert states[2] == pytest.approx(4 * psi + 12 * psi / 4)
    assert states[3] == pytest.approx(16 * psi / 4)


def test_tp_adds_communication_and_divides_states():
    mc = make_config("llama")
    dp_only = us.estimate(us.ParallelConfig(dp_shard=2), mc, world_size=2, seq_len=16)
    tp = us.estimate(us.ParallelConfig(tp=2), mc, world_size=2, seq_len=16)
    assert "tp" in tp.comm and "tp" not in dp_only.comm  # communication per mesh axis
    assert "dp_shard" in dp_only.comm and "dp_shard" not in tp.comm
    assert tp.memory["params"] == pytest.approx(dp_only.memory["params"] * 2 / 2)  # psi/tp vs psi/dp_shard


def test_memory_comes_in_the_planner_categories():
    est = us.estimate(us.ParallelConfig(tp=2, sequence_parallel=True, activation_checkpointing="full"),
                      make_config("llama"), world_size=2, seq_len=64)
    assert set(est.memory) == {"params", "grads", "optimizer", "activations", "other"}
    assert est.memory["activations"] > 0 and est.factors["recompute_flops"] > 1
    assert est.total_memory == pytest.approx(sum(est.memory.values()))


def test_estimate_validates_the_layout():
    with pytest.raises(us.ConfigError, match="world size is 3"):
        us.estimate(us.ParallelConfig(tp=2, dp_shard=2), make_config("llama"), world_size=3)
