"""us.dry_run runs expert parallel (under its stated routing) and context parallel (ring and Ulysses): the step runs
on fake tensors, its parameters are the rank's real shards, its ledger moves bytes on the family's axis, and its
peak is a real two-process step's under the same tracker, with the tokens routed as the dry run assumes."""
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig, Qwen3MoeConfig

import ultrascale_plugins as us

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from dry_run_vs_real import real_step_peak, reduce_scatter_without_a_copy  # noqa: E402

MOE = Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                     num_experts_per_tok=2, max_position_embeddings=256)
DENSE = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=256)
SEQ = 64
# the layouts compared with a real step over 2 processes: (model config, layout)
CASES = {"ep": (MOE, dict(dp_shard=2, ep=2)),
         "cp_ring": (DENSE, dict(dp_shard=1, cp=2)),
         "cp_ulysses": (DENSE, dict(dp_shard=1, cp=2, cp_method="ulysses"))}


def dry(config, world=2, routing="uniform", **layout):
    return us.dry_run(config, us.ParallelConfig(**layout), world_size=world, seq_len=SEQ, routing=routing)


@pytest.fixture(scope="module")
def reports():
    """Each case's dry run at 2 ranks (made once, for every test of the case); the caller's model config left as it
    was (context parallel's stage names its attention function on the config it builds from: on a copy)."""
    def said(config):
        return config.to_dict(), config._attn_implementation

    before = {case: said(config) for case, (config, _) in CASES.items()}
    made = {case: dry(config, **layout) for case, (config, layout) in CASES.items()}
    assert {case: said(config) for case, (config, _) in CASES.items()} == before
    return made


@pytest.mark.parametrize("case", list(CASES))
def test_the_layout_runs_and_holds_the_ranks_real_shards(case, reports):
    report = reports[case]
    role = report.roles[0]
    assert role.memory()["params"] == role.local_parameter_bytes == role.estimate_memory["params"] > 0
    assert not dist.is_initialized()
    assert report.assumed and "assumed: " in report.table() and report.to_json()["assumed"] == report.assumed
    assert any("routing uniform" in line for line in report.assumed) == (case == "ep")  # said where experts route


@pytest.mark.parametrize("case", ["cp_ring", "cp_ulysses"])
def test_the_ledger_moves_bytes_on_cp(case, reports):
    role = reports[case].roles[0]
    assert {axis for axis, nbytes in role.comm.items() if nbytes > 0} == {"cp"}
    assert role.estimate_comm["cp"] == pytest.approx(role.comm["cp"], rel=0.25)


@pytest.fixture(scope="module")
def ep_over_4():
    """EP 2 over 4 ranks (ZeRO-3 over 4, the experts' over 2): at 2, the ep ranks are dp_shard's too, and the ledger
    names their group "dp_shard|ep"."""
    return dry(MOE, world=4, dp_shard=4, ep=2)


def test_the_ledger_moves_bytes_on_ep(ep_over_4):
    role = ep_over_4.roles[0]
    assert {axis for axis, nbytes in role.comm.items() if nbytes > 0} == {"dp_shard", "efsdp", "ep"}
    assert role.estimate_comm["ep"] == pytest.approx(role.comm["ep"], rel=0.25)


def test_an_unknown_routing_is_refused_in_one_line_before_any_work():
    with pytest.raises(us.ConfigError, match="routing='zipf'") as err:
        dry(MOE, routing="zipf", dp_shard=2, ep=2)
    assert "\n" not in str(err.value) and not dist.is_initialized()


def _route_in_turn(pmodel, tokens: int) -> None:
    """The real step's routing as the dry run assumes it (uniform): token t's j-th choice is expert
    (t * top_k + j) % experts, so each expert gets tokens * top_k / experts pairs and each ep rank an even share.
    The router runs as written (its own indices kept for its backward, as in the dry run); a copy of these takes
    their place downstream, made in the step (the template, made before it, is seen by no op): the real step holds
    that copy's 1 KB more while the layer's experts run forward, and the same bytes in the backward, where the
    peak falls."""
    for module in pmodel.modules[0].modules():
        if type(module).__name__.endswith("TopKRouter"):
            turns = (torch.arange(tokens * module.top_k) % module.num_experts).view(tokens, module.top_k)
            module.register_forward_hook(lambda mod, args, out, turns=turns: (*out[:2], turns.clone()))


def _prepare(pmodel) -> None:
    reduce_scatter_without_a_copy(pmodel)
    _route_in_turn(pmodel, SEQ)


def _real_peaks(rank: int, world: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        peaks = {case: real_step_peak(config, us.ParallelConfig(**layout), SEQ, prepare=_prepare)
                 for case, (config, layout) in CASES.items()}
        if rank == 0:
            with open(out, "w") as f:
                json.dump(peaks, f)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def real_peaks(tmp_path_factory):
    """Each case's peak by category over one real step, rank 0 of 2 gloo processes (one start for all)."""
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("real")
    out = tmp / "peaks.json"
    mp.start_processes(_real_peaks, args=(2, f"file://{tmp / 'store'}", str(out)), nprocs=2, join=True,
                       start_method="spawn")
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", list(CASES))
def test_the_peak_equals_a_real_two_process_steps(case, reports, real_peaks):
    assert reports[case].roles[0].peak == real_peaks[case]


def test_all_to_one_routing_is_said_and_loads_the_traced_rank(ep_over_4):
    worst = dry(MOE, world=4, routing="all-to-one", dp_shard=4, ep=2)
    assert any("routing all-to-one" in line for line in worst.assumed)
    assert worst.roles[0].peak["Total"] > ep_over_4.roles[0].peak["Total"]


def test_plan_dry_run_takes_the_routing_and_says_it(tmp_path, capsys):
    from ultrascale_plugins.cli.main import main

    MOE.to_json_file(tmp_path / "config.json")
    code = main(["plan", "--model", str(tmp_path / "config.json"), "--gpus", "4", "--gpu", "h100-sxm-80gb",
                 "--seq-len", str(SEQ), "--global-batch-size", "4", "--layout", "dp=4,ep=2,zero=3,mbs=1,ga=1",
                 "--dry-run", "--routing", "all-to-one", "--json"])
    worst = json.loads(capsys.readouterr().out)
    assert code == 0 and any("routing all-to-one" in line for line in worst["assumed"])
