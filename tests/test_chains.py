"""The cost chain (``ultrascale_cost_estimate``) and the batch split (``ultrascale_step_shard_batch``) run in the order of the
stages' names (``interface.stages.step``, ``core/chains.py``), not pluggy's markers: a third party's estimate placed
after "tp" sees the inventory tensor parallel cut, and ``us.describe`` prints the chain in order."""
from __future__ import annotations

import pytest

import ultrascale_plugins as us


class _AfterTP:
    """A third-party estimate placed after tensor parallel: records the local shapes it sees."""

    def __init__(self):
        self.seen: list = []

    @us.hookimpl
    @us.step("acme_after_tp", after="tp", before="dp")
    def ultrascale_cost_estimate(self, config, model_config, shape, estimate):
        self.seen = [(r.name, tuple(r.shape), tuple(r.local)) for r in shape.inventory]


class _Wrapper:
    @us.hookimpl(wrapper=True)
    def ultrascale_cost_estimate(self, config, model_config, shape, estimate):
        return (yield)


@pytest.fixture
def registered():
    added = []

    def add(plugin, name):
        us.register(plugin, name=name)
        added.append(name)
        return plugin
    yield add
    for name in added:
        us.unregister(name=name)


def test_an_estimate_after_tp_sees_the_inventory_tensor_parallel_cut(registered):
    from models import make_config

    probe = registered(_AfterTP(), "acme_after_tp")
    mc = make_config("llama")
    us.estimate(us.ParallelConfig(tp=2, dp_shard=2), mc, world_size=4)
    q = [(shape, local) for name, shape, local in probe.seen if name.endswith("q_proj.weight")]
    assert q and all(local[0] * 2 == shape[0] for shape, local in q), q  # column-wise: half the rows each


def test_describe_prints_the_cost_chain_and_the_batch_split_in_order(registered):
    from models import make_config

    registered(_AfterTP(), "acme_after_tp")
    text = us.describe(us.ParallelConfig(tp=2, dp_shard=2, cp=2), make_config("llama"), world_size=8)
    chain = text.split("cost chain:\n")[1].split("\n\n")[0].splitlines()
    assert [line.split()[1] for line in chain] == ["cp_tokens", "split", "activations", "ep", "tp", "chunked_loss",
                                                   "acme_after_tp", "dp", "cp_exchanges"], chain
    assert "(step: after tp; before dp)  (acme_after_tp)" in chain[6]
    hooks = text.split("step hooks:\n")[1].split("\n\n")[0].splitlines()
    split = next(line for line in hooks if line.startswith("ultrascale_step_shard_batch:"))
    assert split.index("tensor.plugin [at tp") < split.index("context.plugin [at cp")
    assert "view experts" not in text.split("mesh:\n")[1].split("\n\n")[0]  # no ep: no experts view


def test_a_wrapper_of_a_chain_hook_is_refused_with_a_fix(registered):
    from models import make_config

    registered(_Wrapper(), "bad_wrapper")
    with pytest.raises(us.ConfigError, match="bad_wrapper's ultrascale_cost_estimate is marked wrapper.*@step"):
        us.estimate(us.ParallelConfig(tp=2, dp_shard=2), make_config("llama"), world_size=4)


def test_a_step_at_a_stage_name_with_its_own_after_is_refused():
    from ultrascale_plugins.interface.stages import Stage, Step, order_chain

    stages = [Stage("tp", None), Stage("dp", None, after="tp")]
    with pytest.raises(us.ConfigError, match="runs at the stage 'tp' and declares after/before"):
        order_chain(stages, [Step("tp", after="dp", plugin="p")])
    free, mine = Step("free", plugin="p", declared=False), Step("mine", after="tp", before="dp", plugin="p")
    at_dp = Step("dp", plugin="p")
    assert [s.name for s in order_chain(stages, [free, at_dp, mine])] == ["mine", "dp", "free"]
