"""Model building blocks shared by the architectures: RMSNorm, rotary embeddings, and the
attention layer that hands q/k/v to the batch's attention backend."""
