"""The planner: ``ultrascale plan`` and ``layout: auto``, from the plugins' estimates to time, search and validation."""
