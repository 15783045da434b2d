"""Tensor parallelism: the ranks' process group, the fixed reduction tree, what each rank loads,
and the worker processes of a tensor-parallel engine (`workers`)."""
