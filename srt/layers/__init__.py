"""Model building blocks: norms, rotary embedding, linear layers, embeddings, logits."""
