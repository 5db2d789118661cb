"""The interface: what a dimension is (hookspecs, fields, config, parallel_dims, plugins, mesh, runtime, presets, estimates)."""
