"""Parallelism dimensions, one folder per family (data_parallel, tensor, pipeline, context, expert), each a plugin."""
