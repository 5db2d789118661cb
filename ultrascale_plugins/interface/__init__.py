"""The interface: what a dimension is and what the engine asks of it (hookspecs, fields, config, meshes, stages, plan)."""
