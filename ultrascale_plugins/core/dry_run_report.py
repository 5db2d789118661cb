"""What ``us.dry_run`` reports, per rank role: live bytes at the peak by category (torch's ``MemTracker``) and where
the peak falls, bytes handed to the collectives per mesh axis (the communication ledger), and beside each the
planner's estimate for the same layout and the difference. ``table()`` for people, ``to_json()`` for tools."""
from __future__ import annotations

import dataclasses

MB = 2**20
# the planner's memory categories, each the sum of MemTracker's categories it covers at the peak; "params" is
# what the rank holds before the step (its shards), the parameters gathered for the layer running at the peak go
# to "other", where the planner prices its communication buffers
CATEGORIES = {"grads": ("Gradient",), "optimizer": ("Optstate",), "activations": ("Activation", "Temp"),
              "other": ("Buffer", "Other")}


@dataclasses.dataclass
class RoleReport:
    """One rank role: ``peak`` (MemTracker's categories at the peak, bytes; "Total" among them), ``held`` (the
    same before the step: the shards and the optimizer's states), ``peak_where``,
    ``comm`` ({axis: bytes handed to its collectives in the step}), ``local_parameter_bytes`` (the shards
    ``parallelize`` gave this rank), and the planner's ``estimate_memory`` / ``estimate_comm`` for the layout."""

    role: str
    rank: int
    peak: dict
    held: dict
    peak_where: str
    comm: dict
    local_parameter_bytes: int
    estimate_memory: dict = dataclasses.field(default_factory=dict)
    estimate_comm: dict = dataclasses.field(default_factory=dict)

    def memory(self) -> dict:
        """{planner category or "total": bytes the dry run holds at its peak}."""
        held = self.held.get("Parameter", 0)
        out = {"params": held, **{name: sum(self.peak.get(k, 0) for k in parts) for name, parts in CATEGORIES.items()}}
        out["other"] += self.peak.get("Parameter", 0) - held  # gathered for the layer running at the peak
        out["total"] = self.peak.get("Total", sum(out.values()))
        return out

    def rows(self) -> list[dict]:
        """Memory rows then communication rows: {"what", "dry_run", "estimate", "diff_pct"} (bytes)."""
        rows = [_row(f"memory {name}", dry, self.estimate_memory.get(name, 0.0)) for name, dry in self.memory().items()]
        for axis in sorted(set(self.comm) | set(self.estimate_comm)):
            rows.append(_row(f"comm {axis}", self.comm.get(axis, 0), self.estimate_comm.get(axis, 0.0)))
        return rows


def _row(what: str, dry: float, est: float) -> dict:
    diff = None if dry < 1024 else round(100 * (est - dry) / dry, 1)  # no ratio to a figure of nothing
    return {"what": what, "dry_run": int(dry), "estimate": int(est), "diff_pct": diff}


@dataclasses.dataclass
class DryRunReport:
    roles: list
    world_size: int
    seq_len: int
    micro_batch_size: int
    layout: str
    seconds: float
    assumed: list = dataclasses.field(default_factory=list)  # where values would decide: what the step assumed
    microbatches: int = 1  # the micro-batches of one step (a pipeline's, or those accumulated), each of mbs rows

    def to_json(self) -> dict:
        return {"world_size": self.world_size, "seq_len": self.seq_len, "micro_batch_size": self.micro_batch_size,
                "microbatches": self.microbatches, "layout": self.layout, "seconds": round(self.seconds, 2),
                "assumed": self.assumed,
                "roles": [{"role": r.role, "rank": r.rank, "peak_where": r.peak_where, "peak": r.peak, "held": r.held,
                           "local_parameter_bytes": r.local_parameter_bytes, "rows": r.rows()} for r in self.roles]}

    def table(self) -> str:
        each = f" per micro-batch, {self.microbatches} micro-batches" if self.microbatches > 1 else ""
        lines = [f"dry run: {self.layout}, {self.world_size} ranks, {self.micro_batch_size} x {self.seq_len} tokens "
                 f"per rank{each}, one step in {self.seconds:.1f} s (fake tensors; the estimate before the allocator's "
                 "constants)"]
        if self.assumed:
            lines.append(f"assumed: {'; '.join(self.assumed)}")
        for role in self.roles:
            lines.append(f"{role.role} (rank {role.rank} traced): peak at {role.peak_where}")
            lines.append(f"  {'':28} {'dry run MB':>12} {'estimate MB':>12} {'diff':>8}")
            for row in role.rows():
                diff = "" if row["diff_pct"] is None else f"{row['diff_pct']:+.1f} %"
                lines.append(f"  {row['what']:28} {row['dry_run'] / MB:12.1f} {row['estimate'] / MB:12.1f} {diff:>8}")
        return "\n".join(lines)

    __str__ = table
