"""Data parallelism (DDP, ZeRO-1/2/3, HSDP on FSDP2): the plugin and its costs."""
