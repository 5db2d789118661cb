"""Pipeline parallelism: the plugin, the model's split into stages, the schedule's runtime, its costs and timeline."""
