"""CPU kernels in C++, built on first use (`extension.load_extension`)."""
