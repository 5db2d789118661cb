"""The data path: dataset files, chat labels, the tokenized cache, packed rows, what the command line and the front ends read."""
