"""The kernel lab: tools that look at the Triton kernels themselves rather than run a model."""
