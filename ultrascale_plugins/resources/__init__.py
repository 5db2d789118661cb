"""Files shipped with the package: the embedded default recipe, the bundled corpus, the packing verdicts, the Playbook
measurements, and the planner's model presets as their published config.json files (``config-<preset>.json``)."""
