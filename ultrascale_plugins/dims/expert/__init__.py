"""Expert parallelism: the plugin and the token dispatch between ranks."""
