"""Features that are not a mesh dimension, one folder each: PEFT, routers, float8, compile, activation checkpointing."""
