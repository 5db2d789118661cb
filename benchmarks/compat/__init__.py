"""The compatibility sweep: tiny configs for every causal-LM type, a parity worker, the layouts it runs."""
