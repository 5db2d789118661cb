"""What a plugin offers the planner's search for its own layout fields (``ultrascale_cost_search``): the values worth
costing with a candidate layout, in three kinds the planner searches in turn. The search sets the built-in fields
itself (degrees, ZeRO stage, recomputation, schedule, precision); a plugin's own fields are searched only through
this offer, so a third-party kernel choice or memory saver is tried like the built-in ones."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SearchOffer:
    """``{field: [value, ...]}`` of this plugin's layout fields, by when the planner tries them:

    - ``choices``: with every candidate layout (expert parallelism's ``ep`` degrees). List the default too when the
      candidate without the feature is worth costing;
    - ``savers``: values that save memory at a price in time (the chunked loss, states held on the host), tried only
      once no layout fits without them;
    - ``lossy``: values that save memory and change the numbers (states held in bf16), tried only once none fits
      with the savers alone.

    The planner tries savers and lossy values in every combination with the field's current value, and says what
    each costs against the same layout without it."""

    choices: dict[str, list] = dataclasses.field(default_factory=dict)
    savers: dict[str, list] = dataclasses.field(default_factory=dict)
    lossy: dict[str, list] = dataclasses.field(default_factory=dict)
