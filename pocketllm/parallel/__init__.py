"""Tensor parallelism's primitives: the ranks' process group, the fixed reduction tree, what each
rank loads. The worker processes that run on them are `pocketllm.workers`, above the models."""
