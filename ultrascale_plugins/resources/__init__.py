"""Files shipped with the package: the embedded default recipe, the bundled corpus, the packing verdicts, the Playbook measurements."""
