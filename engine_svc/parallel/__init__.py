"""Tensor parallelism over torch.distributed: which slice a rank holds, the collectives, and the
worker processes that mirror rank 0's forward passes."""
