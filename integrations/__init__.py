"""Framework adapters, installed as ``ultrascale_plugins.integrations`` (pyproject.toml's package-dir): thin layers
over the engine (``ultrascale_plugins.parallelize``).

- ``lightning``: ``UltraScaleStrategy`` and the ``Trainer(strategy="ultrascale_...")`` names, for
  ``lightning.pytorch`` (and ``pytorch_lightning``, the standalone package, when installed);
- ``accelerate``: ``UltraScaleAccelerator`` and ``UltraScalePlugin``, configured through Accelerate's YAML file;
- ``trainer``: ``UltraScaleTrainer``, a ``transformers.Trainer`` on any layout;
- ``trl``: ``UltraScaleSFTTrainer``, ``UltraScaleDPOTrainer`` (``trl_contract``: what the Trainer does on them);
- ``hf_module``: ``ParallelCausalLM``, the parallel model behind Hugging Face's call signature, which Lightning and
  Accelerate hand to user code.

Keep this file free of code: in a source checkout ``ultrascale_plugins/integrations/__init__.py`` stands in for it
(see that file).
"""
