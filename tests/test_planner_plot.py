"""The ``ultrascale plan --plot`` figure: the pipeline schedule simulator, the step schedule the plot draws, and the
PNG."""
import sys
from collections import Counter

import pytest

from ultrascale_plugins.interface.config import ConfigError
from ultrascale_plugins.dims.pipeline.timeline import schedule_timeline
from ultrascale_plugins.interface.step_schedule import StepSchedule
from ultrascale_plugins.planner.cost import Layout, Result
from ultrascale_plugins.planner.plot import idle_fraction, plot_plan, step_schedule

SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev"]


def stage(schedule, p, rank, chunk):
    if schedule in ("zbv", "dualpipev"):
        return rank if chunk == 0 else 2 * p - 1 - rank
    return chunk * p + rank


def check_valid(timeline, schedule, p, m, chunks):
    """Every (micro-batch, stage) runs F and B (and W or not at all) once; dependencies hold; a rank does one
    thing at a time."""
    end = {}
    for rank, row in enumerate(timeline):
        for (s0, e0, *_), (s1, *_) in zip(row, row[1:]):
            assert e0 <= s1, f"rank {rank} overlaps itself"
        for start, stop, kind, mb, chunk in row:
            end[kind, mb, stage(schedule, p, rank, chunk)] = (start, stop)
    counts = Counter((kind, mb, st) for rank, row in enumerate(timeline)
                     for _, _, kind, mb, chunk in row for st in [stage(schedule, p, rank, chunk)])
    n = p * chunks
    for mb in range(m):
        for st in range(n):
            assert counts["F", mb, st] == 1 and counts["B", mb, st] == 1, (mb, st)
            assert counts["W", mb, st] in (0, 1)
            if st > 0:
                assert end["F", mb, st][0] >= end["F", mb, st - 1][1], f"F{mb} on stage {st} before stage {st - 1}"
            waits = end["B", mb, st + 1] if st < n - 1 else end["F", mb, st]
            assert end["B", mb, st][0] >= waits[1], f"B{mb} on stage {st} too early"
            if counts["W", mb, st]:
                assert end["W", mb, st][0] >= end["B", mb, st][1]
    assert sum(counts.values()) == len(counts)


def test_1f1b_timeline_is_complete_respects_dependencies_and_has_the_classic_bubble():
    p, m = 4, 8
    timeline = schedule_timeline("1f1b", p, m)
    assert len(timeline) == p
    check_valid(timeline, "1f1b", p, m, 1)
    assert all(kind in "FB" for row in timeline for _, _, kind, _, _ in row)
    assert max(row[-1][1] for row in timeline) == 3 * (m + p - 1)  # t_b = 2 t_f
    assert idle_fraction(timeline) == pytest.approx((p - 1) / (m + p - 1), abs=1e-9)
    # warm-up: rank r runs p - r - 1 forwards before its first backward
    for rank, row in enumerate(timeline):
        kinds = "".join(kind for _, _, kind, _, _ in row)
        assert kinds.index("B") == p - rank


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("p,m", [(2, 2), (4, 8), (4, 6), (3, 2), (8, 16)])
def test_every_schedule_gives_a_valid_timeline(schedule, p, m):
    chunks = {"interleaved_1f1b": 2, "zero_bubble": 2, "zbv": 2, "dualpipev": 2}.get(schedule, 1)
    check_valid(schedule_timeline(schedule, p, m, v=2), schedule, p, m, chunks)


def test_bubbles_compare_as_the_schedules_promise():
    p, m = 4, 8
    one_f_one_b = idle_fraction(schedule_timeline("1f1b", p, m))
    assert idle_fraction(schedule_timeline("gpipe", p, m)) == pytest.approx(one_f_one_b)
    interleaved = idle_fraction(schedule_timeline("interleaved_1f1b", p, m, v=2))
    assert interleaved < one_f_one_b
    assert interleaved == pytest.approx((p - 1) / (2 * m + p - 1))  # Megatron: bubble shrinks by v
    zb_h1 = idle_fraction(schedule_timeline("zero_bubble", p, m, v=1))
    assert zb_h1 == pytest.approx((p - 1) / (3 * m + p - 1))  # ZB-H1: a third of 1F1B's idle time
    assert idle_fraction(schedule_timeline("zbv", p, m)) < zb_h1
    assert idle_fraction(schedule_timeline("1f1b", 1, m)) == 0


def test_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        schedule_timeline("looped_bfs", 2, 4)


def test_the_plot_draws_the_step_schedule_the_layout_runs():
    """``ultrascale_cost_schedule``: with pp > 1 the pipeline's micro-batches, the ranks worth costing and its
    simulated timeline; without a pipeline the default, one rank running each micro-batch's forward then backward
    (the simulated 1F1B of one stage)."""
    lay = Layout(dp_shard=2, pp=4, grad_accum=8, pp_schedule="interleaved_1f1b", pp_virtual_stages=2)
    schedule = step_schedule(lay)
    assert schedule.microbatches == 8 and schedule.coordinates == {"pp": [0, 1, 3]}
    assert schedule.timeline(6) == schedule_timeline("interleaved_1f1b", 4, 6, v=2)
    assert step_schedule(Layout(dp_shard=4, grad_accum=8)) == StepSchedule()
    assert StepSchedule().timeline(5) == schedule_timeline("1f1b", 1, 5)


def result(fits=True, total=None, **layout):
    memory = {"params": 10.0, "grads": 10.0, "optimizer": 20.0, "activations": 30.0, "other": 2.0}
    memory["total"] = total or sum(memory.values())
    return Result(layout=Layout(**layout), fits=fits, memory_gb=memory, step_s=1.0, tokens_per_s_per_gpu=1e3,
                  mfu=0.4, dominant="compute", runnable=True, times_s={"compute": 0.8, "bubble": 0.2})


@pytest.mark.parametrize("best", [
    result(dp_shard=4, tp=2, pp=2, zero_stage=1, micro_batch_size=2, grad_accum=4),
    result(dp_shard=2, pp=4, grad_accum=24, pp_schedule="interleaved_1f1b", pp_virtual_stages=2,
           activation_checkpointing="selective"),
    result(dp_shard=16, zero_stage=3, grad_accum=2),
], ids=["pp2-1f1b", "pp4-interleaved", "pp1"])
def test_plot_plan_writes_a_png(tmp_path, best):
    others = [result(dp_shard=8, tp=2, grad_accum=2), result(fits=False, dp_shard=16, cp=2),
              result(fits=False, total=120.0, dp_shard=32, activation_checkpointing="full")]
    path = tmp_path / "plan.png"
    plot_plan([best, *others], best, str(path), memory_limit_gb=80.0, top=3)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000


def test_missing_matplotlib_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    best = result(pp=2, grad_accum=4)
    path = tmp_path / "plan.png"
    with pytest.raises(ConfigError, match=r'pip install "matplotlib>='):
        plot_plan([best], best, str(path), memory_limit_gb=80.0)
    assert not path.exists()
