"""The engine: parallelize and its ParallelModel, the Hugging Face module behind it, initialization of a meta-device model's shards, the built-in step, the communication report."""
