"""PEFT (LoRA) models under pipeline parallel: every schedule against the same PEFT model in one process
(tests/peft_pp_worker.py, on tests/peft_worker.py's harness: one 2-process launch, and one 4-process launch for
the pipeline composed with ZeRO-3)."""
import json
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "peft_pp_worker.py"
TOL = 1e-5  # fp32, as tests/test_peft.py


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from conftest import torchrun
    from peft_pp_worker import CASES, CASES4

    out = tmp_path_factory.mktemp("peft_pp") / "results.json"
    proc = torchrun(2, WORKER, str(out), *CASES, "eval:pp2_zbv_llama4", "eval:pp2_1f1b_qwen3_moe")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    out4 = out.parent / "four" / "results.json"
    out4.parent.mkdir()
    proc = torchrun(4, WORKER, str(out4), *CASES4)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    return {**json.loads(out.read_text()), **json.loads(out4.read_text())}


def _cases():
    from peft_pp_worker import CASES, CASES4

    return [*CASES, *CASES4]


@pytest.mark.slow
@pytest.mark.parametrize("name", _cases())
def test_lora_under_a_pipeline_matches_one_process(results, name):
    r = results[name]
    assert r["keys_equal"], "state-dict keys differ from the one-process PEFT model"
    assert r["clipped"], "clipping was not active at every step: the global norm was not compared"
    assert r["loss_diff"] <= TOL, (r["losses"], r["ref_losses"])
    assert r["norm_rel_diff"] <= TOL
    assert r["adapter_diff"] <= TOL and r["adapters"] == r["trainable"] > 0
    assert r["base_unchanged"], "the frozen base changed"
    assert not r["frozen_with_state"], f"frozen parameters with gradients or optimizer state: {r['frozen_with_state']}"
    # each rank holds its stages' parameters, and gradients and optimizer state for their trainable ones only:
    # exactly the estimate for its pipeline (and data-parallel) coordinates
    for rank, (held, predicted) in enumerate(r["bytes_held"]):
        assert held == predicted, (rank, held, predicted)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pp2_zbv_llama4", "pp2_1f1b_qwen3_moe"])
def test_the_pipelines_eval_step_is_the_peft_models_loss(results, name):
    assert results[f"eval:{name}"]["eval_diff"] <= TOL, results[f"eval:{name}"]


@pytest.mark.slow
def test_save_pretrained_writes_every_stages_adapters(results):
    """PEFT's files from a pipeline hold the adapters of every stage, not only rank 0's: they reload the run's."""
    r = results["pp2_gpipe_llama"]["reloaded"]
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(r["files"]), r
    assert r["max_diff"] == 0.0, r


def test_the_pipeline_split_reaches_into_the_wrapper():
    """Each stage is a copy of the whole PEFT wrapper under its names, holding only its layers (with their
    adapters); validation dry-runs the split through the wrapper before any process group."""
    import torch.distributed as dist

    import ultrascale_plugins as us
    from peft_pp_worker import peft_worker
    from ultrascale_plugins.dims.pipeline.split import build_stage
    from ultrascale_plugins.core.engine import model_plan
    from ultrascale_plugins.models.placeholder import present_modules

    model = peft_worker.peft_model("llama", {"modules_to_save": ["lm_head"]})
    config = us.validate(us.ParallelConfig(pp=2, dp_shard=1), model.config, 2, model=model)
    root = model_plan(model, config).root
    first, last = (build_stage(model, s, 2, range(s, s + 1), root) for s in (0, 1))
    names = {n for n, _ in model.named_parameters()}
    own = [{n for n, _ in stage.named_parameters()} for stage in (first, last)]
    assert own[0] | own[1] == names and not own[0] & own[1]
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight" in own[0]
    assert "base_model.model.lm_head.modules_to_save.default.weight" in own[1]
    assert "base_model.model.model.layers.1" not in present_modules(first)
    assert not dist.is_initialized()
