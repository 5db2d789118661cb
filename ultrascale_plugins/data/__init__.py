"""The data path and the recipe: dataset files, chat labels, the tokenized cache, packed rows, a recipe's sections."""
