"""Context parallelism (ring, Ulysses): the plugin, the sequence layout, the attention and its kernels."""
