"""Tensor and sequence parallelism: the plugin, its styles, the dry run of a model's plan, sequence parallel regions, its costs."""
