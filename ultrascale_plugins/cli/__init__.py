"""The ``ultrascale`` command: its subcommands, the torchrun worker that trains a recipe, and the supervisor of what it launches."""
