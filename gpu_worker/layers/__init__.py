"""Model building blocks shared by the architectures: RMSNorm (fused with the residual add),
rotary embeddings and their cos/sin cache, merged and tensor-parallel projections
(`MergedLinear`, `RowParallelLinear`), the vocabulary-parallel embedding and LM head, and the
attention layer that applies RoPE, stores K/V and hands q to the batch's attention backend.
Layers that have a Triton kernel and a torch reference carry `use_triton` (`set_use_triton`)."""
