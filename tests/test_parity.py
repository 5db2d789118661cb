"""Parity: every layout reproduces the single-process run (fp32): loss at each step and final weights."""
import pytest

from parity_cases import CASES, CI_CASES

LOSS_TOL = 1e-5
WEIGHT_TOL = 1e-5
NORM_TOL = 1e-5  # relative
ADAMW_TOL = 1e-6  # torch's AdamW implementations against each other, same layout


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CI_CASES))  # the LARGE ones: benchmarks/parity_large.py
def test_layout_matches_single_process(name, parity_results):
    results, failures = parity_results
    assert name not in failures, f"worker launch failed:\n{failures[name]}"
    check(name, results[name])


def check(name: str, r: dict) -> None:
    """Every assertion on one case's result (benchmarks/parity_large.py applies the same to its cases)."""
    tol = CASES[name].get("tol", LOSS_TOL)
    assert r["ranks_agree"], "ranks returned different losses"
    assert not r["missing_keys"], f"state-dict keys differ from the unparallelized model: {r['missing_keys']}"
    assert r["clipped"], "gradient clipping was not active at every step: the global norm was not compared"
    assert r["loss_diff"] <= tol, (r["losses"], r["ref_losses"])
    assert r["norm_rel_diff"] <= CASES[name].get("tol", NORM_TOL), "global gradient norm differs"
    assert r["weight_diff"] <= CASES[name].get("tol", WEIGHT_TOL)
    assert r["eval_diff"] <= tol, "eval_step differs from the reference model's loss in eval mode"
    for rank, (held, predicted) in enumerate(r["bytes_held"]):  # the planner's per-rank bytes are exact
        assert held == predicted, f"rank {rank}: parameter/gradient/optimizer bytes held {held}, planner {predicted}"
    for kind, (loss_diff, weight_diff) in r["adamw"].items():  # foreach (CUDA's default), fused (the Trainer's)
        assert loss_diff <= ADAMW_TOL and weight_diff <= ADAMW_TOL, f"AdamW {kind} vs for-loop: {loss_diff}, {weight_diff}"
    layout = CASES[name]["layout"]
    if layout.get("fsdp_forward_prefetch") or layout.get("fsdp_backward_prefetch"):
        # 8 layers: layer i prefetches min(n, layers left) in each direction
        want = [sum(min(layout.get(f"fsdp_{way}_prefetch", 0), left) for left in range(8))
                for way in ("forward", "backward")]
        assert r["prefetch"] == want, (r["prefetch"], want)
    if CASES[name].get("count_collectives"):  # accumulation's communication per optimizer step (rank 0's)
        calls, groups = r["collectives"], r["collectives"]["fsdp_groups"]
        if layout.get("pp"):  # the schedule's micro-batches
            micro_batches = layout.get("pp_microbatches") or layout["pp"] * layout.get("pp_virtual_stages", 1)
        else:
            micro_batches = CASES[name]["accumulate"][1]
        once = layout.get("grad_sync", "step" if layout.get("pp") else "micro_batch") == "step"
        if once or layout.get("zero_stage", 3) == 2:  # the weights stay gathered over the step
            assert calls["all_gather"] == groups, f"weights gathered {calls['all_gather']} times, {groups} groups"
        else:  # ZeRO-3 reduced every micro-batch: gathered again for each micro-batch
            assert calls["all_gather"] >= groups * micro_batches, calls
        assert calls["reduce_scatter"] == groups * (1 if once else micro_batches), calls
    if layout.get("compile", "none") != "none":
        assert r["compiled_graphs"] > 0, "compile: regional compiled nothing"
        if not layout.get("cp"):  # context parallel's attention runs eagerly inside the layer: a break there
            assert r["graph_breaks"] == 0, f"{r['graph_breaks']} graph breaks inside the compiled layers"
    if CASES[name].get("roundtrip"):
        assert r["roundtrip"], "state_dict() -> load_state_dict() in the same layout did not restore the weights"
    if layout.get("router_bias_update"):  # the balancing biases moved (and match one process's: weights above)
        assert r["router_bias"] and r["router_bias"] >= 0.99 * layout["router_bias_update"], r["router_bias"]  # fp32
    if "tol" in CASES[name]:  # reduced precision must really have run: not bit-identical to fp32
        assert r["loss_diff"] > 0
