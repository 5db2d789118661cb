"""us.dry_run: one step of the real code path on fake tensors and a fake process group, in this process; and the
package fixes it needs (clipping's coefficient kept a tensor, the ledger letting fake tensors through, release_unheld
skipping them)."""
import json
import resource

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig

import ultrascale_plugins as us

TINY = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=256)


def run(world=8, seq_len=64, config=TINY, **layout):
    return us.dry_run(config, us.ParallelConfig(**layout), world_size=world, seq_len=seq_len)


@pytest.mark.parametrize("layout, world", [(dict(dp_shard=-1), 8), (dict(dp_shard=4, tp=2, sequence_parallel=True), 8),
                                           (dict(dp_shard=1, tp=2), 2)], ids=["zero3_8", "tp2_dp4", "tp2"])
def test_parameter_bytes_are_the_ranks_local_shards_and_the_estimates(layout, world):
    """tp2: tensor parallel alone runs its replicated parameters on their local values, views the tracker takes
    without gradient hooks (``fake_run.peak_tracker``: torch's post-accumulate hook refused them)."""
    role = run(world, **layout).roles[0]
    held = role.memory()["params"]
    assert held == role.local_parameter_bytes == role.estimate_memory["params"] > 0
    assert not dist.is_initialized()  # the fake group is gone


def test_accumulation_runs_each_micro_batch_as_the_loop_does():
    """ZeRO-3 gathers and reduce-scatters for each micro-batch: twice the bytes of one, as the estimate for two;
    the gradients held between them are sharded, so the peak barely moves."""
    one = us.dry_run(TINY, us.ParallelConfig(dp_shard=-1), world_size=8, seq_len=64).roles[0]
    report = us.dry_run(TINY, us.ParallelConfig(dp_shard=-1), world_size=8, seq_len=64, grad_accum=2)
    two = report.roles[0]
    assert report.microbatches == 2 and two.comm["dp_shard"] == pytest.approx(2 * one.comm["dp_shard"], rel=0.01)
    assert two.estimate_comm["dp_shard"] == pytest.approx(two.comm["dp_shard"], rel=0.01)
    assert two.memory()["params"] == one.memory()["params"]


@pytest.mark.parametrize("layout, axes", [(dict(dp_shard=-1), {"dp_shard"}),
                                          (dict(dp_shard=4, tp=2, sequence_parallel=True), {"dp_shard", "tp"}),
                                          (dict(dp_replicate=8, dp_shard=1, zero_stage=0), {"dp_replicate"})],
                         ids=["zero3", "tp_sp", "ddp"])
def test_the_ledger_moves_bytes_on_the_layouts_axes_only(layout, axes):
    role = run(**layout).roles[0]
    assert {axis for axis, nbytes in role.comm.items() if nbytes > 0} == axes
    for axis in axes:  # the estimate's bytes for the same axes, within the ledger's tolerance (docs/planner.md)
        assert role.estimate_comm[axis] == pytest.approx(role.comm[axis], rel=0.25)


def test_activation_checkpointing_and_mixed_precision_run_and_report():
    report = run(dp_shard=-1, activation_checkpointing="full", mixed_precision="bf16")
    rows = {row["what"]: row for row in report.roles[0].rows()}
    assert rows["memory optimizer"]["dry_run"] == rows["memory optimizer"]["estimate"] > 0
    assert rows["memory total"]["dry_run"] > 0 and rows["memory total"]["diff_pct"] is not None
    assert "memory activations" in report.table() and report.roles[0].peak_where
    assert json.loads(json.dumps(report.to_json()))["roles"][0]["rows"]


@pytest.mark.parametrize("field, value", [("float8", "rowwise"), ("cpu_offload", True),
                                          ("chunked_loss", 16), ("compile", "regional")])
def test_a_layout_not_run_yet_is_refused_in_one_line_before_any_work(field, value):
    with pytest.raises(us.ConfigError) as err:
        run(dp_shard=-1, **{field: value})
    assert f"{field}={value}" in str(err.value) and "\n" not in str(err.value)
    assert not dist.is_initialized()


def test_each_field_says_what_the_dry_run_does_not_run_a_third_partys_too():
    """The refusal is each field's own declaration (``fields.add(..., dry_run=why)``): the dry run names no
    family, and a third party's field is refused, or run, the same way."""
    import inspect

    from ultrascale_plugins.core import dry_run as module
    from ultrascale_plugins.core.registry import make_registry

    class Acme:
        @us.hookimpl
        def ultrascale_declare_fields(self, fields):
            fields.add("acme_wire", bool, False, "acme's own link", dry_run="acme's link needs its card")
            fields.add("acme_tag", str, "", "a label acme logs")

    registry = make_registry(load_entry_points=False)
    registry.register(Acme(), name="acme")
    refused = module.refusal(registry.config(acme_wire=True))
    assert refused.startswith("acme_wire=True: ") and "acme's link needs its card" in refused
    assert module.refusal(registry.config(acme_tag="x")) is None
    assert module.refusal(registry.config(pp=2, pp_schedule="zbv", pp_virtual_stages=2)).startswith("pp_schedule=zbv: ")
    source = inspect.getsource(module)
    for name in ('"pp"', '"cp"', '"ep"', "pipeline", "expert"):
        assert name not in source, name


def test_a_process_group_already_there_is_refused(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(us.ConfigError, match="already initialized"):
            run(dp_shard=-1)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("layout", [dict(dp_shard=-1, zero_stage=0), dict(dp_shard=-1)], ids=["ddp", "zero3"])
def test_a_1b_model_over_64_ranks_runs_without_its_weights(layout):
    """ddp: DDP's reducer sizes its gradient buckets from the parameters in C++, outside the dry run's fake mode; it
    allocated a real fp32 copy of the model until the family built DDP inside the weights' own fake mode
    (``fake_values.fake_mode_of``)."""
    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                         num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048)
    model_bytes = 4 * 1.1e9  # fp32, about 1.1B parameters
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    role = run(world=64, seq_len=2048, config=config, **layout).roles[0]
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert grown < 0.1 * model_bytes, f"the process grew by {grown / 2**20:.0f} MiB: weights were materialized"
    assert role.memory()["params"] == role.estimate_memory["params"]
    assert role.memory()["total"] > model_bytes / 64  # the step's activations are counted, not only the shards


# ---- the package fixes the dry run needs ----------------------------------------------------------------------
def _grads(values):
    params = [torch.nn.Parameter(torch.zeros(len(v))) for v in values]
    for p, v in zip(params, values):
        p.grad = torch.tensor(v)
    return params


@pytest.mark.parametrize("max_norm", [0.5, 100.0], ids=["clipped", "below"])
def test_clipping_scales_as_torch_does_and_leaves_gradients_below_the_norm_bitwise(max_norm):
    from ultrascale_plugins.distributed.grad_norm import clip_grad_norm_

    values = [[0.3, -1.7, 2.2], [0.01, 4.0]]
    ours, ref = _grads(values), _grads(values)
    total = clip_grad_norm_(ours, max_norm)
    ref_total = torch.nn.utils.clip_grad_norm_(ref, max_norm)
    assert torch.equal(total, ref_total)
    for a, b in zip(ours, ref):
        assert torch.equal(a.grad, b.grad)
    if max_norm == 100.0:
        assert all(torch.equal(p.grad, torch.tensor(v)) for p, v in zip(ours, values))


def test_clipping_reads_no_value_so_it_runs_on_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ultrascale_plugins.distributed.grad_norm import clip_grad_norm_

    with FakeTensorMode():
        params = _grads([[1.0, 2.0], [3.0]])
        assert clip_grad_norm_(params, 1.0).shape == ()


def test_the_ledger_lets_fake_tensors_through():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ultrascale_plugins.distributed.comm_ledger import CommLedger

    with FakeTensorMode(), CommLedger() as ledger:
        out = torch.nn.functional.pad(torch.ones(2, 3), (0, 1))
    assert out.shape == (2, 4) and ledger.records == []


def test_release_unheld_leaves_fake_parameters_alone():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ultrascale_plugins.core.engine import release_unheld

    with FakeTensorMode():
        model, part = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    weight = model.weight
    release_unheld(model, [part])
    assert model.weight is weight


def _plan(capsys, tmp_path, *args):
    from ultrascale_plugins.cli.main import main

    TINY.to_json_file(tmp_path / "config.json")
    code = main(["plan", "--model", str(tmp_path / "config.json"), "--gpus", "8", "--gpu", "h100-sxm-80gb",
                 "--seq-len", "64", "--global-batch-size", "8", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_dry_run_prints_the_layouts_report(capsys, tmp_path):
    code, out, _ = _plan(capsys, tmp_path, "--layout", "dp=4,tp=2,zero=3,mbs=1,ga=1", "--dry-run", "--json")
    assert code == 0
    (role,) = json.loads(out)["roles"]
    rows = {row["what"]: row for row in role["rows"]}
    assert rows["memory params"]["dry_run"] == rows["memory params"]["estimate"] and rows["comm tp"]["dry_run"] > 0
    code, out, _ = _plan(capsys, tmp_path, "--layout", "dp=8,zero=2,mbs=1,ga=1", "--dry-run")
    assert code == 0 and "memory activations" in out and "comm dp_shard" in out


@pytest.mark.parametrize("args, said", [(["--layout", "dp=4,pp=2,mbs=1,ga=2,schedule=zbv"], "pp_schedule=zbv"), (["--dry-run-top", "0"], "--dry-run-top 0"),
                                        (["--layout", "dp=8,mbs=1,ga=1", "--optimizer", "sgd"], "--optimizer sgd")])
def test_plan_dry_run_refuses_what_it_does_not_run_in_one_line(capsys, tmp_path, args, said):
    code, _, err = _plan(capsys, tmp_path, *args, "--dry-run")
    assert code == 2 and said in err and len(err.strip().splitlines()) == 1


# ---- ultrascale train RECIPE --dry-run ---------------------------------------------------------------------------
RECIPE = str(__import__("pathlib").Path(__file__).parents[1] / "recipes" / "llama_hsdp_tp.yaml")


def test_train_dry_run_runs_the_recipes_step_at_its_world_without_a_worker(capsys, tmp_path):
    """The recipe's layout, world (nproc x --nnodes, no rendezvous needed) and batch split, one step on fake
    tensors in this process; the report's JSON with --metrics."""
    from ultrascale_plugins.cli.main import main

    out = tmp_path / "report.json"
    code = main(["train", RECIPE, "--dry-run", "--nnodes", "2", "--set", "dp_shard=-1", "--set", "train.global_batch=32",
                 "--metrics", str(out)])
    printed = capsys.readouterr().out
    assert code == 0 and "16 ranks, 2 x 128 tokens per rank" in printed and "comm dp_replicate" in printed
    report = json.loads(out.read_text())
    assert report["world_size"] == 16 and report["micro_batch_size"] == 2 and report["microbatches"] == 2
    assert not dist.is_initialized()


@pytest.mark.parametrize("sets, said", [(["train.bf16_stochastic_round=true"], "train.bf16_stochastic_round"),
                                        (["train.optimizer=adamw_8bit"], "train.optimizer=adamw_8bit"),
                                        (["cpu_offload=true"], "cpu_offload=True"), (["tp=3"], "but the world size is 8")])
def test_train_dry_run_refuses_in_one_line_before_any_work(capsys, sets, said):
    from ultrascale_plugins.cli.main import main

    args = ["train", RECIPE, "--dry-run", "--set", "train.global_batch=8", "--set", "train.grad_accum=1"]
    code = main([*args, *[x for s in sets for x in ("--set", s)]])
    err = capsys.readouterr().err
    assert code == 2 and said in err and len(err.strip().splitlines()) == 1, err


def test_plan_dry_run_without_a_layout_checks_its_first_candidates(capsys, tmp_path):
    """The search's first runnable candidates, each dry-run beside the planner's total; one the dry run does not
    run is listed with its reason, not dropped."""
    code, out, _ = _plan(capsys, tmp_path, "--dry-run", "--dry-run-top", "3", "--json")
    rows = json.loads(out)["dry_run_candidates"]
    assert code == 0 and len(rows) == 3
    for row in rows:
        assert ("not_run" in row and row["not_run"].startswith(row["not_run"].split(":")[0] + ": the dry run")) or \
            (row["dry_run_bytes"] > 0 and row["estimate_bytes"] > 0 and row["peak_where"])
    assert any("dry_run_bytes" in row for row in rows)
    code, out, _ = _plan(capsys, tmp_path, "--dry-run", "--dry-run-top", "1")
    assert "dry run of the first candidates" in out and "Chosen:" in out
