"""Built-in parallelism dimensions, each a pluggy plugin behind the hooks in ``hookspecs``."""
