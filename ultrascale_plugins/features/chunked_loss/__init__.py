"""The chunked loss: the head and the cross-entropy a chunk of tokens at a time, so no rank holds a micro-batch's logits."""
