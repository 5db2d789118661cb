"""Framework adapters (installed as ``ultrascale_plugins.integrations``). Lightning and Accelerate adapters are
not available yet: they arrive as thin layers over ``ultrascale_plugins.parallelize``."""
