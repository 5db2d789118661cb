"""Mesh axes are placed by name (``MeshAxis(..., after=, before=)``), ordered by ``ordering.order_by_names`` like
the model transforms: the built-in order, a third party's axis between two built-ins, and the one-line refusals
(a name nobody declares, a cycle, an axis declared twice) naming the plugins."""
import pytest

import ultrascale_plugins as us
from ultrascale_plugins import hookimpl
from ultrascale_plugins.interface.parallel_dims import ParallelDims


def _axes_with(plugin, config):
    us.register(plugin, name="axis_test")
    try:
        return [a.name for a in config.registry.axes(config)]
    finally:
        us.unregister(name="axis_test")


class _Declares:
    def __init__(self, *axes):
        self.axes = axes

    @hookimpl
    def ultrascale_declare_mesh_axes(self, config):
        return list(self.axes)


def test_the_built_in_order_is_pp_dp_replicate_dp_shard_cp_tp():
    config = us.ParallelConfig(pp=2, dp_replicate=2, dp_shard=2, cp=2, tp=2)
    assert [a.name for a in config.registry.axes(config)] == ["pp", "dp_replicate", "dp_shard", "cp", "tp"]
    dims = ParallelDims(config.resolve(32), 32)
    assert [a.name for a in dims.live_axes] == ["pp", "dp_replicate", "dp_shard", "cp", "tp"]
    assert [dims.coordinate(r, ("tp",)) for r in range(4)] == [0, 1, 0, 1]  # innermost: consecutive ranks


@pytest.mark.parametrize("after, before", [("dp_replicate", "dp_shard"), (("dp_replicate",), ("dp_shard",)),
                                           (("pp", "dp_replicate"), "dp_shard")])
def test_a_third_party_axis_lies_where_its_names_say(after, before):
    axis = us.MeshAxis("acme_dp", 1, after=after, before=before)
    assert isinstance(axis.after, tuple) and isinstance(axis.before, tuple)
    assert _axes_with(_Declares(axis), us.ParallelConfig()) == ["pp", "dp_replicate", "acme_dp", "dp_shard", "cp",
                                                               "tp"]


@pytest.mark.parametrize("axes, message", [
    ([us.MeshAxis("acme_dp", 1, after="dp_replica")],
     r"^mesh axis 'acme_dp' of axis_test lies after 'dp_replica', which no plugin declares\. Fix: use one of "
     r"acme_dp, cp, dp_replicate, dp_shard, pp, tp$"),
    ([us.MeshAxis("acme_dp", 1, after="tp", before="pp")],
     r"^the mesh axes .*'acme_dp' \(axis_test\).*'pp' \(ultrascale_plugins\.dims\.pipeline\.plugin\).* each wait for "
     r"another: a cycle in their after/before\. Fix: drop one of those declarations$"),
    ([us.MeshAxis("tp", 1)],
     r"^mesh axis 'tp' is declared by both axis_test and ultrascale_plugins\.dims\.tensor\.plugin\. Fix: rename one"),
])
def test_an_axis_placed_wrongly_is_refused_naming_the_plugins(axes, message):
    with pytest.raises(us.ConfigError, match=message) as err:
        _axes_with(_Declares(*axes), us.ParallelConfig())
    assert "\n" not in str(err.value)
